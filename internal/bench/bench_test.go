package bench

import (
	"bufio"
	"bytes"
	"encoding/json"
	"encoding/xml"
	"errors"
	"io"
	"math"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pglogrepl"
	"github.com/stretchr/testify/require"

	"github.com/batonhq/baton/internal/testsvc"
)

func TestMain(m *testing.M) { os.Exit(testsvc.MainNoLeaks(m)) }

func TestMedian(t *testing.T) {
	t.Parallel()
	nan := Value(math.NaN())
	for _, tc := range []struct {
		in   []Value
		want float64
	}{
		{[]Value{3}, 3},
		{[]Value{3, 1, 2}, 2},
		{[]Value{4, 1, 3, 2}, 2.5},
		{[]Value{nan, 5, nan}, 5},
		{[]Value{nan}, math.NaN()},
		{nil, math.NaN()},
	} {
		got := median(tc.in)
		if math.IsNaN(tc.want) {
			require.True(t, math.IsNaN(got), "%v: %v", tc.in, got)
			continue
		}
		require.InDelta(t, tc.want, got, 1e-9, "%v", tc.in)
	}
}

func TestRatio(t *testing.T) {
	t.Parallel()
	require.InDelta(t, 0.5, ratio(1, 2), 1e-9)
	for _, bad := range [][2]float64{{0, 1}, {1, 0}, {math.NaN(), 1}, {1, math.NaN()}, {-1, 1}, {math.Inf(1), 1}} {
		require.True(t, math.IsNaN(ratio(bad[0], bad[1])), "%v", bad)
	}
}

func TestParseStatCPU(t *testing.T) {
	t.Parallel()
	// pid (comm) state ppid pgrp session tty tpgid flags minflt cminflt majflt cmajflt utime stime …
	stat := "4242 (baton (relay) x) S 1 4242 4242 0 -1 4194560 900 0 0 0 250 130 0 0 20 0 12 0 100 0 0"
	require.InDelta(t, 3.8, parseStatCPU(stat), 1e-9)
	require.True(t, math.IsNaN(parseStatCPU("garbage")))
	require.True(t, math.IsNaN(parseStatCPU("1 (x) S 1 2")))
	require.True(t, math.IsNaN(cpuSeconds(0)))
	require.False(t, math.IsNaN(selfCPU()), "this process's CPU time is readable")
}

// A relay child sees the bench's settings only, never the caller's BATON_* variables.
func TestChildEnvReplacesBatonVariables(t *testing.T) {
	t.Parallel()
	got := childEnv([]string{"PATH=/bin", "BATON_METRICS_ADDR=:9090", "BATON_SCHEMA=mine", "HOME=/root"},
		[]string{"BATON_SLOT=s"})
	require.Equal(t, []string{"PATH=/bin", "HOME=/root", "BATON_SLOT=s"}, got)
}

func TestWithDatabase(t *testing.T) {
	t.Parallel()
	got, err := withDatabase("postgres://u:p@h:5432/app?sslmode=disable", "baton_bench_x")
	require.NoError(t, err)
	require.Equal(t, "postgres://u:p@h:5432/baton_bench_x?sslmode=disable", got)
	got, err = withDatabase("host=h dbname=app", "baton_bench_x")
	require.NoError(t, err)
	require.Equal(t, "host=h dbname=app dbname=baton_bench_x", got)
	_, err = withDatabase("mysql://h/app", "x")
	require.Error(t, err)
}

func TestIsLocalHost(t *testing.T) {
	t.Parallel()
	for host, want := range map[string]bool{"": true, "/var/run/postgresql": true, "localhost": true,
		"127.0.0.1": true, "::1": true, "db.example.com": false, "10.0.0.5": false} {
		require.Equal(t, want, isLocalHost(host), host)
	}
}

func TestRotate(t *testing.T) {
	t.Parallel()
	s := []string{"a", "b", "c"}
	require.Equal(t, []string{"a", "b", "c"}, rotate(s, 0))
	require.Equal(t, []string{"b", "c", "a"}, rotate(s, 1))
	require.Equal(t, []string{"a", "b", "c"}, rotate(s, 3))
	require.Equal(t, []string{"a", "b", "c"}, s, "the input is left alone")
	require.Nil(t, rotate(nil, 2))
}

