package wire

import (
	"encoding/json"
	"reflect"
	"testing"
	"time"
	"unicode/utf8"
)

// FuzzDecodeOutcome feeds decodeOutcome arbitrary subjects and bodies, as any publisher with
// rights on the outcomes stream could send them. It must never panic, and what it accepts must
// be an outcome of the conversation its subject names, with a message id. Then, for the
// conversation and message ids in the input, an outcome built the way a worker builds one
// (OutcomeSubject, JSON body) must decode back to itself.
func FuzzDecodeOutcome(f *testing.F) {
	for _, tc := range hostileIDs {
		subject, _ := OutcomeSubject("agent", tc.id)
		body, _ := json.Marshal(OutcomeEvent{MessageID: "m-" + tc.id, ConversationID: tc.id, Role: "assistant"})
		f.Add(subject, body, tc.id, "m-"+tc.id)
	}
	f.Add("agent.outcomes.c1", []byte(`{"message_id":"m","conversation_id":"c2"}`), "c1", "m")
	f.Add("agent.turns.c1", []byte(`{"message_id":"m","conversation_id":"c1"}`), "c1", "m")
	f.Add("agent.outcomes.~YS5i", []byte(`{"message_id":"\u0000","conversation_id":"a.b"}`), "a.b", "\x00")
	f.Add("agent.outcomes.c1", []byte(`null`), "", "")
	f.Add("agent.outcomes.c1", []byte(`{"message_id":"m","conversation_id":"c1","created_at":"bad"}`), "c1", "m")
	f.Fuzz(func(t *testing.T, subject string, body []byte, conv, messageID string) {
		if ev, err := decodeOutcome("agent", "", subject, body); err == nil {
			kind, subjConv, perr := ParseSubject("agent", subject)
			if perr != nil || kind != KindOutcomes || subjConv != ev.ConversationID || ev.MessageID == "" {
				t.Fatalf("decodeOutcome accepted %q on %q: %+v (subject: %q %q %v)", body, subject, ev, kind, subjConv, perr)
			}
		}

		subject, err := OutcomeSubject("agent", conv)
		if err != nil || messageID == "" || !utf8.ValidString(conv) || !utf8.ValidString(messageID) {
			return // ids Postgres text cannot hold, or none: no worker publishes them
		}
		want := OutcomeEvent{MessageID: messageID, ConversationID: conv, Role: "assistant",
			Content: string(body), CreatedAt: time.Unix(1_700_000_000, 0).UTC(), OutboxIDs: []int64{1, 2}}
		data, err := json.Marshal(want)
		if err != nil {
			t.Fatalf("marshal %+v: %v", want, err)
		}
		var roundTrip OutcomeEvent
		if err := json.Unmarshal(data, &roundTrip); err != nil {
			t.Fatalf("unmarshal %s: %v", data, err)
		}
		got, err := decodeOutcome("agent", conv, subject, data)
		if err != nil {
			t.Fatalf("decodeOutcome(%q, %s): %v", subject, data, err)
		}
		if !reflect.DeepEqual(got, roundTrip) {
			t.Fatalf("decodeOutcome = %+v, want %+v", got, roundTrip)
		}
	})
}
