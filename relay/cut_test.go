package relay_test

import (
	"encoding/json"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/batonhq/baton/wire"
)

// Replication messages larger than MaxChangeBytes are cut as they arrive: a logical message of
// another prefix is skipped, an answers message and a reply that large are set aside in the
// dead-letter stream with their real size, and the changes around them are published as
// usual, in one transaction and across transactions.
func TestChangesOverMaxChangeBytesAreCutAndSetAside(t *testing.T) {
	t.Parallel()
	b := setup(t)
	b.cfg.MaxChangeBytes = 1 << 20
	ctx := ctxT(t, 2*time.Minute)
	createConversations(t, b.db.Pool, "c")
	b.startActive(t)
	const big = 3 << 20

	id1, err := send(ctx, b.db.Pool, "c", "u1")
	require.NoError(t, err)
	_, err = b.db.Pool.Exec(ctx, `SELECT pg_logical_emit_message(false, 'not.baton', repeat('x', $1))`, big)
	require.NoError(t, err)
	tx, err := b.db.Pool.Begin(ctx)
	require.NoError(t, err)
	id2, err := send(ctx, tx, "c", "u2")
	require.NoError(t, err)
	_, err = tx.Exec(ctx, `SELECT pg_logical_emit_message(true, $1, '{"message_id":"r1","outbox_ids":[' || repeat('1,', $2) || '1]}')`,
		wire.AnswersPrefix, big/2)
	require.NoError(t, err)
	_, err = tx.Exec(ctx, `INSERT INTO messages (id, conversation_id, role, content) VALUES ('r1', 'c', 'assistant', repeat('y', $1))`, big)
	require.NoError(t, err)
	_, err = tx.Exec(ctx, `INSERT INTO messages (id, conversation_id, role, content) VALUES ('r2', 'c', 'assistant', 'small')`)
	require.NoError(t, err)
	require.NoError(t, tx.Commit(ctx))
	id3, err := send(ctx, b.db.Pool, "c", "after")
	require.NoError(t, err)

	turns := b.waitStream(t, "AGENT_TURNS", 3, 30*time.Second)
	assertExactlyOnceInOrder(t, turns, map[int64]string{id1: "c", id2: "c", id3: "c"})
	outcomes := b.waitStream(t, "AGENT_OUTCOMES", 1, 30*time.Second)
	require.Len(t, outcomes, 1)
	var ev wire.OutcomeEvent
	require.NoError(t, json.Unmarshal(outcomes[0].data, &ev))
	require.Equal(t, "r2", ev.MessageID)

	dls := b.waitStream(t, "AGENT_DEADLETTER", 2, 30*time.Second)
	require.Len(t, dls, 2)
	byKind := map[string]deadLetterRecord{}
	for _, m := range dls {
		var rec deadLetterRecord
		require.NoError(t, json.Unmarshal(m.data, &rec))
		byKind[rec.Kind] = rec
	}
	for _, kind := range []string{wire.DeadLetterAnswers, wire.DeadLetterOutcome} {
		rec, ok := byKind[kind]
		require.True(t, ok, "no %s record in %v", kind, byKind)
		require.Greater(t, rec.RawBytes, b.cfg.MaxChangeBytes, "raw_bytes is the change's real size")
		require.Contains(t, rec.Reason, "MaxChangeBytes")
		require.LessOrEqual(t, len(rec.Raw), wire.MaxDeadLetterRaw)
	}
	require.True(t, strings.HasSuffix(byKind[wire.DeadLetterOutcome].Table, ".messages"))
	requireSlotCaughtUp(t, b)
}

// Any role may call pg_logical_emit_message, and pgoutput sends every logical message whatever
// its prefix, in one CopyData of up to 1 GB. Received whole (pgx buffers each protocol message
// in full), one SELECT drove the relay past its memory limit: OOM-killed, restarted at the
// same LSN, killed again, for ever, while the slot retained WAL (seen: 581 MiB peak for a 560
// MiB message, against the 512Mi limit of relay-deployment.yaml). The real binary, with its
// default MaxChangeBytes, must stay far below the message's size and go on relaying.
func TestHugeLogicalMessageDoesNotCostTheRelayItsMemory(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := ctxT(t, 4*time.Minute)
	createConversations(t, b.db.Pool, "c")
	p := b.startProcess(t)
	p.awaitStreaming(t)
	const size = 200 << 20
	_, err := b.db.Pool.Exec(ctx, `SELECT pg_logical_emit_message(false, 'not.baton', repeat('x', $1))`, size)
	require.NoError(t, err)
	id, err := send(ctx, b.db.Pool, "c", "after")
	require.NoError(t, err)
	msgs := b.waitStream(t, "AGENT_TURNS", 1, 2*time.Minute)
	assertExactlyOnceInOrder(t, msgs, map[int64]string{id: "c"})

	hwm := peakRSS(t, p.cmd.Process.Pid)
	t.Logf("peak RSS %d MiB after a %d MiB logical message", hwm>>20, size>>20)
	require.NotZero(t, hwm)
	require.Less(t, hwm, int64(size/2), "the relay received the %d MiB message whole", size>>20)
}
