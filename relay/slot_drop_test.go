package relay_test

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/batonhq/baton/internal/testsvc"
	"github.com/batonhq/baton/relay"
	"github.com/batonhq/baton/wire"
)

// A failover to a standby on PostgreSQL older than 17 loses the relay's slot: the new primary
// has none. These tests take the slot away under load the two ways that happens, and check
// the recovery loses no request: every outbox row's turn event is in the turns stream, once
// (Nats-Msg-Id deduplicates what the recovery's backfill publishes again), in each
// conversation's order. Outcomes (assistant and error messages) committed while no slot
// existed are not in any outbox row, so no backfill brings them back: the tests count them
// and check that every outcome committed after the recovery is published.

// Load phases: outcomes are told apart by the phase they were committed in, start to end.
const (
	phaseBefore     int32 = iota // the slot streams
	phaseGap                     // the slot is going or gone
	phaseRecovering              // a relay is recreating the slot
	phaseAfter                   // the relay recreated the slot and finished its backfill
	phaseMixed                   // started in one phase, committed in another
)

// slotLoad is a steady load for the slot tests: user messages with their outbox rows, one
// writer per group of conversations (each conversation's rows commit one after another), and
// outcomes (assistant messages) committed beside them.
type slotLoad struct {
	pool  *pgxpool.Pool
	convs []string
	phase atomic.Int32
	stop  chan struct{}
	wg    sync.WaitGroup

	rows     atomic.Int64
	mu       sync.Mutex
	outcomes map[string]int32 // message id -> phase
	errs     []error
}

func startSlotLoad(t *testing.T, pool *pgxpool.Pool, convs []string) *slotLoad {
	t.Helper()
	createConversations(t, pool, convs...)
	l := &slotLoad{pool: pool, convs: convs, stop: make(chan struct{}), outcomes: map[string]int32{}}
	ctx := t.Context()
	const writers = 4
	for w := range writers {
		l.wg.Go(func() {
			tick := time.NewTicker(10 * time.Millisecond) // ~100 rows/s per writer
			defer tick.Stop()
			for i := 0; ; i++ {
				select {
				case <-l.stop:
					return
				case <-tick.C:
				}
				conv := convs[(i*writers+w)%len(convs)]
				if _, err := send(ctx, pool, conv, fmt.Sprintf("u-%d-%d", w, i)); err != nil {
					l.fail(fmt.Errorf("send to %s: %w", conv, err))
					return
				}
				l.rows.Add(1)
			}
		})
	}
	l.wg.Go(func() {
		tick := time.NewTicker(20 * time.Millisecond)
		defer tick.Stop()
		for i := 0; ; i++ {
			select {
			case <-l.stop:
				return
			case <-tick.C:
			}
			id := fmt.Sprintf("o-%d", i)
			began := l.phase.Load()
			if _, err := pool.Exec(ctx, `INSERT INTO messages (id, conversation_id, role, content) VALUES ($1, $2, 'assistant', 'done')`,
				id, convs[i%len(convs)]); err != nil {
				l.fail(fmt.Errorf("outcome %s: %w", id, err))
				return
			}
			phase := l.phase.Load()
			if phase != began {
				phase = phaseMixed
			}
			l.mu.Lock()
			l.outcomes[id] = phase
			l.mu.Unlock()
		}
	})
	t.Cleanup(l.finish)
	return l
}

func (l *slotLoad) fail(err error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.errs = append(l.errs, err)
}

// awaitRows waits until n more outbox rows are committed than when it was called.
func (l *slotLoad) awaitRows(t *testing.T, n int64) {
	t.Helper()
	from := l.rows.Load()
	require.Eventually(t, func() bool { return l.rows.Load() >= from+n || len(l.failures()) > 0 },
		30*time.Second, 5*time.Millisecond, "the load committed fewer than %d rows in 30s", n)
	require.Empty(t, l.failures())
}

func (l *slotLoad) failures() []error {
	l.mu.Lock()
	defer l.mu.Unlock()
	return append([]error(nil), l.errs...)
}