func TestFormat(t *testing.T) {
	t.Parallel()
	require.Equal(t, "200,000", thousands(200000))
	require.Equal(t, "999", thousands(999))
	require.Equal(t, "-1,234", thousands(-1234.4))
	require.Equal(t, "41,235", format(41234.6, "rows/s"))
	require.Equal(t, "0.75", format(0.754, "x"))
	require.Equal(t, "22.5", format(22.51, "MiB"))
	require.Equal(t, "-", format(math.NaN(), "s"))
}

// The plain relay confirms a transaction's end only once every event published up to it has
// its PubAck, and the server's idle WAL end only when nothing is waiting.
func TestPlainRelayConfirmsOnlyAcknowledged(t *testing.T) {
	t.Parallel()
	pr := &plainRelay{}
	publish := func(n int) { pr.published += int64(n) }
	publish(2)
	pr.commit(100)
	publish(1)
	pr.commit(200)
	pr.commit(250) // a transaction with no outbox row
	require.Equal(t, pglogrepl.LSN(0), pr.confirmed(300), "nothing acknowledged")
	pr.acked.Store(1)
	require.Equal(t, pglogrepl.LSN(0), pr.confirmed(300), "one of the first transaction's two events")
	pr.acked.Store(2)
	require.Equal(t, pglogrepl.LSN(100), pr.confirmed(300))
	pr.acked.Store(3)
	require.Equal(t, pglogrepl.LSN(300), pr.confirmed(300), "all acknowledged: the idle WAL end")
	publish(1)
	require.Equal(t, pglogrepl.LSN(300), pr.confirmed(400), "an event in flight holds the idle end back")
	pr.commit(500)
	pr.acked.Store(4)
	require.Equal(t, pglogrepl.LSN(500), pr.confirmed(400), "never backwards")
}

func TestParseHistogram(t *testing.T) {
	t.Parallel()
	body := `# HELP baton_relay_commit_to_ack_seconds x
baton_relay_commit_to_ack_seconds_bucket{le="0.0005"} 2
baton_relay_commit_to_ack_seconds_bucket{le="0.001"} 6
baton_relay_commit_to_ack_seconds_bucket{le="+Inf"} 8
baton_relay_commit_to_ack_seconds_sum 0.01
baton_relay_commit_to_ack_seconds_count 8
`
	h, err := parseHistogram(bufio.NewScanner(strings.NewReader(body)), commitToAck)
	require.NoError(t, err)
	require.InDelta(t, 0.75, h.share(0.001), 1e-9)
	before := histogram{le: map[float64]float64{0.001: 2}, count: 4}
	require.InDelta(t, 1.0, h.minus(before).share(0.001), 1e-9)
	_, err = parseHistogram(bufio.NewScanner(strings.NewReader("other 1\n")), commitToAck)
	require.Error(t, err)
}

func TestConfigValidate(t *testing.T) {
	t.Parallel()
	require.NoError(t, Config{}.Validate(), "the defaults")
	for _, tc := range []struct {
		cfg  Config
		want string
	}{
		{Config{Rows: 300}, "multiple of 200"},
		{Config{Rows: -200}, "multiple of 200"},
		{Config{Rounds: -1}, "rounds"},
		{Config{Rates: []int{0}}, "rate 0/s"},
		{Config{Parts: []string{"catchup", "decode"}}, `unknown part "decode"`},
		{Config{Parts: []string{PartLatency}, ProfileDir: "p"}, "profile"},
	} {
		err := tc.cfg.Validate()
		require.ErrorContains(t, err, tc.want)
	}
	_, err := Config{}.withDefaults()
	require.ErrorContains(t, err, "required")
}

func TestSlotsNeeded(t *testing.T) {
	t.Parallel()
	cfg, _ := Config{Rounds: 3}.withDefaults()
	require.Equal(t, 3*len(catchUpReaders), cfg.slotsNeeded())
	cfg, _ = Config{Rounds: 3, ProfileDir: "p"}.withDefaults()
	require.Equal(t, 3*len(catchUpReaders)+1, cfg.slotsNeeded())
	cfg, _ = Config{Rounds: 2, Parts: []string{PartHot, PartLatency}}.withDefaults()
	require.Equal(t, 2*len(hotReaders), cfg.slotsNeeded())
	cfg, _ = Config{Parts: []string{PartLatency}}.withDefaults()
	require.Equal(t, 1, cfg.slotsNeeded())
}

