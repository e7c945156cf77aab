package relay_test

import (
	"encoding/json"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/stretchr/testify/require"

	"github.com/batonhq/baton/wire"
)

// An outcome answering 70,000 outbox rows has ~630 KB of ids in its header and as much again in
// its body: it must still be published once, within the server's max payload, with the counts
// of the ids it leaves out, and the relay must keep flowing (no ErrMaxPayload retried forever).
func TestHugeAnsweredOutcomeIsPublishedOnce(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := ctxT(t, 2*time.Minute)
	createConversations(t, b.db.Pool, "c")
	b.startActive(t)

	const n = 70_000
	ids := make([]int64, n)
	for i := range ids {
		ids[i] = 10_000_000 + int64(i) // 8 digits: the size the issue measured
	}
	answers, err := json.Marshal(map[string]any{"message_id": "r-huge", "outbox_ids": ids})
	require.NoError(t, err)
	tx, err := b.db.Pool.Begin(ctx)
	require.NoError(t, err)
	_, err = tx.Exec(ctx, `SELECT pg_logical_emit_message(true, $1, $2)`, wire.AnswersPrefix, string(answers))
	require.NoError(t, err)
	_, err = tx.Exec(ctx, `INSERT INTO messages (id, conversation_id, role, content) VALUES ('r-huge', 'c', 'assistant', 'done')`)
	require.NoError(t, err)
	require.NoError(t, tx.Commit(ctx))
	// The relay keeps flowing: a later turn still arrives.
	_, err = send(ctx, b.db.Pool, "c", "after")
	require.NoError(t, err)

	b.waitStream(t, "AGENT_TURNS", 1, 30*time.Second)
	requireSlotCaughtUp(t, b)
	outcomes := b.readStream(t, "AGENT_OUTCOMES")
	require.Len(t, outcomes, 1, "published once")
	m := outcomes[0]
	require.LessOrEqual(t, wireSize(m.header, m.data), int(b.nc.MaxPayload()))

	var ev wire.OutcomeEvent
	require.NoError(t, json.Unmarshal(m.data, &ev))
	require.Equal(t, "r-huge", ev.MessageID)
	require.Equal(t, "done", ev.Content, "the ids are cut, not the content")
	require.False(t, ev.ContentOmitted)
	require.Equal(t, ids[:wire.MaxBodyOutboxIDs], ev.OutboxIDs)
	require.Equal(t, n-wire.MaxBodyOutboxIDs, ev.OutboxIDsOmitted)

	head := strings.Split(m.header.Get(wire.HeaderOutboxID), ",")
	require.Len(t, head, wire.MaxHeaderOutboxIDs)
	for i, s := range head {
		require.Equal(t, strconv.FormatInt(ids[i], 10), s)
	}
	require.Equal(t, strconv.Itoa(n-wire.MaxHeaderOutboxIDs), m.header.Get(wire.HeaderOutboxIDsOmitted))
	require.Empty(t, m.header.Get(wire.HeaderContentOmitted))
}

// wireSize is the size NATS measures against max_payload: the header block as the protocol
// writes it ("NATS/1.0\r\n", one "Key: value\r\n" per value, "\r\n") plus the body.
func wireSize(h nats.Header, body []byte) int {
	n := len("NATS/1.0\r\n") + len("\r\n")
	for k, vs := range h {
		for _, v := range vs {
			n += len(k) + len(": ") + len(v) + len("\r\n")
		}
	}
	return n + len(body)
}

// Message and conversation ids that nats.go would merge (it trims header values; the "~" form
// is also a legal plain id) get distinct headers and Nats-Msg-Ids: JetStream must store every
// outcome, none dropped as a duplicate of another.
func TestOutcomeIDsNATSWouldMergeAreAllPublished(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := ctxT(t, 2*time.Minute)
	createConversations(t, b.db.Pool, "c", "c ", "~Yw")
	b.startActive(t)
	type reply struct{ conv, id string }
	replies := []reply{{"c", "r1"}, {"c", "r1 "}, {"c", " r1"}, {"c", "a\n"}, {"c", "~YQo"}, {"c ", "r2"}, {"~Yw", "r3"}}
	for _, r := range replies {
		_, err := b.db.Pool.Exec(ctx, `INSERT INTO messages (id, conversation_id, role, content) VALUES ($1, $2, 'assistant', 'hi')`,
			r.id, r.conv)
		require.NoError(t, err)
	}
	_, err := send(ctx, b.db.Pool, "c", "after")
	require.NoError(t, err)
	b.waitStream(t, "AGENT_TURNS", 1, 30*time.Second)
	requireSlotCaughtUp(t, b)

	outcomes := b.readStream(t, "AGENT_OUTCOMES")
	require.Equal(t, len(replies), len(outcomes), "every outcome stored, none taken for a duplicate")
	msgIDs, convHeaders := map[string]string{}, map[string]string{}
	want := map[string]string{} // message id → conversation
	for _, r := range replies {
		want[r.id] = r.conv
	}
	for _, m := range outcomes {
		var ev wire.OutcomeEvent
		require.NoError(t, json.Unmarshal(m.data, &ev))
		conv, ok := want[ev.MessageID]
		require.True(t, ok, "outcome of %q published twice or unexpected", ev.MessageID)
		delete(want, ev.MessageID)
		require.Equal(t, conv, ev.ConversationID)

		id := m.header.Get(nats.MsgIdHdr)
		prev, dup := msgIDs[id]
		require.False(t, dup, "messages %q and %q share Nats-Msg-Id %q", prev, ev.MessageID, id)
		msgIDs[id] = ev.MessageID
		require.Equal(t, wire.OutcomeMsgID(ev.MessageID), id)
		back, err := wire.ParseHeaderID(m.header.Get(wire.HeaderMessageID))
		require.NoError(t, err)
		require.Equal(t, ev.MessageID, back)

		convHeader := m.header.Get(wire.HeaderConversationID)
		back, err = wire.ParseHeaderID(convHeader)
		require.NoError(t, err)
		require.Equal(t, ev.ConversationID, back)
		if prev, ok := convHeaders[convHeader]; ok {
			require.Equal(t, prev, ev.ConversationID, "conversations share header %q", convHeader)
		}
		convHeaders[convHeader] = ev.ConversationID
	}
}