// finish stops the writers and waits for them.
func (l *slotLoad) finish() {
	select {
	case <-l.stop:
	default:
		close(l.stop)
	}
	l.wg.Wait()
}

// awaitRecreated waits until the relay recreated the slot (a baton_relay_slots row newer than
// since) and finished the backfill of its first start.
func awaitRecreated(t *testing.T, pool *pgxpool.Pool, slot string, since time.Time) {
	t.Helper()
	require.Eventually(t, func() bool {
		var done bool
		err := pool.QueryRow(context.Background(), `SELECT backfill_done FROM baton_relay_slots
			WHERE slot_name = $1 AND created_at > $2`, slot, since).Scan(&done)
		return err == nil && done
	}, time.Minute, 10*time.Millisecond, "the relay never recreated slot %s", slot)
}

// dropSlotLikeAFailover terminates the slot's walsender and drops the slot while no walsender
// holds it, retrying until the drop wins the race with the relay's reconnect.
func dropSlotLikeAFailover(t *testing.T, pool *pgxpool.Pool, slot string) (attempts int) {
	t.Helper()
	ctx := ctxT(t, 30*time.Second)
	for {
		attempts++
		// With a timeout, pg_terminate_backend waits until the walsender has exited.
		_, err := pool.Exec(ctx, `SELECT pg_terminate_backend(active_pid, 5000) FROM pg_replication_slots
			WHERE slot_name = $1 AND active_pid IS NOT NULL`, slot)
		require.NoError(t, err)
		if _, err = pool.Exec(ctx, `SELECT pg_drop_replication_slot($1)`, slot); err == nil {
			return attempts
		}
		// 55006 object_in_use: the relay's next session took the slot first.
		require.ErrorContains(t, err, "is active", "drop slot %s", slot)
		require.NoError(t, ctx.Err(), "the slot could not be dropped in 30s")
	}
}

// checkTurns checks that every outbox row's turn event is in the turns stream exactly once,
// in each conversation's order.
func checkTurns(t *testing.T, b *bundle, pool *pgxpool.Pool) int {
	t.Helper()
	want := truth(t, pool)
	ctx := ctxT(t, time.Minute)
	var msgs []got
	require.Eventually(t, func() bool {
		msgs = streamGot(ctx, t, b, "AGENT_TURNS")
		return len(msgs) >= len(want)
	}, 30*time.Second, 50*time.Millisecond, "turns stream never held %d events", len(want))
	assertExactlyOnceInOrder(t, msgs, want)
	for _, m := range msgs {
		require.Equal(t, wire.TurnMsgID(outboxIDOf(t, m)), m.header.Get("Nats-Msg-Id"))
	}
	return len(want)
}

func outboxIDOf(t *testing.T, m got) int64 {
	t.Helper()
	var id int64
	_, err := fmt.Sscan(m.header.Get(wire.HeaderOutboxID), &id)
	require.NoError(t, err)
	return id
}

// streamGot reads a stream without a consumer (testsvc.StreamMsgs).
func streamGot(ctx context.Context, t *testing.T, b *bundle, stream string) []got {
	t.Helper()
	var out []got
	for _, m := range testsvc.StreamMsgs(ctx, t, b.js, stream) {
		out = append(out, got{seq: m.Sequence, stored: m.Time, subject: m.Subject, header: m.Header, data: m.Data})
	}
	return out
}

// outcomeCounts returns, by phase, how many outcomes the load committed and how many of them
// the outcomes stream lacks; it fails on an outcome published twice.
func outcomeCounts(t *testing.T, b *bundle, l *slotLoad) (committed, missing map[int32]int) {
	t.Helper()
	ctx := ctxT(t, time.Minute)
	seen := map[string]int{}
	for _, m := range streamGot(ctx, t, b, "AGENT_OUTCOMES") {
		seen[m.header.Get("Nats-Msg-Id")]++
	}
	committed, missing = map[int32]int{}, map[int32]int{}
	l.mu.Lock()
	defer l.mu.Unlock()
	for id, phase := range l.outcomes {
		committed[phase]++
		switch seen[wire.OutcomeMsgID(id)] {
		case 0:
			missing[phase]++
		case 1:
		default:
			t.Errorf("outcome %s published %d times", id, seen[wire.OutcomeMsgID(id)])
		}
	}
	return committed, missing
}