// sampleReport is a two-round report with a figure one round did not measure.
func sampleReport(t *testing.T) *Report {
	t.Helper()
	cfg, _ := Config{Rows: 2000, Rounds: 2, Rates: []int{100}}.withDefaults()
	r := newReport(&cfg)
	r.set(0, "latency_100.relay.p99_ms", "baton relay p99", "ms", 1.5)
	r.set(0, "tx1_conv1000.relay.rows_per_s", "baton relay (process)", "rows/s", 40000)
	r.set(1, "tx1_conv1000.relay.rows_per_s", "baton relay (process)", "rows/s", 50000)
	r.set(1, "tx1_conv1.ratio.relay_vs_tx1_conv1000", "hot ÷ 1,000", "x", 0.6)
	r.set(0, "backfill.relay.rows_per_s", "first start", "rows/s", 30000)
	for i := range 200 {
		r.samples["100/relay"] = append(r.samples["100/relay"], time.Duration(i+1)*50*time.Microsecond)
		r.samples["100/plain"] = append(r.samples["100/plain"], time.Duration(i+1)*40*time.Microsecond)
	}
	return r
}

func TestReportJSON(t *testing.T) {
	t.Parallel()
	r := sampleReport(t)
	var buf bytes.Buffer
	require.NoError(t, r.WriteJSON(&buf))
	var back map[string]any
	require.NoError(t, json.Unmarshal(buf.Bytes(), &back))
	for _, field := range []string{"version", "started_at", "wall_seconds", "config", "environment", "figures"} {
		require.Contains(t, back, field)
	}
	var rep Report
	require.NoError(t, json.Unmarshal(buf.Bytes(), &rep))
	f := rep.Figures["tx1_conv1000.relay.rows_per_s"]
	require.InDelta(t, 45000, float64(f.Median), 1e-9)
	require.Equal(t, "rows/s", f.Unit)
	hot := rep.Figures["tx1_conv1.ratio.relay_vs_tx1_conv1000"]
	require.True(t, math.IsNaN(float64(hot.Rounds[0])), "round 1 did not measure it: null")
	require.InDelta(t, 0.6, float64(hot.Median), 1e-9)
	require.Contains(t, buf.String(), `"rounds": [
        null,`)
}

func TestReportTable(t *testing.T) {
	t.Parallel()
	r := sampleReport(t)
	require.Equal(t, []string{"tx1_conv1000.relay.rows_per_s", "tx1_conv1.ratio.relay_vs_tx1_conv1000",
		"backfill.relay.rows_per_s", "latency_100.relay.p99_ms"}, r.Keys())
	var buf bytes.Buffer
	require.NoError(t, r.WriteTable(&buf))
	out := buf.String()
	for _, want := range []string{
		"catch-up of 2,000 rows: 1-row transactions over 1,000 conversations",
		"catch-up of 2,000 rows: 1-row transactions over 1 conversation (hot)",
		"first start of baton relay on 2,000 pending rows",
		"commit → stored at 100 commits/s",
		"median", "round 1", "round 2", "45,000", "40,000", "50,000",
	} {
		require.Contains(t, out, want)
	}
	require.Less(t, strings.Index(out, "1,000 conversations"), strings.Index(out, "(hot)"), "sections in order")
}

func TestReportPlot(t *testing.T) {
	t.Parallel()
	r := sampleReport(t)
	var buf bytes.Buffer
	require.NoError(t, r.WritePlot(&buf))
	dec := xml.NewDecoder(&buf)
	lines := 0
	for {
		tok, err := dec.Token()
		if errors.Is(err, io.EOF) {
			break
		}
		require.NoError(t, err, "the SVG is well-formed XML")
		if el, ok := tok.(xml.StartElement); ok && el.Name.Local == "polyline" {
			lines++
		}
	}
	require.Equal(t, 2, lines, "one curve per contender and rate")

	empty := newReport(&Config{Rounds: 1})
	require.ErrorContains(t, empty.WritePlot(io.Discard), "latency part did not run")
}

// Percentiles are nearest rank: the smallest value with at least q of them at or below it.
func TestPercentile(t *testing.T) {
	ms := time.Millisecond
	require.Zero(t, percentile(nil, .5))
	ds := []time.Duration{1 * ms, 2 * ms, 3 * ms, 4 * ms, 5 * ms}
	require.Equal(t, 3*ms, percentile(ds, .5))
	require.Equal(t, 5*ms, percentile(ds, .99))
	require.Equal(t, 1*ms, percentile(ds, 0))
	require.Equal(t, 2*ms, percentile(ds[:4], .5))
}
