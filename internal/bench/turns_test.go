package bench

import (
	"bytes"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgconn"
	"github.com/stretchr/testify/require"
)

func turnsNoWorker(TurnsWorkerSpec) (TurnsWorker, error) { return nil, nil }

func newTestTurns(t *testing.T, cfg TurnsConfig) *Turns {
	t.Helper()
	cfg.RelayCommand = []string{"baton", "relay"}
	cfg.NewWorker = turnsNoWorker
	b, err := NewTurns(cfg)
	require.NoError(t, err)
	return b
}

func TestTurnsMedian(t *testing.T) {
	for _, c := range []struct {
		vals []float64
		want float64
	}{
		{nil, 0},
		{[]float64{3}, 3},
		{[]float64{3, 1, 2}, 2},
		{[]float64{4, 1, 3, 2}, 2.5},
	} {
		require.InDelta(t, c.want, turnsMedian(c.vals), 1e-9, "%v", c.vals)
	}
	vals := []float64{3, 1, 2}
	turnsMedian(vals)
	require.Equal(t, []float64{3, 1, 2}, vals, "the rounds keep their order")
}

// The database name is replaced in either form of connection string, keeping the rest.
func TestWithDatabaseKeepsTheRest(t *testing.T) {
	for _, base := range []string{
		"postgres://bench:secret@127.0.0.1:5432/app?sslmode=disable",
		"postgresql://bench@127.0.0.1/app",
		"host=127.0.0.1 user=bench dbname=app sslmode=disable",
		"host=127.0.0.1 user=bench",
	} {
		got, err := withDatabase(base, "baton_bench_ab12_3")
		require.NoError(t, err, base)
		cfg, err := pgconn.ParseConfig(got)
		require.NoError(t, err, got)
		require.Equal(t, "baton_bench_ab12_3", cfg.Database, base)
		require.Equal(t, "bench", cfg.User, base)
	}
}

func TestTurnsPlan(t *testing.T) {
	b := newTestTurns(t, TurnsConfig{})
	var got []string
	for _, ph := range b.phases {
		got = append(got, ph.String())
	}
	require.Equal(t, []string{
		"throughput jetstream 1 worker", "tools jetstream 1 worker", "throughput jetstream 4 workers",
		"throughput polling 1 worker", "tools polling 1 worker", "throughput polling 4 workers",
		"latency jetstream 200/s", "latency jetstream 1000/s", "latency polling 200/s", "latency polling 1000/s",
	}, got)

	b = newTestTurns(t, TurnsConfig{Only: []string{TurnsKindTools, TurnsKindLatency}, Sources: []string{TurnsSourcePolling},
		Workers: []int{2, 3}, Rates: []int{50}})
	got = nil
	for _, ph := range b.phases {
		got = append(got, ph.String())
	}
	require.Equal(t, []string{"tools polling 2 workers", "latency polling 50/s"}, got)
}

func TestNewTurnsRejects(t *testing.T) {
	for _, c := range []struct {
		cfg  TurnsConfig
		want string
	}{
		{TurnsConfig{Turns: -1}, "turns must be 1…10000000, not -1"},
		{TurnsConfig{Rates: []int{}}, "rates must be"},
		{TurnsConfig{Workers: []int{1, 0}}, "workers must be"},
		{TurnsConfig{Sources: []string{"kafka"}}, `unknown source "kafka"`},
		{TurnsConfig{Only: []string{}}, "no phase kind chosen"},
		{TurnsConfig{Rounds: -2}, "rounds must be at least 1"},
		{TurnsConfig{LatencyDuration: -time.Second}, "latency duration must be positive"},
	} {
		c.cfg.RelayCommand = []string{"baton", "relay"}
		c.cfg.NewWorker = turnsNoWorker
		_, err := NewTurns(c.cfg)
		require.ErrorContains(t, err, c.want)
	}
	_, err := NewTurns(TurnsConfig{NewWorker: turnsNoWorker})
	require.ErrorContains(t, err, "RelayCommand is required")
	_, err = NewTurns(TurnsConfig{RelayCommand: []string{"baton"}})
	require.ErrorContains(t, err, "NewWorker is required")
}

