package relay_test

import (
	"fmt"
	"os"
	"runtime"
	"strconv"
	"testing"
	"time"

	"github.com/jackc/pglogrepl"
	"github.com/stretchr/testify/require"

	"github.com/batonhq/baton/relay"
	"github.com/batonhq/baton/wire"
)

// neighbourEmptyTxs is how many transactions without events a neighbour commits behind the
// held event: enough to fail by thousands on a pipeline that keeps one entry each.
// BATON_TEST_EMPTY_TXS raises it (the 2,000,000) to measure memory by hand.
func neighbourEmptyTxs(t *testing.T) int {
	t.Helper()
	n := 20_000
	if s := os.Getenv("BATON_TEST_EMPTY_TXS"); s != "" {
		v, err := strconv.Atoi(s)
		require.NoError(t, err, "BATON_TEST_EMPTY_TXS")
		n = v
	}
	return n
}

// A neighbour's small transactions keep coming while one event waits for its PubAck (the relay's
// NATS path frozen). None of them may cost the relay memory of its own: consecutive
// transactions without events behind the held one are one confirmable position, not one entry
// each (the issue: 2M of them, +108 MiB). Nothing is confirmed past the held event meanwhile,
// and once the path heals everything is published and the slot confirmed past the last one.
//
// How they reach the relay depends on the server. A transaction with a transactional logical
// message, which any role may emit under any prefix, comes as BEGIN, MESSAGE and COMMIT (the
// relay asks for messages). One that changed only tables outside the publication comes as BEGIN
// and COMMIT before PostgreSQL 15; since 15 pgoutput skips it, but the walsender still sends
// keepalives as it skips them (seen: 1,868 for 20,000), each a position behind the held event.
func TestEmptyTransactionsBehindAnUnacknowledgedEventStayBounded(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct{ name, setup, each string }{
		{"logical messages", "", `PERFORM pg_logical_emit_message(true, 'neighbour', 'x');`},
		{"neighbour table", `CREATE TABLE neighbour_rows (i int)`, `INSERT INTO neighbour_rows VALUES (i);`},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			emptyTxsStayBounded(t, tc.setup, tc.each)
		})
	}
}

