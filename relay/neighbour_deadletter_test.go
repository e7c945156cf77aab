package relay_test

import (
	"bytes"
	"context"
	"encoding/json"
	"testing"
	"time"

	"github.com/jackc/pglogrepl"
	"github.com/jackc/pgx/v5"
	"github.com/nats-io/nats.go"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"

	"github.com/batonhq/baton/migrations"
	"github.com/batonhq/baton/relay"
	"github.com/batonhq/baton/wire"
)

// startShardRelay runs relay shard k of n in this process, on a NATS connection of its own,
// until the test ends, and waits until it streams from its slot. Its metrics go to reg.
func startShardRelay(t *testing.T, b *bundle, k, n int, reg *prometheus.Registry) {
	t.Helper()
	nc, err := nats.Connect(b.nats.URL(), nats.MaxReconnects(-1), nats.ReconnectWait(50*time.Millisecond))
	require.NoError(t, err)
	t.Cleanup(nc.Close) // after the relay stopped: cleanups run last-registered first
	cfg := b.cfg
	cfg.NATS, cfg.Shards, cfg.Shard, cfg.Registerer = nc, n, k, reg
	r, err := relay.New(cfg)
	require.NoError(t, err)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- r.Run(ctx) }()
	t.Cleanup(func() {
		cancel()
		select {
		case err := <-done:
			require.NoError(t, err, "shard %d/%d", k, n)
		case <-time.After(30 * time.Second):
			t.Errorf("shard relay %d/%d did not stop within 30s", k, n)
		}
	})
	require.Eventually(t, r.Active, time.Minute, 5*time.Millisecond, "shard relay %d/%d never became active", k, n)
}

// requireShardSlotsCaughtUp waits until every shard slot of n confirmed the WAL insert
// position as of the call: each shard relay has then had the PubAck of every record it
// published before it (a record JetStream dropped as a duplicate is acknowledged too).
func requireShardSlotsCaughtUp(t *testing.T, b *bundle, n int) {
	t.Helper()
	ctx := ctxT(t, time.Minute)
	var target string
	require.NoError(t, b.db.Pool.QueryRow(ctx, `SELECT pg_current_wal_insert_lsn()::text`).Scan(&target))
	for k := range n {
		slot := migrations.ShardName(b.cfg.Slot, k)
		require.Eventually(t, func() bool {
			var ok bool
			err := b.db.Pool.QueryRow(ctx, `SELECT confirmed_flush_lsn >= $2::pg_lsn FROM pg_replication_slots WHERE slot_name = $1`,
				slot, target).Scan(&ok)
			return err == nil && ok
		}, 30*time.Second, 20*time.Millisecond, "slot %s never confirmed %s", slot, target)
	}
}

// shardedRecord is a dead-letter record as a test reads it back: its body and Nats-Msg-Id.
type shardedRecord struct {
	rec   deadLetterRecord
	msgID string
}

func (r shardedRecord) String() string {
	return r.msgID + " (" + r.rec.Kind + " at " + r.rec.LSN + ")"
}

func shardedRecords(t *testing.T, b *bundle) []shardedRecord {
	t.Helper()
	var out []shardedRecord
	for _, d := range b.readStream(t, "AGENT_DEADLETTER") {
		var r shardedRecord
		require.NoError(t, json.Unmarshal(d.data, &r.rec))
		r.msgID = d.header.Get(nats.MsgIdHdr)
		out = append(out, r)
	}
	return out
}

