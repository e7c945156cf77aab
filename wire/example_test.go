package wire_test

import (
	"encoding/json"
	"fmt"

	"github.com/nats-io/nats.go"

	"github.com/batonhq/baton/wire"
)

func ExampleTurnSubject() {
	for _, id := range []string{"conv-42", "a.b", "*", "~abc"} {
		subj, err := wire.TurnSubject("agent", id)
		if err != nil {
			fmt.Println(err)
			continue
		}
		fmt.Println(subj)
	}
	// Output:
	// agent.turns.conv-42
	// agent.turns.~YS5i
	// agent.turns.~Kg
	// agent.turns.~fmFiYw
}

func ExampleParseSubject() {
	kind, id, err := wire.ParseSubject("agent", "agent.outcomes.~YS5i")
	if err != nil {
		fmt.Println(err)
		return
	}
	fmt.Printf("%s %q\n", kind, id)
	// Output: outcomes "a.b"
}

func ExampleStreamFilter() {
	fmt.Println(wire.StreamFilter("agent", wire.KindTurns))
	// Output: agent.turns.>
}

// A service that reacts to one conversation's replies subscribes to its outcome subject, in
// the outcomes stream.
func ExampleOutcomeSubject() {
	subj, err := wire.OutcomeSubject(wire.DefaultSubjectPrefix, "support/ticket 7")
	if err != nil {
		fmt.Println(err)
		return
	}
	fmt.Println(subj)
	fmt.Println(wire.StreamName(wire.DefaultSubjectPrefix, wire.KindOutcomes))
	// Output:
	// agent.outcomes.~c3VwcG9ydC90aWNrZXQgNw
	// AGENT_OUTCOMES
}

func ExampleStreamName() {
	for _, kind := range []string{wire.KindTurns, wire.KindOutcomes, wire.KindDeadLetter} {
		fmt.Println(wire.StreamName("baton.prod", kind))
	}
	// Output:
	// BATON_PROD_TURNS
	// BATON_PROD_OUTCOMES
	// BATON_PROD_DEADLETTER
}

// Ids that are printable ASCII without spaces are their own header value; any other id is
// encoded, and ParseHeaderID gives back the exact id.
func ExampleHeaderID() {
	for _, id := range []string{"conv-42", "r1 ", "🙂"} {
		v := wire.HeaderID(id)
		back, err := wire.ParseHeaderID(v)
		if err != nil {
			fmt.Println(err)
			continue
		}
		fmt.Printf("%q -> %s -> %q\n", id, v, back)
	}
	// Output:
	// "conv-42" -> conv-42 -> "conv-42"
	// "r1 " -> ~cjEg -> "r1 "
	// "🙂" -> ~8J-Zgg -> "🙂"
}

// An outcome event as a subscriber reads it: the body is an OutcomeEvent, the headers carry
// the ids in their header form.
func ExampleOutcomeEvent() {
	msg := nats.NewMsg("agent.outcomes.conv-42")
	msg.Header.Set(nats.MsgIdHdr, wire.OutcomeMsgID("baton:reply:0a1b"))
	msg.Header.Set(wire.HeaderConversationID, wire.HeaderID("conv-42"))
	msg.Header.Set(wire.HeaderMessageID, wire.HeaderID("baton:reply:0a1b"))
	msg.Header.Set(wire.HeaderRole, "assistant")
	msg.Header.Set(wire.HeaderOutboxID, "17,18")
	msg.Data = []byte(`{"message_id":"baton:reply:0a1b","conversation_id":"conv-42","role":"assistant",` +
		`"content":"The Q3 numbers are in.","content_bytes":23,"created_at":"2026-11-30T01:02:03Z","outbox_ids":[17,18]}`)

	var ev wire.OutcomeEvent
	if err := json.Unmarshal(msg.Data, &ev); err != nil {
		fmt.Println(err)
		return
	}
	_, conv, err := wire.ParseSubject(wire.DefaultSubjectPrefix, msg.Subject)
	if err != nil {
		fmt.Println(err)
		return
	}
	id, err := wire.ParseHeaderID(msg.Header.Get(wire.HeaderMessageID))
	if err != nil {
		fmt.Println(err)
		return
	}
	fmt.Println(conv, ev.ConversationID, ev.Role, ev.MessageID == id)
	fmt.Println(msg.Header.Get(nats.MsgIdHdr))
	fmt.Printf("%q answers %v", ev.Content, ev.OutboxIDs)
	if ev.ContentOmitted {
		fmt.Print(" (content left out: read it from messages by id)")
	}
	fmt.Println()
	// Output:
	// conv-42 conv-42 assistant true
	// outcome:baton:reply:0a1b
	// "The Q3 numbers are in." answers [17 18]
}
