package badinput

import (
	"encoding/json"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/stretchr/testify/require"

	"github.com/batonhq/baton/wire"
)

// TestSmallMaxPayload runs the system on a NATS server whose max_payload is 64 KiB. Turn
// events carry ids only (at most a few hundred bytes). A reply larger than the limit (the echo
// of a 100 KiB message, or of a turn of 100 messages answering 100 rows) is published without
// its content, flagged, with its answered ids. A burst of 3,000 rows, which the relay publishes
// in fast-ingest batches, is relayed and answered whole. A malformed baton.answers message of
// 200 KiB is set aside in the dead-letter stream with a record cut to fit the limit. Every
// message on every stream fits the limit, and nothing stalls.
func TestSmallMaxPayload(t *testing.T) {
	t.Parallel()
	const maxPayload = 64 << 10
	s := start(t, options{maxPayload: maxPayload, watchTurns: true})
	ctx := ctxFor(t, 2*time.Minute)

	// A 100 KiB message: its 100 KiB echo's outcome goes out without content.
	s.conversation("large")
	s.send("large", "large-1", filled(100<<10))
	a := s.awaitAnswer("large-1", time.Minute)
	require.Equal(t, "done", a.status, a.lastError)
	ev, raw := s.awaitOutcome(a.replyID, time.Minute)
	require.True(t, ev.ContentOmitted)
	require.Equal(t, len(a.reply), ev.ContentBytes)
	require.Equal(t, "true", raw.Header.Get(wire.HeaderContentOmitted))

	// A turn of 100 messages of 1 KiB, written in one transaction: one reply answering 100 rows.
	s.conversation("many")
	_, err := s.db.Pool.Exec(ctx, `WITH m AS (
			INSERT INTO messages (id, conversation_id, role, content)
			SELECT 'many-' || lpad(g::text, 3, '0'), 'many', 'user', repeat('y', 1024) FROM generate_series(1, 100) g
			RETURNING id, conversation_id)
		INSERT INTO agent_outbox (conversation_id, message_id) SELECT conversation_id, id FROM m ORDER BY id`)
	require.NoError(t, err)

	// A malformed baton.answers message of 200 KiB, in a transaction with a request.
	s.conversation("answers")
	tx, err := s.db.Pool.Begin(ctx)
	require.NoError(t, err)
	_, err = tx.Exec(ctx, insertSQL, "answers-1", "answers", "hi")
	require.NoError(t, err)
	_, err = tx.Exec(ctx, `SELECT pg_logical_emit_message(true, $1, repeat('z', 200000))`, wire.AnswersPrefix)
	require.NoError(t, err)
	require.NoError(t, tx.Commit(ctx))

	// A burst of 3,000 rows over 30 conversations in one transaction.
	for i := range 30 {
		s.conversation(fmt.Sprintf("burst-%02d", i))
	}
	_, err = s.db.Pool.Exec(ctx, `WITH m AS (
			INSERT INTO messages (id, conversation_id, role, content)
			SELECT 'burst-' || g, 'burst-' || lpad((g % 30)::text, 2, '0'), 'user', 'b' || g FROM generate_series(1, 3000) g
			RETURNING id, conversation_id)
		INSERT INTO agent_outbox (conversation_id, message_id) SELECT conversation_id, id FROM m ORDER BY id`)
	require.NoError(t, err)

	s.requireAllAnswered(90 * time.Second)
	s.requireFlowing("small-max-payload")

	// The reply to the first 100 "many" messages: without content, with its 100 ids.
	var replyID string
	require.NoError(t, s.db.Pool.QueryRow(ctx, `SELECT reply_id FROM agent_outbox WHERE message_id = 'many-001'`).Scan(&replyID))
	ev, raw = s.awaitOutcome(replyID, time.Minute)
	require.True(t, ev.ContentOmitted)
	require.Len(t, ev.OutboxIDs, s.count(`SELECT count(*)::int FROM agent_outbox WHERE reply_id = $1`, replyID))
	require.Equal(t, len(ev.OutboxIDs), len(strings.Split(raw.Header.Get(wire.HeaderOutboxID), ",")))

	// The answers message: one record, cut to fit, with its full size.
	dead := s.readStream("AGENT_DEADLETTER")
	require.Len(t, dead, 1)
	var rec wire.DeadLetter
	require.NoError(t, json.Unmarshal(dead[0].Data, &rec))
	require.Equal(t, wire.DeadLetterAnswers, rec.Kind)
	require.Equal(t, 200000, rec.RawBytes)
	require.NotEmpty(t, rec.Raw)
	require.Less(t, len(rec.Raw), maxPayload)
	s.relay.WaitLog(t, "setting it aside in the dead-letter stream", time.Second, `"kind":"answers"`)

	// Every message of every stream fits the server's limit (turn events as published: the
	// work queue deleted them once acknowledged).
	for _, name := range []string{"AGENT_TURNS", "AGENT_OUTCOMES", "AGENT_DEADLETTER"} {
		msgs := s.readStream(name)
		if name == "AGENT_TURNS" {
			msgs = s.publishedTurns()
		}
		require.NotEmpty(t, msgs, name)
		for _, m := range msgs {
			require.LessOrEqual(t, wireSize(m.Header, m.Data), maxPayload, "%s seq %d", name, m.Sequence)
		}
	}
	// The relay's only ERROR is the dead letter's.
	for _, l := range s.relay.LogLines() {
		if strings.Contains(l, `"level":"ERROR"`) {
			require.Contains(t, l, "dead-letter", "relay error log")
		}
	}
	requireNoErrorLogs(t, s.worker)
}

// wireSize is the size NATS checks against max_payload: the header block as the protocol
// carries it, plus the body.
func wireSize(h nats.Header, data []byte) int {
	if len(h) == 0 {
		return len(data)
	}
	n := len("NATS/1.0\r\n\r\n")
	for k, vs := range h {
		for _, v := range vs {
			n += len(k) + len(": \r\n") + len(v)
		}
	}
	return n + len(data)
}
