package main

import (
	"context"
	"encoding/json"
	"io"
	"net/http"
	"os"
	"regexp"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/batonhq/baton/internal/config"
	"github.com/batonhq/baton/internal/console"
	"github.com/batonhq/baton/internal/testsvc"
)

var consoleURLRE = regexp.MustCompile(`console on (http://\S+/)`)

// TestConsoleRefusesNonLoopback: without auth, a non-loopback address is a usage error, and
// the password never shows in what the command prints.
func TestConsoleRefusesNonLoopback(t *testing.T) {
	t.Setenv(config.EnvDatabaseURL, "postgres://nobody@127.0.0.1:1/none")
	t.Setenv(console.EnvUser, "")
	t.Setenv(console.EnvPassword, "")
	t.Setenv(console.EnvPasswordFile, "")
	t.Setenv(console.EnvAddr, "0.0.0.0:0")
	r := runBaton(t, "console")
	require.Equal(t, 2, r.code, r.stderr)
	require.Contains(t, r.stderr, "refusing to serve the console on a non-loopback address without authentication")

	r = runBaton(t, "console", "--addr", "127.0.0.1:0", "--user", "ops")
	require.Equal(t, 2, r.code, r.stderr)
	require.Contains(t, r.stderr, "basic auth needs both")

	for _, n := range []string{"0", "-1"} {
		r = runBaton(t, "console", "--addr", "127.0.0.1:0", "--max-streams-per-client", n)
		require.Equal(t, 2, r.code, r.stderr)
		require.Contains(t, r.stderr, "--max-streams-per-client must be at least 1")
	}
}

// TestConsoleServes: `baton console` serves until its context ends, then exits 0; with auth
// from a password file the API needs it, and the password is never logged;
// --max-streams-per-client caps one client's event streams.
func TestConsoleServes(t *testing.T) {
	db := testsvc.NewDatabase(t)
	pwFile := t.TempDir() + "/pw"
	require.NoError(t, os.WriteFile(pwFile, []byte("hunter2-console\n"), 0o600))
	t.Setenv(config.EnvDatabaseURL, db.RoleURL(testsvc.RoleConsole))
	t.Setenv(config.EnvLogLevel, "debug")
	t.Setenv(console.EnvAddr, "0.0.0.0:0") // allowed: auth is on
	t.Setenv(console.EnvUser, "ops")
	t.Setenv(console.EnvPassword, "")
	t.Setenv(console.EnvPasswordFile, pwFile)

	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	var stdout, stderr testsvc.Buffer
	done := make(chan int, 1)
	go func() { done <- run(ctx, []string{"console", "--max-streams-per-client", "1"}, &stdout, &stderr) }()
	var base string
	require.Eventually(t, func() bool {
		m := consoleURLRE.FindStringSubmatch(stdout.String())
		if m != nil {
			base = strings.Replace(m[1], "[::]", "127.0.0.1", 1)
			base = strings.Replace(base, "0.0.0.0", "127.0.0.1", 1)
		}
		return m != nil
	}, time.Minute, 10*time.Millisecond, "stderr: %s", stderr.String())

	get := func(path, user, pass string) (int, string) {
		req, err := http.NewRequestWithContext(ctx, http.MethodGet, base+strings.TrimPrefix(path, "/"), nil)
		require.NoError(t, err)
		if user != "" {
			req.SetBasicAuth(user, pass)
		}
		res, err := http.DefaultClient.Do(req)
		require.NoError(t, err)
		defer func() { _ = res.Body.Close() }()
		b, err := io.ReadAll(res.Body)
		require.NoError(t, err)
		return res.StatusCode, string(b)
	}
	code, _ := get("/healthz", "", "")
	require.Equal(t, http.StatusOK, code)
	code, _ = get("/api/status", "", "")
	require.Equal(t, http.StatusUnauthorized, code)
	code, body := get("/api/status", "ops", "hunter2-console")
	require.Equal(t, http.StatusOK, code, body)
	var st map[string]any
	require.NoError(t, json.Unmarshal([]byte(body), &st))
	for _, k := range []string{"slot", "outbox", "streams", "schema", "console"} {
		require.Contains(t, st, k)
	}

	// One event stream of this client is open; a second is refused.
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, base+"api/conversations", strings.NewReader(`{"id":"conv-1"}`))
	require.NoError(t, err)
	req.SetBasicAuth("ops", "hunter2-console")
	res, err := http.DefaultClient.Do(req)
	require.NoError(t, err)
	require.NoError(t, res.Body.Close())
	require.Equal(t, http.StatusCreated, res.StatusCode)
	streamCtx, closeStream := context.WithCancel(ctx)
	req, err = http.NewRequestWithContext(streamCtx, http.MethodGet, base+"api/conversations/conv-1/events", nil)
	require.NoError(t, err)
	req.SetBasicAuth("ops", "hunter2-console")
	stream, err := http.DefaultClient.Do(req)
	require.NoError(t, err)
	require.Equal(t, http.StatusOK, stream.StatusCode)
	code, body = get("/api/conversations/conv-1/events", "ops", "hunter2-console")
	require.Equal(t, http.StatusServiceUnavailable, code, body)
	require.Contains(t, body, "too many open event streams from this client (at most 1)")
	closeStream()
	_ = stream.Body.Close()

	cancel()
	select {
	case c := <-done:
		require.Equal(t, 0, c, "stderr: %s", stderr.String())
	case <-time.After(time.Minute):
		t.Fatal("baton console did not stop")
	}
	require.NotContains(t, stdout.String()+stderr.String(), "hunter2")
}

