package main

import (
	"bytes"
	"context"
	"encoding/json"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/stretchr/testify/require"

	"github.com/batonhq/baton/internal/bench"
	"github.com/batonhq/baton/internal/testsvc"
)

// TestBenchTurnsTiny runs every phase of `baton bench turns` with tiny sizes on the test's
// servers, the relay as a process of the baton binary, and checks the JSON report: every
// message replied, every figure measured, and nothing the bench created left behind.
// Not parallel: see TestBenchRelayEndToEnd.
func TestBenchTurnsTiny(t *testing.T) {
	db := testsvc.NewDatabase(t)
	ns := testsvc.StartNATS(t)
	bin := testsvc.Binary(t, "github.com/batonhq/baton/cmd/baton")
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	var stdout, stderr bytes.Buffer
	err := runBenchTurns(ctx, []string{"--json", "--turns", "300", "--workers", "1,2", "--rates", "20,40",
		"--latency-duration", "1s", "--relay-binary", bin,
		"--database-url", db.URL, "--nats-url", ns.URL()}, &stdout, &stderr)
	require.NoError(t, err, "stderr:\n%s", stderr.String())

	var rep bench.TurnsReport
	require.NoError(t, json.Unmarshal(stdout.Bytes(), &rep), stdout.String())
	require.True(t, rep.Complete())
	require.Equal(t, 1, rep.Settings.Rounds)
	require.Equal(t, bin+" relay", rep.Settings.Relay)

	// Per source: throughput with 1 and 2 workers, tools with 1.
	require.Len(t, rep.Throughput, 6)
	for _, tp := range rep.Throughput {
		require.True(t, tp.Complete, "%+v", tp)
		require.Equal(t, []float64{300}, tp.Sent.Rounds, "%+v", tp)
		require.Equal(t, []float64{300}, tp.Done.Rounds, "%+v", tp)
		require.Zero(t, tp.Failed.Median, "%+v", tp)
		require.Positive(t, tp.TurnsPerSecond.Median, "%+v", tp)
		require.Positive(t, tp.Seconds.Median, "%+v", tp)
		require.Positive(t, tp.CommitBatch.Median, "%+v", tp)
		require.Positive(t, tp.ProcessCPUCores.Median, "%+v", tp)
	}
	require.Len(t, rep.Latency, 4) // 2 sources × 2 rates
	for _, l := range rep.Latency {
		require.True(t, l.Complete, "%+v", l)
		require.Equal(t, float64(l.Rate), l.Sent.Median, "%+v", l)
		require.Equal(t, l.Sent, l.Done, "%+v", l)
		require.Positive(t, l.AchievedRate.Median, "%+v", l)
		require.Positive(t, l.P50MS.Median, "%+v", l)
		require.GreaterOrEqual(t, l.P99MS.Median, l.P50MS.Median, "%+v", l)
	}
	names := make([]string, len(rep.Ratios))
	for i, r := range rep.Ratios {
		names[i] = r.Name
		require.Positive(t, r.Value.Median, r.Name)
	}
	require.Contains(t, names, "jetstream turns/s: read+write tools / no tools, 1 worker")
	require.Contains(t, names, "polling turns/s: 2 workers / 1 worker")
	// Only the targets whose phases ran (1 worker; tools) have a value.
	require.Len(t, rep.Targets, 4)
	require.NotNil(t, rep.Targets[0].Value)
	require.Nil(t, rep.Targets[1].Value) // 4 workers did not run
	require.Nil(t, rep.Targets[2].Value) // 200/s did not run
	require.NotNil(t, rep.Targets[3].Value)
	require.Contains(t, stderr.String(), "phase 10/10: latency polling 40/s")

	// Nothing left: no database, slot or stream of the bench.
	left := testsvc.Query[int](t, db, `SELECT (SELECT count(*) FROM pg_database WHERE datname LIKE 'baton\_bench\_%')
		+ (SELECT count(*) FROM pg_replication_slots WHERE slot_name LIKE 'baton\_bench\_%')`)
	require.Equal(t, []int{0}, left)
	nc, err := nats.Connect(ns.URL())
	require.NoError(t, err)
	defer nc.Close()
	js, err := jetstream.New(nc)
	require.NoError(t, err)
	streams := js.StreamNames(ctx)
	for name := range streams.Name() {
		require.False(t, strings.HasPrefix(name, "BENCH_"), "stream %s left behind", name)
	}
	require.NoError(t, streams.Err())
}

// TestBenchTurnsTable checks the text output of a run of one phase, two rounds: medians with
// each round's value in brackets.
func TestBenchTurnsTable(t *testing.T) {
	t.Parallel()
	db := testsvc.NewDatabase(t)
	ns := testsvc.StartNATS(t)
	bin := testsvc.Binary(t, "github.com/batonhq/baton/cmd/baton")
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	var stdout, stderr bytes.Buffer
	err := runBenchTurns(ctx, []string{"--only", "throughput", "--sources", "jetstream", "--workers", "1",
		"--turns", "100", "--rounds", "2", "--relay-binary", bin, "--database-url", db.URL, "--nats-url", ns.URL()},
		&stdout, &stderr)
	require.NoError(t, err, "stderr:\n%s", stderr.String())
	out := stdout.String()
	require.Regexp(t, `(?m)^jetstream\s+1\s+no tools\s+100/100\s+[0-9.]+\s+[0-9]+ \[[0-9]+ [0-9]+\]`, out)
	require.Regexp(t, `(?m)^\s+turns/s, 1 worker\s+>= 2800 turns/s\s+[0-9]+\s+(met|MISSED)$`, out)
	require.Regexp(t, `(?m)^\s+turns/s, 4 workers / 1 worker\s+>= 0.95\s+-\s+not measured$`, out)
	require.NotContains(t, out, "INCOMPLETE")
	require.Contains(t, out, "workers: in this process, each with a pool (16 connections) and a NATS connection of its own")
}

func TestBenchTurnsUsageErrors(t *testing.T) {
	for _, c := range []struct {
		args []string
		want string
	}{
		{[]string{"--workers", "0"}, `"0" is not a positive integer`},
		{[]string{"--rates", "fast"}, `"fast" is not a positive integer`},
		{[]string{"--sources", "kafka"}, `unknown source "kafka"`},
		{[]string{"--only", "latency,latency"}, `phase kind "latency" named twice`},
		{[]string{"--only", ""}, "no name given"},
		{[]string{"--turns", "0"}, "--turns must be at least 1"},
		{[]string{"--rounds", "0"}, "--rounds must be at least 1"},
		{[]string{"--latency-duration", "0s"}, "--latency-duration must be positive"},
		{[]string{"extra"}, `unexpected argument "extra"`},
	} {
		var stdout, stderr bytes.Buffer
		err := runBenchTurns(t.Context(), c.args, &stdout, &stderr)
		var usage usageError
		require.ErrorAs(t, err, &usage, "%v", c.args)
		require.Contains(t, err.Error()+stderr.String(), c.want, "%v", c.args)
		require.Empty(t, stdout.String())
	}
}