// TestTurnsReport builds a report from made-up results of two rounds and checks the ratios,
// the targets and the table.
func TestTurnsReport(t *testing.T) {
	b := newTestTurns(t, TurnsConfig{Sources: []string{TurnsSourceJetStream}, Rounds: 2, Turns: 1000})
	ms := time.Millisecond
	round := func(one, tools, four float64, p50 time.Duration) []turnsResult {
		tp := func(ps float64) turnsResult {
			return turnsResult{sent: 1000, done: 1000, perSecond: ps, seconds: 1000 / ps, claimBatch: 20, commitBatch: 18}
		}
		lat := func(rate int, p50 time.Duration) turnsResult {
			return turnsResult{sent: rate * 10, done: rate * 10, achievedRate: float64(rate), p50: p50, p99: 2 * p50}
		}
		// Phases: throughput 1, tools 1, throughput 4, latency 200, latency 1000.
		return []turnsResult{tp(one), tp(tools), tp(four), lat(200, p50), lat(1000, 2*p50)}
	}
	results := [][]turnsResult{round(3000, 2000, 2900, 7*ms), round(2000, 1600, 2000, 9*ms)}
	rep := b.report(&turnsEnv{postgres: "pg", nats: "nats"}, results, time.Minute)

	require.True(t, rep.Complete())
	require.Len(t, rep.Throughput, 3)
	require.Equal(t, TurnsFigure{Median: 2500, Rounds: []float64{3000, 2000}}, rep.Throughput[0].TurnsPerSecond)
	require.True(t, rep.Throughput[1].Tools)
	require.Len(t, rep.Latency, 2)
	require.Equal(t, TurnsFigure{Median: 8, Rounds: []float64{7, 9}}, rep.Latency[0].P50MS)

	ratios := map[string]TurnsFigure{}
	for _, r := range rep.Ratios {
		ratios[r.Name] = r.Value
	}
	// Per round, then the median: (2900/3000 + 2000/2000) / 2, not 2450/2500.
	require.InDelta(t, (2900.0/3000+1)/2, ratios["jetstream turns/s: 4 workers / 1 worker"].Median, 1e-9)
	require.InDelta(t, (2000.0/3000+0.8)/2, ratios["jetstream turns/s: read+write tools / no tools, 1 worker"].Median, 1e-9)

	require.Len(t, rep.Targets, 4)
	met := func(i int) bool {
		require.NotNil(t, rep.Targets[i].Met, rep.Targets[i].Name)
		return *rep.Targets[i].Met
	}
	require.False(t, met(0), "2500 turns/s < 2800")
	require.True(t, met(1), "0.98 >= 0.95")
	require.True(t, met(2), "8ms <= 5ms + 3ms")
	require.True(t, met(3), "(0.67 + 0.8) / 2 >= 0.7")

	var out bytes.Buffer
	require.NoError(t, rep.WriteTable(&out))
	text := out.String()
	require.Regexp(t, `(?m)^jetstream\s+1\s+no tools\s+1000/1000\s+0\.42\s+2500 \[3000 2000\]`, text)
	require.Regexp(t, `(?m)^jetstream\s+1\s+200\s+200\s+50\s+2000/2000\s+8\.00 \[7\.00 9\.00\]`, text)
	require.Regexp(t, `(?m)^\s+turns/s, 1 worker\s+>= 2800 turns/s\s+2500\s+MISSED$`, text)
	require.Regexp(t, `(?m)^\s+p50 producer commit → reply commit at 200/s\s+<= 8\.00 ms \(debounce 5ms \+ 3ms\)\s+8\.00\s+met$`, text)
	require.NotContains(t, text, "INCOMPLETE")

	results[1][3].done--
	rep = b.report(&turnsEnv{}, results, time.Minute)
	require.False(t, rep.Complete())
	out.Reset()
	require.NoError(t, rep.WriteTable(&out))
	require.Contains(t, out.String(), "1999/2000 INCOMPLETE", "the worst round")
}