// awaitCaughtUp waits until the slot confirmed every change committed so far.
func awaitCaughtUp(t *testing.T, pool *pgxpool.Pool, slot string) {
	t.Helper()
	ctx := ctxT(t, time.Minute)
	var target string
	require.NoError(t, pool.QueryRow(ctx, `SELECT pg_current_wal_lsn()::text`).Scan(&target))
	require.Eventually(t, func() bool {
		var caught bool
		err := pool.QueryRow(ctx, `SELECT confirmed_flush_lsn >= $2::pg_lsn FROM pg_replication_slots WHERE slot_name = $1`,
			slot, target).Scan(&caught)
		return err == nil && caught
	}, time.Minute, 20*time.Millisecond, "slot %s never confirmed %s", slot, target)
}

// The slot disappears while the relay streams under load, as on a failover: its walsender is
// terminated and the slot dropped before the relay reconnects. The relay finds no slot,
// creates one and backfills the unfinished rows.
func TestSlotDroppedUnderLoad(t *testing.T) {
	t.Parallel()
	b := setup(t)
	b.startActive(t)
	l := startSlotLoad(t, b.db.Pool, conversationIDs(20))
	l.awaitRows(t, 300)

	l.phase.Store(phaseGap)
	dropped := time.Now()
	attempts := dropSlotLikeAFailover(t, b.db.Pool, b.cfg.Slot)
	l.phase.Store(phaseRecovering)
	l.awaitRows(t, 100) // committed while no slot exists, or while the relay recreates it
	awaitRecreated(t, b.db.Pool, b.cfg.Slot, dropped)
	l.phase.Store(phaseAfter)
	l.awaitRows(t, 300)
	l.finish()
	require.Empty(t, l.failures())
	awaitCaughtUp(t, b.db.Pool, b.cfg.Slot)

	rows := checkTurns(t, b, b.db.Pool)
	committed, missing := outcomeCounts(t, b, l)
	require.Zero(t, missing[phaseAfter], "outcomes committed after the slot was recreated are all published")
	require.Positive(t, committed[phaseAfter])
	t.Logf("slot dropped under load (%d attempts): %d outbox rows, each turn event once; outcomes by phase (before, gap, recovering, after, mixed): committed %v, missing from the stream %v",
		attempts, rows, committed, missing)
}

