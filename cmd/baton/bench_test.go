package main

import (
	"bytes"
	"context"
	"encoding/json"
	"math"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/stretchr/testify/require"

	"github.com/batonhq/baton/internal/bench"
	"github.com/batonhq/baton/internal/testsvc"
)

// `baton bench relay` end to end at tiny sizes: every part runs, the relay and the plain relay
// as processes of the baton binary, and the JSON holds every figure, complete and sane. (The
// bench itself fails when a stream does not end with exactly every event.)
// Not parallel: it and TestBenchTurnsTiny each check that no baton_bench_* database or slot is
// left on the shared test cluster, which the other's run would have.
func TestBenchRelayEndToEnd(t *testing.T) {
	db := testsvc.NewDatabase(t) // the bench makes a database of its own on this server
	ns := testsvc.StartNATS(t)
	bin := testsvc.Binary(t, "github.com/batonhq/baton/cmd/baton")
	dir := t.TempDir()
	plot, prof := filepath.Join(dir, "latency.svg"), filepath.Join(dir, "prof")
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	var stdout, stderr bytes.Buffer

	code := run(ctx, []string{"bench", "relay", "--database-url", db.URL, "--nats-url", ns.URL(), "--baton-binary", bin,
		"--rows", "2000", "--rates", "200", "--latency-duration", "1s", "--json", "--plot", plot, "--profile", prof},
		&stdout, &stderr)
	require.Equal(t, 0, code, "stderr: %s", stderr.String())

	var rep bench.Report
	require.NoError(t, json.Unmarshal(stdout.Bytes(), &rep), stdout.String())
	require.Equal(t, bench.ReportVersion, rep.Version)
	require.Equal(t, 2000, rep.Config.Rows)
	require.Positive(t, rep.WallSeconds)
	require.Equal(t, bench.AllParts, rep.Config.Parts)
	positive := func(key string) {
		t.Helper()
		f, ok := rep.Figures[key]
		require.True(t, ok, "figure %s missing", key)
		require.Len(t, f.Rounds, 1)
		v := float64(f.Median)
		require.False(t, math.IsNaN(v), "%s not measured", key)
		require.Positive(t, v, key)
	}
	for _, b := range []string{"tx1_conv1000", "tx100_conv1000"} {
		for _, c := range []string{"relay", "plain"} {
			for _, m := range []string{"rows_per_s", "start_to_stored_s", "confirm_s", "peak_rss_mib"} {
				positive(b + "." + c + "." + m)
			}
		}
		positive(b + ".decode_eager.rows_per_s")
		for _, p := range []string{"100us", "200us", "400us"} {
			positive(b + ".decode_bulk_" + p + ".rows_per_s")
		}
		positive(b + ".decode_ceiling.rows_per_s")
		for _, r := range []string{"relay_vs_plain", "relay_vs_decode_ceiling", "relay_vs_publish"} {
			positive(b + ".ratio." + r)
		}
	}
	positive("tx1_conv1000.publish.msgs_per_s")
	for _, b := range []string{"tx1_conv10", "tx1_conv1"} {
		positive(b + ".relay.rows_per_s")
		positive(b + ".plain.rows_per_s")
		positive(b + ".ratio.relay_vs_plain")
		positive(b + ".ratio.relay_vs_tx1_conv1000")
	}
	positive("backfill.relay.rows_per_s")
	for _, c := range []string{"relay", "plain"} {
		for _, m := range []string{"p50_ms", "p99_ms", "max_ms", "commits_per_s"} {
			positive("latency_200." + c + "." + m)
		}
	}
	positive("latency_200.ratio.relay_p99_vs_plain_p99")
	_, natsCPU := rep.Figures["tx1_conv1000.relay.nats_cpu_us_per_row"]
	require.False(t, natsCPU, "a NATS server given by URL is not this process: its CPU is not reported")

	svg, err := os.ReadFile(plot)
	require.NoError(t, err)
	require.True(t, strings.HasPrefix(string(svg), "<svg"), "%.100s", svg)
	require.Equal(t, filepath.Join(prof, bench.ProfileFile), rep.Profile)
	st, err := os.Stat(rep.Profile)
	require.NoError(t, err)
	require.Positive(t, st.Size())
	require.Contains(t, stderr.String(), "go tool pprof -top "+rep.Profile)
	require.Contains(t, stderr.String(), "tx1_conv1000, round 1/1: baton relay (process)", "progress lines on stderr")
	require.NotContains(t, stderr.String(), "\r", "stderr is no terminal: no line rewritten in place")

	// Nothing is left behind: no database, slot or stream of the run.
	var dbs, slots int
	require.NoError(t, db.Pool.QueryRow(ctx, `SELECT (SELECT count(*) FROM pg_database WHERE datname LIKE 'baton_bench_%'),
		(SELECT count(*) FROM pg_replication_slots WHERE slot_name LIKE 'baton_bench_%')`).Scan(&dbs, &slots))
	require.Zero(t, dbs, "bench databases left")
	require.Zero(t, slots, "bench slots left")
	nc, err := nats.Connect(ns.URL())
	require.NoError(t, err)
	defer nc.Close()
	js, err := jetstream.New(nc)
	require.NoError(t, err)
	names := js.StreamNames(ctx)
	for name := range names.Name() {
		require.False(t, strings.HasPrefix(name, "BENCH_"), "stream %s left", name)
	}
}

func TestBenchUsage(t *testing.T) {
	t.Parallel()
	for _, tt := range []struct {
		args   []string
		stderr string
	}{
		{[]string{"bench"}, "benchmarks:"},
		{[]string{"bench", "nope"}, `unknown benchmark "nope"`},
		{[]string{"bench", "relay", "--rows", "300"}, "--rows must be a positive multiple of 200"},
		{[]string{"bench", "relay", "--rounds", "0"}, "--rounds must be at least 1"},
		{[]string{"bench", "relay", "--rates", "1000,x"}, `--rates: "x" is not a whole number`},
		{[]string{"bench", "relay", "--rates", "0"}, "rate 0/s"},
		{[]string{"bench", "relay", "--only", "catchup, nope"}, `unknown part "nope"`},
		{[]string{"bench", "relay", "--only", "latency", "--profile", "p"}, "profile"},
		{[]string{"bench", "relay", "extra"}, `unexpected argument "extra"`},
	} {
		r := runBaton(t, tt.args...)
		require.Equal(t, 2, r.code, "%v: %s", tt.args, r.stderr)
		require.Contains(t, r.stderr, tt.stderr, tt.args)
		require.Empty(t, r.stdout)
	}

	r := runBaton(t, "help", "bench")
	require.Equal(t, 0, r.code)
	require.Contains(t, r.stdout, "relay")
	require.Contains(t, r.stdout, "turns")
	r = runBaton(t, "bench", "relay", "-h")
	require.Equal(t, 0, r.code)
	for _, flag := range []string{"-rows", "-rounds", "-rates", "-latency-duration", "-only", "-json", "-plot",
		"-profile", "-baton-binary", "-database-url", "-nats-url"} {
		require.Contains(t, r.stderr, flag)
	}
	r = runBaton(t, "help")
	require.Contains(t, r.stdout, "bench")

	r = runBaton(t, "bench", "turns", "-h")
	require.Equal(t, 0, r.code)
	require.Contains(t, r.stderr, "-workers")
}
