package wire_test

import (
	"encoding/json"
	"testing"

	"github.com/nats-io/nats.go"
	"github.com/stretchr/testify/require"

	"github.com/batonhq/baton/wire"
)

// An outcome's valid traceparent header reaches the handler; an invalid one does not.
func TestOutcomeSubscriberPassesTheTraceparent(t *testing.T) {
	t.Parallel()
	b := setupSub(t, false)
	var last uint64
	for id, tp := range map[string]string{"traced": validTraceparent, "hostile": "00-" + validTraceparent[3:54] + "\r\nx", "none": ""} {
		subj, err := wire.OutcomeSubject(b.prefix, "c")
		require.NoError(t, err)
		body, err := json.Marshal(wire.OutcomeEvent{MessageID: id, ConversationID: "c", Role: "assistant"})
		require.NoError(t, err)
		msg := nats.NewMsg(subj)
		msg.Header.Set(nats.MsgIdHdr, wire.OutcomeMsgID(id))
		if tp != "" {
			msg.Header[wire.HeaderTraceparent] = []string{tp}
		}
		msg.Data = body
		ack, err := b.js.PublishMsg(b.ctx(), msg)
		require.NoError(t, err)
		last = max(last, ack.Sequence)
	}
	r := newRecorder(nil)
	b.run(b.config("trace", r))
	b.waitAcked("trace", last)
	r.mu.Lock()
	defer r.mu.Unlock()
	got := map[string]string{}
	for _, c := range r.calls {
		got[c.Event.MessageID] = c.Traceparent
	}
	require.Equal(t, map[string]string{"traced": validTraceparent, "hostile": "", "none": ""}, got)
}
