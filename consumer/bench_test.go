package consumer_test

import (
	"context"
	"fmt"
	"os"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"

	"github.com/batonhq/baton/consumer"
	"github.com/batonhq/baton/internal/testsvc"
	"github.com/batonhq/baton/producer"
)

// runTurns sends n messages, each to a conversation of its own (so every message is one
// turn), from 8 concurrent producers, and returns how long it took from the first send until
// the last reply was committed.
func runTurns(t *testing.T, b *bundle, n int) time.Duration {
	t.Helper()
	ctx := context.Background()
	convs := make([]string, n)
	for i := range convs {
		convs[i] = fmt.Sprintf("b%06d", i)
	}
	_, err := b.db.Pool.Exec(ctx, `INSERT INTO conversations (id) SELECT unnest($1::text[])`, convs)
	require.NoError(t, err)
	start := time.Now()
	var wg sync.WaitGroup
	for w := range 8 {
		wg.Go(func() {
			for i := w; i < n; i += 8 {
				_, err := b.prod.Send(ctx, b.db.Pool, producer.Message{ConversationID: convs[i], ID: convs[i], Content: "hi"})
				if err != nil {
					t.Error(err)
					return
				}
			}
		})
	}
	wg.Wait()
	// Poll rarely (a count over the outbox competes with the workers for the CPU) and take the
	// end from the last run's commit time instead.
	require.Eventually(t, func() bool {
		var n int
		err := b.db.Pool.QueryRow(ctx, `SELECT count(*) FROM agent_outbox WHERE status IN ('pending', 'processing')`).Scan(&n)
		return err == nil && n == 0
	}, 5*time.Minute, 200*time.Millisecond, "rows still pending or processing")
	var end time.Time
	require.NoError(t, b.db.Pool.QueryRow(ctx, `SELECT max(finished_at) FROM agent_runs`).Scan(&end))
	return end.Sub(start)
}

// latencies sends rate messages per second for d over 50 conversations and returns the
// producer-commit → reply-commit latencies (reply commit = the run's finished_at, stamped in
// the final transaction).
func latencies(t *testing.T, b *bundle, rate int, d time.Duration) []time.Duration {
	t.Helper()
	ctx := context.Background()
	convs := make([]string, 50)
	for i := range convs {
		convs[i] = fmt.Sprintf("l%02d", i)
		b.conversation(convs[i])
	}
	type sent struct {
		id int64
		at time.Time
	}
	var out []sent
	tick := time.NewTicker(time.Second / time.Duration(rate))
	defer tick.Stop()
	for i, end := 0, time.Now().Add(d); time.Now().Before(end); i++ {
		<-tick.C
		res, err := b.prod.Send(ctx, b.db.Pool, producer.Message{ConversationID: convs[i%len(convs)], ID: fmt.Sprintf("lat-%d", i), Content: "hi"})
		require.NoError(t, err)
		out = append(out, sent{res.OutboxID, time.Now()})
	}
	b.waitTerminal(time.Minute)
	rows, err := b.db.Pool.Query(ctx, `SELECT o.id, r.finished_at FROM agent_runs r
		JOIN agent_outbox o ON o.id = ANY(r.outbox_ids) WHERE r.outcome = 'done'`)
	require.NoError(t, err)
	done := map[int64]time.Time{}
	for rows.Next() {
		var id int64
		var at time.Time
		require.NoError(t, rows.Scan(&id, &at))
		done[id] = at
	}
	require.NoError(t, rows.Err())
	lat := make([]time.Duration, 0, len(out))
	for _, s := range out {
		lat = append(lat, max(done[s.id].Sub(s.at), 0))
	}
	slices.Sort(lat)
	return lat
}

func pct(l []time.Duration, p float64) time.Duration {
	if len(l) == 0 {
		return 0
	}
	return l[min(len(l)-1, int(float64(len(l))*p))]
}

