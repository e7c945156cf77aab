package bench

import (
	"context"
	"log/slog"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgconn"
	"github.com/stretchr/testify/require"

	"github.com/batonhq/baton/internal/testsvc"
	"github.com/batonhq/baton/natsconn"
)

// A libpq URL may name its database in the query (?dbname= or ?database=), which wins over
// the path. withDatabase replaced only the path, so the bench's "own" database was the one
// the user named: migrations, 1,000 conversations and the TRUNCATE of agent_outbox and
// messages (clearOutbox) landed there.
func TestAdvBenchWithDatabaseQueryDatabaseWins(t *testing.T) {
	t.Parallel()
	for _, base := range []string{
		"postgres://bench:secret@127.0.0.1:5432/postgres?dbname=prod",
		"postgres://bench:secret@127.0.0.1:5432/?database=prod&sslmode=disable",
	} {
		got, err := withDatabase(base, "baton_bench_ab12_3")
		require.NoError(t, err, base)
		cfg, err := pgconn.ParseConfig(got)
		require.NoError(t, err, got)
		require.Equal(t, "baton_bench_ab12_3", cfg.Database,
			"%s became %s: the bench would work in the user's database %q", base, got, cfg.Database)
	}
}

// The same, end to end through openEnv on a real server: given a URL whose query names the
// user's database, the bench's pool was connected to the user's database, and openEnv had
// already written 1,000 conversations into it (Run's first part then truncated its outbox).
func TestAdvBenchOpenEnvWritesIntoTheUsersDatabase(t *testing.T) {
	t.Parallel()
	user := testsvc.NewDatabase(t) // stands for the user's own (migrated) database
	ns := testsvc.StartNATS(t)
	cfg := &Config{DatabaseURL: user.URL + "&dbname=" + user.Name, NATS: natsconn.Settings{URL: ns.URL()},
		Logger: slog.New(slog.DiscardHandler), Parts: []string{PartLatency}, Rounds: 1}
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	e, err := openEnv(ctx, cfg)
	require.NoError(t, err)
	var current string
	require.NoError(t, e.pool.QueryRow(ctx, `SELECT current_database()`).Scan(&current))
	e.close(ctx)
	var touched int
	require.NoError(t, user.Pool.QueryRow(ctx, `SELECT count(*) FROM conversations WHERE id LIKE 'c0%'`).Scan(&touched))
	require.Equal(t, e.dbName, current, "the bench's pool is on database %q, not its own %q", current, e.dbName)
	require.Zero(t, touched, "the bench wrote %d conversations into the user's database", touched)
}

// A latency phase in which no message got its reply (every turn failed) has no latency
// samples: percentile of nothing is 0, so the p50 figure read 0 ms and the p50 target was
// reported as met. A target over a phase that did not complete is not met.
func TestAdvBenchTurnsLatencyTargetMetWithNoReply(t *testing.T) {
	t.Parallel()
	b := newTestTurns(t, TurnsConfig{Sources: []string{TurnsSourceJetStream}, Only: []string{TurnsKindLatency},
		Rates: []int{TurnsTargetLatencyRate}})
	// The one phase: latency jetstream 200/s; 2,000 sent, every one failed, so lat is empty.
	results := [][]turnsResult{{{sent: 2000, failed: 2000, achievedRate: 200, conversations: 50}}}
	rep := b.report(&turnsEnv{}, results, time.Minute)
	require.False(t, rep.Complete())
	var found bool
	for _, tg := range rep.Targets {
		if tg.Name != "p50 producer commit → reply commit at 200/s" {
			continue
		}
		found = true
		if tg.Met != nil {
			require.False(t, *tg.Met, "target %q shown met with value %v although no message was replied", tg.Name, *tg.Value)
		}
	}
	require.True(t, found)
}

// A throughput phase in which half the turns failed (outbox rows in status error) still gets a
// turns/s (sent ÷ seconds, failures counted as turns); the 1-worker target read "met". Now a
// target over an incomplete phase is not met, and says so (Complete false).
func TestAdvBenchTurnsThroughputTargetMetWhenIncomplete(t *testing.T) {
	t.Parallel()
	b := newTestTurns(t, TurnsConfig{Sources: []string{TurnsSourceJetStream}, Only: []string{TurnsKindThroughput},
		Workers: []int{1}, Turns: 1000})
	results := [][]turnsResult{{{sent: 1000, done: 500, failed: 500, seconds: 0.25, perSecond: 4000}}}
	rep := b.report(&turnsEnv{}, results, time.Minute)
	require.False(t, rep.Complete())
	tg := rep.Targets[0]
	require.Equal(t, "turns/s, 1 worker", tg.Name)
	if tg.Met != nil {
		require.False(t, *tg.Met, "target %q shown met (%v turns/s) although only 500 of 1000 turns were replied", tg.Name, *tg.Value)
	}
}

// bench turns had no upper bound on its sizes: a rate, a turn count or a latency duration that
// cannot be run (the latency phase allocates rate × duration records and rate/4 conversations
// up front, the throughput phase Turns messages and conversations) is accepted, and the process
// died of memory exhaustion after creating its database, which a fatal error leaves behind.
// Both commands now refuse such values (see checkPaced).
func TestAdvBenchNewTurnsRejectsHugeSizes(t *testing.T) {
	t.Parallel()
	for name, cfg := range map[string]TurnsConfig{
		"rates":            {Rates: []int{1 << 40}},
		"turns":            {Turns: 1 << 40},
		"latency duration": {Rates: []int{1000}, LatencyDuration: 1 << 62},
	} {
		t.Run(name, func(t *testing.T) {
			cfg.RelayCommand = []string{"baton", "relay"}
			cfg.NewWorker = turnsNoWorker
			_, err := NewTurns(cfg)
			require.Error(t, err, "%s accepted", name)
		})
	}
}

// bench relay refuses a backlog or a latency run it could not hold, before it creates
// anything: rows past its bound, a latency run past an hour or past 10 million commits; and a
// rate named twice.
func TestAdvBenchRelayRejectsHugeSizes(t *testing.T) {
	t.Parallel()
	for name, cfg := range map[string]Config{
		"rows":             {Rows: 1 << 40},
		"latency duration": {Rates: []int{10}, LatencyDuration: 2 * time.Hour},
		"rate × duration":  {Rates: []int{100_000}, LatencyDuration: 10 * time.Minute},
		"a rate twice":     {Rates: []int{1000, 1000}}, // the second run's figures overwrote the first's
	} {
		t.Run(name, func(t *testing.T) {
			require.Error(t, cfg.Validate(), "%s accepted", name)
		})
	}
	require.NoError(t, Config{Rates: []int{5000}, LatencyDuration: 5 * time.Second}.Validate())
}
