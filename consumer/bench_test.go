package consumer_test

import (
	"context"
	"fmt"
	"os"
	"slices"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/batonhq/baton/consumer"
	"github.com/batonhq/baton/internal/testsvc"
	"github.com/batonhq/baton/producer"
)

// TestBenchmarkDebounce is an experiment on the debounce window, gated by BATON_BENCH:
//
//	BATON_BENCH=1 go test -run TestBenchmarkDebounce -v ./consumer/
//
// It reports what the window buys: turns per burst of 5 messages sent back to back by one
// client (each its own transaction, as a client flushing a queue or a user pasting several
// messages sends them), 30 bursts one after another on an idle system, for several windows.
// 1.0 means every burst became one turn. Numbers are for comparison within the run, never
// asserted. Throughput and latency are measured by `baton bench turns`.
func TestBenchmarkDebounce(t *testing.T) {
	if !benchEnabled() {
		t.Skip("set BATON_BENCH=1 to run the debounce experiment")
	}
	if testing.Short() {
		t.Skip("the debounce experiment does not run with -short")
	}
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
					_, err := b.prod.Send(context.Background(), b.app, producer.Message{ConversationID: conv, ID: fmt.Sprintf("%s-%d", conv, i), Content: "hi"})
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