// TestBenchmarkTurns is the worker benchmark, written as a test gated by BATON_BENCH so that it
// can use the same helpers as the tests (they take *testing.T): run it with
//
//	BATON_BENCH=1 go test -run TestBenchmarkTurns -v ./consumer/
//
// It reports turns/s with a zero-latency handler for 1 and 4 workers per source, and
// producer-commit → reply-commit p50/p99 at 200 turns/s for both sources, measured in the
// same run. Numbers are for comparison within the run, never asserted.
func TestBenchmarkTurns(t *testing.T) {
	if !benchEnabled() {
		t.Skip("set BATON_BENCH=1; `baton bench turns` will replace it")
	}
	if testing.Short() {
		t.Skip("the worker benchmark does not run with -short")
	}
	const n = 6000
	// Each measurement runs in a subtest, so its servers, relay and workers stop before the
	// next one starts and nothing idle competes with it.
	for _, src := range sources {
		for _, workers := range []int{1, 4} {
			t.Run(fmt.Sprintf("throughput-%s-%d", src, workers), func(t *testing.T) {
				b := setup(t, src)
				var regs []*prometheus.Registry
				for range workers {
					// Each worker has a pool of its own, as a worker process would.
					reg := prometheus.NewRegistry()
					regs = append(regs, reg)
					b.worker(consumer.Config{Pool: b.pool(t, 16), PollInterval: 250 * time.Millisecond, Registerer: reg})
				}
				took := runTurns(t, b, n)
				t.Logf("BENCH throughput source=%s workers=%d turns=%d took=%v turns/s=%.0f (conversations per statement: claim %.1f, final commit %.1f; claim conflicts %.0f, events nacked %.0f)",
					src, workers, n, took.Round(time.Millisecond), float64(n)/took.Seconds(),
					meanBatch(t, regs, "claim"), meanBatch(t, regs, "finish"),
					counterSum(t, regs, "baton_worker_claim_conflicts_total", ""), counterSum(t, regs, "baton_worker_events_total", "nacked"))
			})
		}
	}
	p50 := map[source]time.Duration{}
	for _, src := range sources {
		t.Run("latency-"+string(src), func(t *testing.T) {
			b := setup(t, src)
			b.worker(consumer.Config{Pool: b.pool(t, 16), PollInterval: 250 * time.Millisecond})
			lat := latencies(t, b, 200, 5*time.Second)
			p50[src] = pct(lat, .5)
			t.Logf("BENCH latency source=%s rate=200/s n=%d p50=%v p99=%v (debounce 5ms, poll 250ms)", src, len(lat),
				pct(lat, .5).Round(10*time.Microsecond), pct(lat, .99).Round(10*time.Microsecond))
			// Where it goes, by the database's clock: outbox row written -> run claimed (the
			// debounce and the event's way there) -> run committed (claim, handler, final commit).
			var waitP50, waitP99, turnP50, turnP99 float64
			require.NoError(t, b.db.Pool.QueryRow(context.Background(), `
				SELECT percentile_cont(.5) WITHIN GROUP (ORDER BY w), percentile_cont(.99) WITHIN GROUP (ORDER BY w),
				       percentile_cont(.5) WITHIN GROUP (ORDER BY d), percentile_cont(.99) WITHIN GROUP (ORDER BY d)
				FROM (SELECT extract(epoch FROM r.started_at - o.created_at) * 1000 AS w,
				             extract(epoch FROM r.finished_at - r.started_at) * 1000 AS d
				      FROM agent_runs r JOIN agent_outbox o ON o.run_id = r.run_id) x`).Scan(&waitP50, &waitP99, &turnP50, &turnP99))
			t.Logf("BENCH latency source=%s written->claimed p50=%.2fms p99=%.2fms, claimed->committed p50=%.2fms p99=%.2fms",
				src, waitP50, waitP99, turnP50, turnP99)
		})
	}
	t.Logf("BENCH polling p50 / jetstream p50 = %.1fx", float64(p50[polling])/float64(p50[jetStream]))

	// What the debounce window buys: turns per burst of 5 messages sent back to back by one
	// client (each its own transaction, as a client flushing a queue or a user pasting several
	// messages sends them), 30 bursts one after another on an idle system, for several windows.
	// 1.0 means every burst became one turn.
	for _, window := range []time.Duration{0, time.Millisecond, 2 * time.Millisecond, 3 * time.Millisecond, 5 * time.Millisecond} {
		t.Run(fmt.Sprintf("burst-debounce-%v", window), func(t *testing.T) {
			b := setup(t, jetStream)
			b.worker(consumer.Config{Pool: b.pool(t, 16), Debounce: max(window, time.Nanosecond)})
			const bursts, burst = 30, 5
			var took []time.Duration
			for c := range bursts {
				conv := fmt.Sprintf("burst%02d", c)
				b.conversation(conv)
				start := time.Now()
				for i := range burst {
					_, err := b.prod.Send(context.Background(), b.db.Pool, producer.Message{ConversationID: conv, ID: fmt.Sprintf("%s-%d", conv, i), Content: "hi"})
					require.NoError(t, err)
				}
				took = append(took, time.Since(start))
				b.waitTerminal(time.Minute)
			}
			slices.Sort(took)
			runs := testsvc.Query[int](t, b.db, `SELECT count(*)::int FROM agent_runs WHERE outcome = 'done'`)[0]
			t.Logf("BENCH burst debounce=%v turns per burst of %d: %.2f (a burst took p50 %v to send)", window, burst,
				float64(runs)/bursts, took[len(took)/2].Round(10*time.Microsecond))
		})
	}
}

// meanBatch is the mean of baton_worker_batch_size{statement} over the workers' registries.
func meanBatch(t *testing.T, regs []*prometheus.Registry, statement string) float64 {
	t.Helper()
	var sum float64
	var n uint64
	for _, m := range gathered(t, "baton_worker_batch_size", regs...) {
		if m.GetLabel()[0].GetValue() == statement {
			sum += m.GetHistogram().GetSampleSum()
			n += m.GetHistogram().GetSampleCount()
		}
	}
	return sum / float64(max(n, 1))
}

func benchEnabled() bool { return os.Getenv("BATON_BENCH") != "" }

// pool opens a pool of its own on the test database.
func (b *bundle) pool(t *testing.T, maxConns int32) *pgxpool.Pool {
	t.Helper()
	cfg, err := pgxpool.ParseConfig(b.db.URL)
	require.NoError(t, err)
	cfg.MaxConns = maxConns
	p, err := pgxpool.NewWithConfig(context.Background(), cfg)
	require.NoError(t, err)
	t.Cleanup(p.Close)
	return p
}
