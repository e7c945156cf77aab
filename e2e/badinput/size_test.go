package badinput

import (
	"encoding/json"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/batonhq/baton/consumer"
	"github.com/batonhq/baton/producer"
	"github.com/batonhq/baton/wire"
)

// TestTenMiBMessage sends a 10 MiB user message. With the producer's default limit (1 MiB)
// Send refuses it before writing anything. A producer configured for more accepts it; the
// turn event carries ids only, so the relay's event stays small, and the worker reads the
// content from Postgres: 10 MiB is over the worker's MaxTurnBytes (8 MiB), so the request
// ends as a visible error in the conversation without a handler call, and the conversation's
// next message is answered. A 6 MiB message fits a turn: its 6 MiB echo is committed and its
// outcome event is published without content, flagged (over NATS's 1 MiB max payload).
func TestTenMiBMessage(t *testing.T) {
	t.Parallel()
	s := start(t, options{maxContentBytes: 16 << 20, watchTurns: true})
	ctx := ctxFor(t, 2*time.Minute)
	s.conversation("big")
	tenMiB := filled(10 << 20)

	// The default producer: a clear error, nothing written.
	def, err := producer.New(producer.Config{})
	require.NoError(t, err)
	_, err = def.Send(ctx, s.app, producer.Message{ConversationID: "big", ID: "refused", Content: tenMiB})
	require.ErrorIs(t, err, producer.ErrContentTooLarge)
	var ie *producer.InputError
	require.True(t, errors.As(err, &ie))
	require.Equal(t, "Content", ie.Field)
	require.Zero(t, s.count(`SELECT count(*)::int FROM messages WHERE id = 'refused'`))

	// A producer allowing 16 MiB: accepted, then a visible failure, and the next message of the
	// same conversation is answered.
	s.send("big", "ten-mib", tenMiB)
	s.send("big", "after-big", "and a small one")
	a := s.awaitAnswer("ten-mib", time.Minute)
	require.Equal(t, "error", a.status, "%+v", a.lastError)
	require.Equal(t, "error", a.role)
	require.Equal(t, consumer.DefaultFailureMessage(nil), a.reply, "the user sees the generic failure text")
	require.Contains(t, a.lastError, "MaxTurnBytes", "the operator sees why")
	next := s.awaitAnswer("after-big", time.Minute)
	require.Equal(t, "done", next.status)
	require.Equal(t, "echo: and a small one", next.reply)

	// 6 MiB fits a turn: the echo is committed whole; its outcome goes out without content.
	s.conversation("six")
	six := filled(6 << 20)
	s.send("six", "six-mib", six)
	a6 := s.awaitAnswer("six-mib", time.Minute)
	require.Equal(t, "done", a6.status, a6.lastError)
	require.Equal(t, "echo: "+six, a6.reply)
	ev, raw := s.awaitOutcome(a6.replyID, time.Minute)
	require.True(t, ev.ContentOmitted)
	require.Empty(t, ev.Content)
	require.Equal(t, len(a6.reply), ev.ContentBytes)
	require.Equal(t, "true", raw.Header.Get(wire.HeaderContentOmitted))

	// Turn events never carry content: every one the relay published is small.
	turns := s.publishedTurns()
	require.NotEmpty(t, turns)
	for _, m := range turns {
		require.Less(t, len(m.Data), 1024, "turn event %s", m.Data)
		var ev wire.TurnEvent
		require.NoError(t, json.Unmarshal(m.Data, &ev))
		require.NotContains(t, string(m.Data), "abcdefghij")
	}
	s.requireFlowing("after-large")
	s.requireAllAnswered(time.Minute)
	requireNoErrorLogs(t, s.relay)
	// The worker logs the failed turn; nothing else.
	for _, l := range s.worker.LogLines() {
		if strings.Contains(l, `"level":"ERROR"`) {
			require.Contains(t, l, "MaxTurnBytes", "worker error log")
		}
	}
}
