package wire

import (
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

func TestDecodeOutcome(t *testing.T) {
	const body = `{"message_id":"r1","conversation_id":"support/ticket 7","role":"assistant","content":"hi","content_bytes":2}`
	subj, err := OutcomeSubject("agent", "support/ticket 7")
	require.NoError(t, err)
	for _, tt := range []struct {
		name          string
		prefix, conv  string
		subject, data string
		ok            bool
	}{
		{name: "every conversation", prefix: "agent", subject: subj, data: body, ok: true},
		{name: "the subscribed conversation", prefix: "agent", conv: "support/ticket 7", subject: subj, data: body, ok: true},
		{name: "another conversation than the subscribed", prefix: "agent", conv: "support", subject: subj, data: body},
		{name: "subject names another conversation", prefix: "agent", subject: "agent.outcomes.support", data: body},
		{name: "turn subject", prefix: "agent", subject: "agent.turns.~c3VwcG9ydC90aWNrZXQgNw", data: body},
		{name: "other prefix", prefix: "baton", subject: subj, data: body},
		{name: "non-canonical token", prefix: "agent", subject: "agent.outcomes.~YQ", data: `{"message_id":"r1","conversation_id":"a"}`},
		{name: "not JSON", prefix: "agent", subject: subj, data: `garbage`},
		{name: "JSON of another shape", prefix: "agent", subject: subj, data: `[1,2]`},
		{name: "no message id", prefix: "agent", subject: "agent.outcomes.a", data: `{"conversation_id":"a"}`},
		{name: "no conversation id", prefix: "agent", subject: "agent.outcomes.a", data: `{"message_id":"r1"}`},
	} {
		t.Run(tt.name, func(t *testing.T) {
			ev, err := decodeOutcome(tt.prefix, tt.conv, tt.subject, []byte(tt.data))
			if !tt.ok {
				require.ErrorIs(t, err, errNotOutcome)
				return
			}
			require.NoError(t, err)
			require.Equal(t, OutcomeEvent{MessageID: "r1", ConversationID: "support/ticket 7", Role: "assistant",
				Content: "hi", ContentBytes: 2}, ev)
		})
	}
}

func TestRetryDelay(t *testing.T) {
	for _, tt := range []struct {
		base, maxDelay time.Duration
		delivery       uint64
		want           time.Duration
	}{
		{time.Second, time.Minute, 0, time.Second}, // metadata unknown
		{time.Second, time.Minute, 1, time.Second},
		{time.Second, time.Minute, 2, 2 * time.Second},
		{time.Second, time.Minute, 6, 32 * time.Second},
		{time.Second, time.Minute, 7, time.Minute},
		{time.Second, time.Minute, 1 << 40, time.Minute},
		{time.Minute, time.Second, 1, time.Second}, // the cap wins over the base
	} {
		require.Equal(t, tt.want, retryDelay(tt.base, tt.maxDelay, tt.delivery), "retryDelay(%v, %v, %d)", tt.base, tt.maxDelay, tt.delivery)
	}
}

// TestRecentForgetsTheOldest: the dedupe window holds the last n ids, whatever the run's length.
func TestRecentForgetsTheOldest(t *testing.T) {
	r := newRecent(2)
	r.add("a")
	r.add("b")
	require.True(t, r.contains("a"))
	r.add("c") // forgets a, the oldest
	require.False(t, r.contains("a"))
	require.True(t, r.contains("b"))
	require.True(t, r.contains("c"))
	require.Len(t, r.set, 2)
	r.add("a")
	require.False(t, r.contains("b"))
	require.Len(t, r.set, 2)
}
