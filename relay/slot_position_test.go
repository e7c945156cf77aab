package relay_test

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/batonhq/baton/relay"
	"github.com/batonhq/baton/wire"
)

// After a restore or a failover the slot can be behind what the relay confirmed before: the
// backup or the standby's copy of the slot was taken earlier. The slot's position is the truth
// then: the relay must replay from it and confirm nothing it has not published in this session.
//
// The test builds that state in one cluster with pg_copy_logical_replication_slot: it copies the
// slot early (the "backup"), lets the relay publish and confirm a large transaction, stops the
// relay, and puts the copy in the slot's place. JetStream is restored too (the turns stream is
// deleted), so each replayed event shows up when acknowledged. The same Relay then runs again,
// with its in-memory LSN past the large transaction. Before any replayed event is acknowledged
// the slot must not move past that transaction: a relay that confirmed its old LSN there would
// lose the transaction if it died before publishing it.
func TestSessionStartTakesTheSlotPosition(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := ctxT(t, 3*time.Minute)
	createConversations(t, b.db.Pool, "c")
	r, err := relay.New(b.cfg)
	require.NoError(t, err)

	runCtx, stop := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- r.Run(runCtx) }()
	require.Eventually(t, r.Active, time.Minute, 5*time.Millisecond)
	requireSlotCaughtUp(t, b)
	backup := b.cfg.Slot + "_bak"
	_, err = b.db.Pool.Exec(ctx, `SELECT pg_copy_logical_replication_slot($1, $2)`, b.cfg.Slot, backup)
	require.NoError(t, err)

	// One large transaction: Postgres decodes all of it before it sends any of it.
	const rows = 20000
	tx, err := b.db.Pool.Begin(ctx)
	require.NoError(t, err)
	_, err = tx.Exec(ctx, `WITH m AS (INSERT INTO messages (id, conversation_id, role, content)
			SELECT 'm' || i, 'c', 'user', 'hello' FROM generate_series(1, $1) i RETURNING id)
		INSERT INTO agent_outbox (conversation_id, message_id) SELECT 'c', id FROM m`, rows)
	require.NoError(t, err)
	var beforeCommit string
	require.NoError(t, tx.QueryRow(ctx, `SELECT pg_current_wal_insert_lsn()::text`).Scan(&beforeCommit))
	require.NoError(t, tx.Commit(ctx))
	b.waitStream(t, "AGENT_TURNS", rows, time.Minute)
	requireSlotCaughtUp(t, b)
	require.Greater(t, uint64(r.Confirmed()), lsnOf(t, beforeCommit))
	// The transaction's commit record starts at its commit LSN, which its events carry. Postgres
	// replays a transaction whose commit record starts at or after the slot's confirmed LSN, so
	// a confirmed LSN up to it loses nothing: between beforeCommit and the commit record lie
	// other databases' records (the tests share the cluster), and a keepalive sent while the
	// walsender decodes the transaction, before its BEGIN, carries the end of such a record.
	turns, err := b.js.Stream(ctx, "AGENT_TURNS")
	require.NoError(t, err)
	last, err := turns.GetLastMsgForSubject(ctx, ">")
	require.NoError(t, err)
	commitLSN := lsnOf(t, last.Header.Get(wire.HeaderCommitLSN))
	require.GreaterOrEqual(t, commitLSN, lsnOf(t, beforeCommit))
	stop()
	require.NoError(t, <-done)

	// The restore: the slot goes back to the backup's position, the stream to empty. The
	// relay's walsender may still be exiting after Run returned: the slot is busy until then.
	require.Eventually(t, func() bool {
		var active bool
		err := b.db.Pool.QueryRow(ctx, `SELECT active FROM pg_replication_slots WHERE slot_name = $1`, b.cfg.Slot).Scan(&active)
		return err == nil && !active
	}, 30*time.Second, 10*time.Millisecond, "the stopped relay's walsender never released the slot")
	_, err = b.db.Pool.Exec(ctx, `SELECT pg_drop_replication_slot($1)`, b.cfg.Slot)
	require.NoError(t, err)
	_, err = b.db.Pool.Exec(ctx, `SELECT pg_copy_logical_replication_slot($1, $2)`, backup, b.cfg.Slot)
	require.NoError(t, err)
	_, err = b.db.Pool.Exec(ctx, `SELECT pg_drop_replication_slot($1)`, backup)
	require.NoError(t, err)
	require.NoError(t, b.js.DeleteStream(ctx, "AGENT_TURNS"))

	runCtx, stop = context.WithCancel(ctx)
	defer stop()
	go func() { done <- r.Run(runCtx) }()
	count := func() uint64 {
		s, err := b.js.Stream(ctx, "AGENT_TURNS")
		if err != nil {
			return 0
		}
		info, err := s.Info(ctx)
		if err != nil {
			return 0
		}
		return info.State.Msgs
	}
	deadline := time.Now().Add(time.Minute)
	for {
		var confirmed string
		require.NoError(t, b.db.Pool.QueryRow(ctx, `SELECT confirmed_flush_lsn::text FROM pg_replication_slots WHERE slot_name = $1`,
			b.cfg.Slot).Scan(&confirmed))
		n := count() // after reading the slot: a confirmation seen there was made before this count
		if lsnOf(t, confirmed) > commitLSN {
			require.GreaterOrEqual(t, n, uint64(rows),
				"slot confirmed %s, past the large transaction, while the stream held %d of its %d events", confirmed, n, rows)
			break
		}
		require.True(t, time.Now().Before(deadline), "the replay never confirmed the large transaction (slot at %s, %d events)", confirmed, n)
		time.Sleep(2 * time.Millisecond)
	}
	msgs := b.waitStream(t, "AGENT_TURNS", rows, time.Minute)
	assertExactlyOnceInOrder(t, msgs, truth(t, b.db.Pool))
	stop()
	require.NoError(t, <-done)
}