// TestDemoConsole: `baton demo --console` runs the demo, then serves the console with the relay
// and the echo workers still running, so a message sent from the console is answered; SIGINT
// ends it, cleaned up.
func TestDemoConsole(t *testing.T) {
	t.Parallel()
	p := startDemo(t, "--messages", "20", "--conversations", "2", "--rate", "0", "--console", "--console-addr", "127.0.0.1:0")
	var base string
	deadline := time.After(3 * time.Minute)
	for base == "" {
		if m := consoleURLRE.FindStringSubmatch(p.output()); m != nil {
			base = m[1]
			break
		}
		select {
		case <-p.exited:
			t.Fatalf("baton demo exited\nstdout:\n%s\nstderr:\n%s", p.output(), p.stderr.String())
		case <-deadline:
			t.Fatalf("no console URL\nstdout:\n%s", p.output())
		case <-time.After(20 * time.Millisecond):
		}
	}
	require.Contains(t, p.output(), "result: OK")

	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	post := func(path, body string) (int, string) {
		req, err := http.NewRequestWithContext(ctx, http.MethodPost, base+path, strings.NewReader(body))
		require.NoError(t, err)
		req.Header.Set("Content-Type", "application/json")
		res, err := http.DefaultClient.Do(req)
		require.NoError(t, err)
		defer func() { _ = res.Body.Close() }()
		b, _ := io.ReadAll(res.Body)
		return res.StatusCode, string(b)
	}
	code, body := post("api/conversations", `{"id":"from-the-console"}`)
	require.Equal(t, http.StatusCreated, code, body)
	code, body = post("api/conversations/from-the-console/messages", `{"id":"c-1","content":"hello console"}`)
	require.Equal(t, http.StatusOK, code, body)
	require.Eventually(t, func() bool {
		req, err := http.NewRequestWithContext(ctx, http.MethodGet, base+"api/conversations/from-the-console/messages", nil)
		if err != nil {
			return false
		}
		res, err := http.DefaultClient.Do(req)
		if err != nil {
			return false
		}
		defer func() { _ = res.Body.Close() }()
		var list struct{ Messages []console.MessageView }
		if json.NewDecoder(res.Body).Decode(&list) != nil || len(list.Messages) != 1 {
			return false
		}
		return list.Messages[0].State == console.StateReplied && strings.Contains(list.Messages[0].Reply, "hello console")
	}, time.Minute, 20*time.Millisecond, "the demo's echo workers answer the console's message")

	require.NoError(t, p.cmd.Process.Signal(syscall.SIGINT))
	require.Equal(t, 0, p.wait(t, time.Minute), "stdout:\n%s\nstderr:\n%s", p.output(), p.stderr.String())
	p.requireCleanedUp(t)
}
