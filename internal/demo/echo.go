package demo

import (
	"context"
	"strings"
	"time"

	"github.com/batonhq/baton/consumer"
)

// Echo is the turn handler the demo's workers run, the echo agent of examples/echoagent: a
// model call that echoes the claimed messages, after a read tool (lookup) recorded as an
// operation.
type Echo struct {
	// Latency is how long each model call takes. Default 0.
	Latency time.Duration
	// Fail, when set, returns the error a turn of a conversation fails with once its lookup
	// ran (Demo.TurnFailure), or nil. Default nil: no turn fails.
	Fail func(conversationID string) error
}

// Handle is a consumer.Handler.
func (e *Echo) Handle(ctx context.Context, t *consumer.Turn) (consumer.Reply, error) {
	if e.Latency > 0 {
		timer := time.NewTimer(e.Latency)
		select {
		case <-timer.C:
		case <-ctx.Done():
			timer.Stop()
			return consumer.Reply{}, ctx.Err()
		}
	}
	parts := make([]string, len(t.Messages))
	for i, m := range t.Messages {
		parts[i] = m.Content
	}
	// A read tool only looks, so a turn that called it may be replayed after a failure.
	if _, err := t.Tool(ctx, "lookup", consumer.Read, map[string]string{"conversation_id": t.ConversationID},
		func(ctx context.Context) (any, error) {
			history, err := t.History(ctx, 100)
			if err != nil {
				return nil, err
			}
			return map[string]int{"history_messages": len(history)}, nil
		}); err != nil {
		return consumer.Reply{}, err
	}
	if e.Fail != nil {
		if err := e.Fail(t.ConversationID); err != nil {
			return consumer.Reply{}, err
		}
	}
	return consumer.Reply{Content: "echo: " + strings.Join(parts, " | ")}, nil
}
