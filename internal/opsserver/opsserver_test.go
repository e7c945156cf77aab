package opsserver

import (
	"context"
	"fmt"
	"net"
	"net/http"
	"runtime"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// The profiles are served on a listener of their own and stop with the context.
// The profiles are served, but not the command line: flags may hold secrets (a
// --database-url with a password), which pprof.Cmdline printed in clear.
func TestServePprof(t *testing.T) {
	ln, err := (&net.ListenConfig{}).Listen(context.Background(), "tcp", "127.0.0.1:0")
	require.NoError(t, err)
	addr := ln.Addr().String()

	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- servePprof(ctx, ln) }()
	get := func(path string) int {
		req, err := http.NewRequestWithContext(ctx, http.MethodGet, fmt.Sprintf("http://%s%s", addr, path), nil)
		require.NoError(t, err)
		resp, err := http.DefaultClient.Do(req)
		require.NoError(t, err)
		require.NoError(t, resp.Body.Close())
		return resp.StatusCode
	}
	require.Equal(t, http.StatusOK, get("/debug/pprof/"))
	require.Equal(t, http.StatusOK, get("/debug/pprof/goroutine?debug=1"))
	require.Equal(t, http.StatusNotFound, get("/debug/pprof/cmdline"), "the command line may hold secrets")

	cancel()
	select {
	case err := <-done:
		require.NoError(t, err)
	case <-time.After(10 * time.Second):
		t.Fatal("servePprof did not return after its context ended")
	}
}

// Every registry carries baton_build_info, 1, labelled with the version, revision and Go
// version; a version set at link time wins.
func TestBuildInfo(t *testing.T) {
	old := Version
	Version = "v9.8.7"
	t.Cleanup(func() { Version = old })
	mfs, err := NewRegistry().Gather()
	require.NoError(t, err)
	for _, mf := range mfs {
		if mf.GetName() != "baton_build_info" {
			continue
		}
		require.Len(t, mf.GetMetric(), 1)
		m := mf.GetMetric()[0]
		require.Equal(t, 1.0, m.GetGauge().GetValue())
		labels := map[string]string{}
		for _, l := range m.GetLabel() {
			labels[l.GetName()] = l.GetValue()
		}
		require.Equal(t, "v9.8.7", labels["version"])
		require.Equal(t, runtime.Version(), labels["goversion"])
		require.NotEmpty(t, labels["revision"])
		return
	}
	t.Fatal("no baton_build_info in the registry")
}

// A connection that never sent a request (a client's spare dial) does not hold the metrics
// server's stop: Shutdown counted it as busy for 5 s and failed, and the relay or worker then
// exited with an error on SIGTERM.
func TestStopWithSpareConnection(t *testing.T) {
	ln, err := (&net.ListenConfig{}).Listen(context.Background(), "tcp", "127.0.0.1:0")
	require.NoError(t, err)
	addr := ln.Addr().String()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	done := make(chan error, 1)
	go func() { done <- ServeListener(ctx, ln, NewRegistry(), func() bool { return true }) }()
	var d net.Dialer
	spare, err := d.DialContext(context.Background(), "tcp", addr)
	require.NoError(t, err)
	defer func() { _ = spare.Close() }()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, "http://"+addr+"/healthz", nil)
	require.NoError(t, err)
	resp, err := http.DefaultClient.Do(req) // answered after the spare connection was accepted
	require.NoError(t, err)
	require.NoError(t, resp.Body.Close())

	cancel()
	select {
	case err := <-done:
		require.NoError(t, err)
	case <-time.After(3 * time.Second):
		t.Fatal("the metrics server did not stop within 3s: the spare connection held it")
	}
}

func TestListeningAddr(t *testing.T) {
	for _, tc := range []struct {
		line, want string
		ok         bool
	}{
		{`time=2026-12-03T18:00:00Z level=INFO msg="metrics listening" addr=127.0.0.1:41234`, "127.0.0.1:41234", true},
		{`time=2026-12-03T18:00:00Z level=INFO msg="metrics listening" addr=127.0.0.1:41234 more=x`, "127.0.0.1:41234", true},
		{`time=2026-12-03T18:00:00Z level=INFO msg="metrics listening" addr="[::1]:41234"`, "[::1]:41234", true},
		{`{"time":"2026-12-03T18:00:00Z","level":"INFO","msg":"metrics listening","addr":"127.0.0.1:41234"}`, "127.0.0.1:41234", true},
		{`{"time":"2026-12-03T18:00:00Z","level":"INFO","msg":"pprof listening","addr":"127.0.0.1:41234"}`, "", false},
		{`time=2026-12-03T18:00:00Z level=INFO msg="pprof listening" addr=127.0.0.1:41234`, "", false},
		{`time=2026-12-03T18:00:00Z level=INFO msg="metrics listening"`, "", false},
		{`time=2026-12-03T18:00:00Z level=INFO msg=streaming addr=127.0.0.1:1`, "", false},
	} {
		addr, ok := ListeningAddr(tc.line, MetricsListening)
		require.Equal(t, tc.ok, ok, tc.line)
		require.Equal(t, tc.want, addr, tc.line)
	}
}