// Two shard relays each set aside one row of the same COPY: the rows of one multi-insert WAL
// record share its LSN, and each shard's row is the first change of its own stream there.
// Numbered per shard, both records were "deadletter:<lsn>", and JetStream dropped the second
// shard's as a duplicate: a row skipped without its record. Each shard names its records
// (wire.DeadLetterShardMsgID): the stream holds both.
func TestShardedDeadLetterRecordsAtOnePositionAreAllKept(t *testing.T) {
	t.Parallel()
	const n = 2
	b := shardSetup(t, n)
	ctx := ctxT(t, 2*time.Minute)
	convs := conversationIDs(20)
	createConversations(t, b.db.Pool, convs...)
	shard := shardOf(t, b, n, convs)
	var in [n]string // a conversation of each shard
	for _, c := range convs {
		in[shard[c]] = c
	}
	require.NotEmpty(t, in[0], "shard 0 has conversations")
	require.NotEmpty(t, in[1], "shard 1 has conversations")
	regs := [n]*prometheus.Registry{prometheus.NewRegistry(), prometheus.NewRegistry()}
	for k := range n {
		startShardRelay(t, b, k, n, regs[k])
	}

	_, err := b.db.Pool.Exec(ctx, `INSERT INTO messages (id, conversation_id, role, content)
		VALUES ('far0', $1, 'user', 'x'), ('far1', $2, 'user', 'x')`, in[0], in[1])
	require.NoError(t, err)
	far := time.Date(10000, 1, 1, 0, 0, 0, 0, time.UTC) // finite, but no RFC 3339 form
	copied, err := b.db.Pool.CopyFrom(ctx, pgx.Identifier{"agent_outbox"}, []string{"conversation_id", "message_id", "created_at"},
		pgx.CopyFromRows([][]any{{in[0], "far0", far}, {in[1], "far1", far}}))
	require.NoError(t, err)
	require.EqualValues(t, 2, copied)
	after := map[int64]string{}
	for k := range n {
		id, err := send(ctx, b.db.Pool, in[k], "after"+string(rune('0'+k)))
		require.NoError(t, err)
		after[id] = in[k]
	}

	assertExactlyOnceInOrder(t, b.waitStream(t, "AGENT_TURNS", len(after), 30*time.Second), after)
	requireShardSlotsCaughtUp(t, b, n)
	for k := range n {
		require.Equal(t, 1.0, counter(t, regs[k], "baton_relay_deadletter_total", "turn"), "shard %d set aside its row", k)
	}

	recs := shardedRecords(t, b)
	require.Len(t, recs, n, "each shard set aside one row, each row needs its record; stored: %v", recs)
	lsn, err := pglogrepl.ParseLSN(recs[0].rec.LSN)
	require.NoError(t, err)
	require.Equal(t, recs[0].rec.LSN, recs[1].rec.LSN, "the rows of one COPY share a position")
	seen := map[string]bool{}
	for _, r := range recs {
		require.Equal(t, wire.DeadLetterTurn, r.rec.Kind)
		require.Equal(t, "public.agent_outbox", r.rec.Table)
		var k int
		switch {
		case bytes.Contains(r.rec.Raw, []byte("far0")):
			k = 0
		case bytes.Contains(r.rec.Raw, []byte("far1")):
			k = 1
		default:
			t.Fatalf("record of neither row: %q", r.rec.Raw)
		}
		require.False(t, seen[r.msgID], "two records with Nats-Msg-Id %s", r.msgID)
		seen[r.msgID] = true
		require.Equal(t, wire.DeadLetterShardMsgID(k, n, lsn.String(), 0), r.msgID, "shard %d's record", k)
	}
}

// A malformed baton.answers message reaches every shard's slot (logical messages are not
// filtered by publications), and every shard relay sets it aside: the dead-letter stream holds
// one record per shard, each with its shard's Nats-Msg-Id, however far apart the shards
// decode it (one shared id would merge them only within the duplicate window).
func TestShardedMalformedAnswersGiveOneRecordPerShard(t *testing.T) {
	t.Parallel()
	const n = 2
	b := shardSetup(t, n)
	ctx := ctxT(t, 2*time.Minute)
	convs := conversationIDs(20)
	createConversations(t, b.db.Pool, convs...)
	regs := [n]*prometheus.Registry{prometheus.NewRegistry(), prometheus.NewRegistry()}
	for k := range n {
		startShardRelay(t, b, k, n, regs[k])
	}

	tx, err := b.db.Pool.Begin(ctx)
	require.NoError(t, err)
	var emitted string
	require.NoError(t, tx.QueryRow(ctx, `SELECT pg_logical_emit_message(true, $1, 'not json')::text`, wire.AnswersPrefix).Scan(&emitted))
	_, err = tx.Exec(ctx, `INSERT INTO messages (id, conversation_id, role, content) VALUES ('r1', $1, 'assistant', 'hi')`, convs[0])
	require.NoError(t, err)
	require.NoError(t, tx.Commit(ctx))
	b.waitStream(t, "AGENT_OUTCOMES", 1, 30*time.Second)
	requireShardSlotsCaughtUp(t, b, n)
	for k := range n {
		require.Equal(t, 1.0, counter(t, regs[k], "baton_relay_deadletter_total", wire.DeadLetterAnswers), "shard %d set the message aside", k)
	}

	at, err := pglogrepl.ParseLSN(emitted)
	require.NoError(t, err)
	recs := shardedRecords(t, b)
	require.Len(t, recs, n, "one record per shard; stored: %v", recs)
	var ids []string
	for _, r := range recs {
		require.Equal(t, wire.DeadLetterAnswers, r.rec.Kind)
		require.Equal(t, at.String(), r.rec.LSN, "the record's LSN is the message's own")
		require.Equal(t, "not json", string(r.rec.Raw))
		ids = append(ids, r.msgID)
	}
	require.ElementsMatch(t, []string{wire.DeadLetterShardMsgID(0, n, at.String(), 0), wire.DeadLetterShardMsgID(1, n, at.String(), 0)}, ids)
}