// The slot is invalidated (wal_status lost) while the relay is down under load: Run refuses
// with ErrSlotLost, the operator drops the slot as the error says, and the relay recreates it
// and backfills. Outcomes committed while the relay was down are lost from the outcomes stream
// (they are in Postgres): the README says so.
func TestLostSlotUnderLoadRecovers(t *testing.T) {
	t.Parallel()
	ctx := ctxT(t, 3*time.Minute)
	// A cluster of its own: max_slot_wal_keep_size is cluster-wide.
	pg, conn := ownCluster(t, ctx)
	for _, sql := range []string{`ALTER SYSTEM SET max_slot_wal_keep_size = '1MB'`, `SELECT pg_reload_conf()`,
		`CREATE TABLE filler (v text)`} {
		_, err := conn.Exec(ctx, sql)
		require.NoError(t, err)
	}
	pool, err := pgxpool.New(ctx, pg.URL("postgres"))
	require.NoError(t, err)
	t.Cleanup(pool.Close)

	b := setup(t)
	b.cfg.DatabaseURL = pg.URL("postgres")
	b.cfg.Slot = "baton"
	// run starts a relay; wait returns Run's result (30s at most), stop cancels it first.
	run := func() (r *relay.Relay, wait, stop func() error) {
		r, err := relay.New(b.cfg)
		require.NoError(t, err)
		runCtx, cancel := context.WithCancel(ctx)
		done := make(chan error, 1)
		go func() { done <- r.Run(runCtx) }()
		var once sync.Once
		var result error
		wait = func() error {
			once.Do(func() {
				select {
				case result = <-done:
				case <-time.After(30 * time.Second):
					cancel()
					result = errors.Join(errors.New("relay did not return within 30s"), <-done)
				}
			})
			return result
		}
		stop = func() error { cancel(); return wait() }
		t.Cleanup(func() { _ = stop() })
		return r, wait, stop
	}
	r, _, stop := run()
	require.Eventually(t, r.Active, time.Minute, 10*time.Millisecond)
	l := startSlotLoad(t, pool, conversationIDs(20))
	l.awaitRows(t, 300)

	// The relay goes down (gracefully: what it published is confirmed) while the load goes on,
	// and more WAL than the cap is written. A graceful stop publishes what the relay read, not
	// what was committed after it: so the "before" outcomes are those committed before the
	// relay confirmed a position, and those committed from there until it is down may or may
	// not be published (mixed). (Labelled "before" until stop returned, an outcome committed
	// while the relay drained was counted missing: it failed 2 of 3 full-suite runs on 2026-12-01.)
	l.phase.Store(phaseMixed)
	var end string
	require.NoError(t, conn.QueryRow(ctx, `SELECT pg_current_wal_lsn()::text`).Scan(&end))
	require.Eventually(t, func() bool {
		var past bool
		err := conn.QueryRow(ctx, `SELECT confirmed_flush_lsn >= $1::pg_lsn FROM pg_replication_slots WHERE slot_name = 'baton'`, end).Scan(&past)
		return err == nil && past
	}, time.Minute, 5*time.Millisecond, "the relay never confirmed what was committed before it stops")
	require.NoError(t, stop())
	l.phase.Store(phaseGap)
	down := time.Now()
	require.Eventually(t, func() bool {
		_, err := conn.Exec(ctx, `INSERT INTO filler SELECT repeat('x', 500) FROM generate_series(1, 20000); SELECT pg_switch_wal(); CHECKPOINT; CHECKPOINT`)
		require.NoError(t, err)
		var status string
		require.NoError(t, conn.QueryRow(ctx, `SELECT wal_status FROM pg_replication_slots WHERE slot_name = 'baton'`).Scan(&status))
		return status == "lost"
	}, time.Minute, 10*time.Millisecond)
	l.awaitRows(t, 100)

	// The next relay refuses with ErrSlotLost, whose message says what to do.
	_, wait, _ := run()
	lost := wait()
	if !errors.Is(lost, relay.ErrSlotLost) {
		t.Fatalf("Run returned %v, want ErrSlotLost", lost)
	}
	require.ErrorContains(t, lost, "pg_drop_replication_slot('baton')")

	// The operator's recovery: drop the slot, start the relay.
	_, err = conn.Exec(ctx, `SELECT pg_drop_replication_slot('baton')`)
	require.NoError(t, err)
	l.phase.Store(phaseRecovering)
	run()
	awaitRecreated(t, pool, "baton", down)
	l.phase.Store(phaseAfter)
	l.awaitRows(t, 300)
	l.finish()
	require.Empty(t, l.failures())
	awaitCaughtUp(t, pool, "baton")

	rows := checkTurns(t, b, pool)
	committed, missing := outcomeCounts(t, b, l)
	require.Zero(t, missing[phaseBefore], "the relay stopped gracefully: every outcome before is published")
	require.Zero(t, missing[phaseAfter], "outcomes committed after the slot was recreated are all published")
	require.Positive(t, committed[phaseGap])
	require.Equal(t, committed[phaseGap], missing[phaseGap],
		"outcomes committed while the slot was lost are in no outbox row: no backfill publishes them (README: Postgres failover)")
	t.Cleanup(func() { _, _ = conn.Exec(context.Background(), `SELECT pg_drop_replication_slot('baton')`) })
	t.Logf("slot lost under load: %d outbox rows, each turn event once; outcomes by phase (before, gap, recovering, after, mixed): committed %v, missing from the stream %v",
		rows, committed, missing)
}