// emptyTxsStayBounded runs TestEmptyTransactionsBehindAnUnacknowledgedEventStayBounded with
// neighbour transactions that each run the PL/pgSQL statement each, after the statement setup
// (unless "").
func emptyTxsStayBounded(t *testing.T, setupSQL, each string) {
	b := setup(t)
	n := neighbourEmptyTxs(t)
	ctx := ctxT(t, 4*time.Minute+time.Duration(n/10_000)*time.Second)
	createConversations(t, b.db.Pool, "c", "d")
	if setupSQL != "" {
		_, err := b.db.Pool.Exec(ctx, setupSQL)
		require.NoError(t, err)
	}
	// The held event waits: the session must not end on its ack timeout and drop the pipeline.
	b.cfg.AckTimeout = time.Hour
	relay.WatchPipelines(t, b.cfg.Slot)
	proxy, nc := proxiedNATS(t, b.nats.URL())
	t.Cleanup(proxy.Unfreeze) // before the relay's stop, registered after
	r, _ := b.startProxied(t, ctx, nc)
	want := map[int64]string{}
	id, err := send(ctx, b.db.Pool, "c", "warm")
	require.NoError(t, err)
	want[id] = "c"
	b.waitStream(t, "AGENT_TURNS", 1, 30*time.Second)
	state := func() (txs, outstanding int) {
		txs, outstanding, ok := relay.PipelineState(b.cfg.Slot)
		require.True(t, ok, "no pipeline for slot %s", b.cfg.Slot)
		return txs, outstanding
	}
	awaitOutstanding := func(events int) {
		t.Helper()
		require.Eventually(t, func() bool { _, o := state(); return o == events }, time.Minute, 10*time.Millisecond,
			"the relay never held %d events", events)
	}
	awaitOutstanding(0)

	proxy.Freeze()
	id, err = send(ctx, b.db.Pool, "c", "held")
	require.NoError(t, err)
	want[id] = "c"
	awaitOutstanding(1)
	heap := heapInUse()
	started := time.Now()
	_, err = b.db.Pool.Exec(ctx, fmt.Sprintf(`DO $$ BEGIN
		FOR i IN 1..%d LOOP
			%s
			COMMIT;
		END LOOP;
	END $$`, n, each))
	require.NoError(t, err)
	t.Logf("%d empty transactions committed in %s", n, time.Since(started).Round(time.Millisecond))
	// A marker behind them, on another conversation so that it is published at once: once the
	// relay holds it, it handled every empty transaction before it.
	id, err = send(ctx, b.db.Pool, "d", "marker")
	require.NoError(t, err)
	want[id] = "d"
	awaitOutstanding(2)
	txs, _ := state()
	t.Logf("%d transaction entries behind the held event; heap in use %+d KiB", txs, (heapInUse()-heap)>>10)
	// The held event's transaction, one position for every empty transaction and keepalive
	// behind it, the marker's, one for the keepalives behind that: nothing grows with the
	// neighbour's transactions.
	require.LessOrEqual(t, txs, 4, "%d transactions without events left %d entries", n, txs)
	confirmed := r.Confirmed()

	proxy.Unfreeze()
	msgs := b.waitStream(t, "AGENT_TURNS", len(want), time.Minute)
	assertExactlyOnceInOrder(t, msgs, want)
	// Positions before the held transaction may be confirmed (keepalives, other databases'
	// WAL), none at or past its commit until its PubAck.
	var heldCommit pglogrepl.LSN
	for _, m := range msgs {
		if m.header.Get(wire.HeaderMessageID) == "held" {
			heldCommit, err = pglogrepl.ParseLSN(m.header.Get(wire.HeaderCommitLSN))
			require.NoError(t, err)
		}
	}
	require.NotZero(t, heldCommit, "the held event has no commit LSN")
	require.LessOrEqual(t, confirmed, heldCommit, "confirmed past an event without its PubAck")
	requireSlotCaughtUp(t, b)
}

// heapInUse returns the bytes of heap in use after a collection.
func heapInUse() int64 {
	runtime.GC()
	var m runtime.MemStats
	runtime.ReadMemStats(&m)
	return int64(m.HeapInuse)
}

// The first-start backfill publishes the pending rows in outbox id order, the order workers
// claim them in, whatever order they committed in: the commit order of rows written before the
// slot existed is not in the WAL the slot can read, so it cannot be recovered. Here the row
// with the lower id commits last (its transaction took the id first and committed after the
// other), in one conversation and across two, and the turns stream holds each conversation's
// rows by id.
func TestBackfillPublishesInOutboxIDOrderNotCommitOrder(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := ctxT(t, 2*time.Minute)
	createConversations(t, b.db.Pool, "a", "b")
	want := map[int64]string{}
	var commits []int64 // ids in commit order
	for round := range 2 {
		first, err := b.db.Pool.Begin(ctx)
		require.NoError(t, err)
		early, err := send(ctx, first, "a", fmt.Sprintf("early%d", round))
		require.NoError(t, err)
		second, err := b.db.Pool.Begin(ctx)
		require.NoError(t, err)
		late, err := send(ctx, second, "a", fmt.Sprintf("late%d", round))
		require.NoError(t, err)
		other, err := send(ctx, second, "b", fmt.Sprintf("other%d", round))
		require.NoError(t, err)
		require.Less(t, early, late)
		require.NoError(t, second.Commit(ctx))
		require.NoError(t, first.Commit(ctx))
		commits = append(commits, late, other, early)
		want[early], want[late], want[other] = "a", "a", "b"
	}
	t.Logf("outbox ids in commit order: %v", commits)

	b.start(t)
	msgs := b.waitStream(t, "AGENT_TURNS", len(want), time.Minute)
	require.Len(t, msgs, len(want))
	for _, m := range msgs {
		require.Empty(t, m.header.Get(wire.HeaderCommitLSN), "a backfilled event has no commit LSN")
	}
	assertExactlyOnceInOrder(t, msgs, want)
}
