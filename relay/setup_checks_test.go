package relay_test

import (
	"fmt"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"github.com/stretchr/testify/require"

	"github.com/batonhq/baton/relay"
)

// A stream the relay cannot publish to successfully is a setup error that names the setting,
// not a session that restarts forever: with NoAck no PubAck ever comes; with a MaxMsgSize below
// the server's max payload, events the relay sized for the server are rejected.
func TestStreamSettingsThatWouldLoopAreSetupErrors(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name   string
		stream jetstream.StreamConfig
		says   string
	}{
		{"no ack", jetstream.StreamConfig{Name: "AGENT_TURNS", Subjects: []string{"agent.turns.>"}, NoAck: true}, "no_ack"},
		{"max msg size", jetstream.StreamConfig{Name: "AGENT_OUTCOMES", Subjects: []string{"agent.outcomes.>"}, MaxMsgSize: 512}, "max_msg_size 512"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			b := setup(t)
			ctx := ctxT(t, time.Minute)
			_, err := b.js.CreateStream(ctx, tc.stream)
			require.NoError(t, err)
			r, err := relay.New(b.cfg)
			require.NoError(t, err)
			err = r.Run(ctxT(t, 20*time.Second))
			require.ErrorIs(t, err, relay.ErrSetup)
			require.ErrorContains(t, err, tc.says)
			require.ErrorContains(t, err, tc.stream.Name)
		})
	}
}

// BackfillBatch is how many rows each backfill query reads: the backfill reads its snapshot in
// pages and publishes every row once, across page boundaries and gaps in the ids.
func TestBackfillReadsInBatches(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := ctxT(t, 2*time.Minute)
	createConversations(t, b.db.Pool, "a", "b")
	for i := range 50 {
		_, err := send(ctx, b.db.Pool, []string{"a", "b"}[i%2], fmt.Sprintf("m%d", i))
		require.NoError(t, err)
	}
	_, err := b.db.Pool.Exec(ctx, `UPDATE agent_outbox SET status = 'done' WHERE id % 6 = 0`)
	require.NoError(t, err)
	scans := func() int64 {
		var n int64
		require.NoError(t, b.db.Pool.QueryRow(ctx, `SELECT seq_scan + coalesce(idx_scan, 0) FROM pg_stat_user_tables
			WHERE relname = 'agent_outbox'`).Scan(&n))
		return n
	}
	_, err = b.db.Pool.Exec(ctx, `SELECT pg_stat_force_next_flush()`)
	require.NoError(t, err)
	before := scans()

	const batch = 7
	b.cfg.BackfillBatch = batch
	b.startActive(t)
	want := map[int64]string{} // pending rows only: done ones are not backfilled
	rows, err := b.db.Pool.Query(ctx, `SELECT id, conversation_id FROM agent_outbox WHERE status = 'pending'`)
	require.NoError(t, err)
	for rows.Next() {
		var id int64
		var conv string
		require.NoError(t, rows.Scan(&id, &conv))
		want[id] = conv
	}
	require.NoError(t, rows.Err())
	require.Len(t, want, 50-8)
	assertExactlyOnceInOrder(t, b.waitStream(t, "AGENT_TURNS", len(want), 30*time.Second), want)
	// Each page is one query of agent_outbox (one scan): at least len(want)/batch of them. The
	// relay's session reports its statistics when idle, within seconds.
	pages := int64((len(want) + batch - 1) / batch)
	require.Eventually(t, func() bool { return scans()-before-1 >= pages }, 30*time.Second, 100*time.Millisecond,
		"the backfill read agent_outbox in fewer than %d queries", pages)
}

// A stream byte cap below the server's max_payload could refuse one event for good, which
// would look like a full stream forever: the relay refuses to start instead.
func TestStreamMaxBytesBelowMaxPayloadIsASetupError(t *testing.T) {
	t.Parallel()
	b := setup(t)
	b.cfg.Streams.MaxBytes = 100
	r, err := relay.New(b.cfg)
	require.NoError(t, err)
	err = r.Run(ctxT(t, 20*time.Second))
	require.ErrorIs(t, err, relay.ErrSetup)
	require.ErrorContains(t, err, "stream max bytes 100 is below the NATS server's max_payload")
}
