package wire_test

import (
	"context"
	"fmt"

	"github.com/nats-io/nats.go"

	"github.com/batonhq/baton/wire"
)

// A service that reacts to one conversation's replies and errors. Each outcome reaches the
// handler once, though the stream holds the first reply twice (a relay replay), and is acked
// only after the handler returned nil.
func ExampleOutcomeSubscriber() {
	url, stop := runExampleNATS() // a NATS server with JetStream, for this example
	defer stop()
	nc, err := nats.Connect(url)
	if err != nil {
		fmt.Println(err)
		return
	}
	defer nc.Close()
	publishExampleOutcomes(nc) // what the relay would have published

	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	sub, err := wire.NewOutcomeSubscriber(wire.OutcomeSubscriberConfig{
		NATS:           nc,
		Durable:        "notifier", // JetStream keeps this subscriber's position under this name
		ConversationID: "conv-42",  // leave empty for every conversation's outcomes
		Handler: func(_ context.Context, o wire.Outcome) error {
			fmt.Printf("seq=%d %s %s: %s\n", o.StreamSeq, o.Event.ConversationID, o.Event.Role, o.Event.Content)
			if o.Event.Role == "error" {
				cancel() // enough for this example: stop
			}
			return nil // done: ack it
		},
	})
	if err != nil {
		fmt.Println(err)
		return
	}
	if err := sub.Run(ctx); err != nil { // until ctx ends
		fmt.Println(err)
	}
	// Output:
	// seq=1 conv-42 assistant: The Q3 numbers are in.
	// seq=4 conv-42 error: The agent could not answer.
}
