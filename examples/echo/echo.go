// Package echo is the echo agent of Baton's examples: a consumer.Handler with a deterministic
// "model" that echoes the turn's messages, one read tool and an optional write tool. It stands
// in for a real agent wherever one is needed to see Baton work (examples/echoagent, the demo),
// and shows the shape of a turn: model call, tool calls through Turn.Tool, reply.
//
// Agent.Hook lets a program act at named points of a turn (Points), to fail or hold it there.
package echo

import (
	"context"
	"strings"
	"time"

	"github.com/batonhq/baton/consumer"
)

// The points of a turn at which Agent calls its Hook, in the order a turn reaches them.
const (
	// PointModel is before the model call.
	PointModel = "model"
	// PointAfterRead is after the read tool (lookup) returned.
	PointAfterRead = "after-read"
	// PointDuringWrite is inside the write tool (notify), before it reports success: the
	// effect may or may not have happened. Only with Agent.WriteTool.
	PointDuringWrite = "during-write"
	// PointAfterWrite is after the write tool returned. Only with Agent.WriteTool.
	PointAfterWrite = "after-write"
	// PointBeforeCommit is after every tool, before the reply is returned for the final commit.
	PointBeforeCommit = "before-commit"
)

// Points lists the hook points in the order a turn reaches them.
var Points = []string{PointModel, PointAfterRead, PointDuringWrite, PointAfterWrite, PointBeforeCommit}

// Agent is the echo agent. Its zero value answers at once, with the read tool only.
type Agent struct {
	// Latency is how long each model call takes. Default 0.
	Latency time.Duration
	// WriteTool makes every turn call the side-effecting notify tool after the read tool:
	// once it ran, a lost or failed turn ends as a visible error instead of a replay.
	// Default false.
	WriteTool bool
	// Hook, when set, is called at each point of Points a turn reaches. An error it returns
	// ends the turn with that error (inside the write tool: the tool call fails). Default nil.
	Hook func(ctx context.Context, point string, t *consumer.Turn) error
}

// Handle runs one turn: the model call, the read tool lookup, the write tool notify when
// WriteTool is set, then the reply "echo: " and the turn's messages joined by " | ". It is a
// consumer.Handler.
func (a *Agent) Handle(ctx context.Context, t *consumer.Turn) (consumer.Reply, error) {
	reply, err := a.model(ctx, t)
	if err != nil {
		return consumer.Reply{}, err
	}
	// Tools go through t.Tool, which records each call before it runs. A read tool only looks,
	// so a turn that called it may be replayed.
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
	if err := a.hook(ctx, PointAfterRead, t); err != nil {
		return consumer.Reply{}, err
	}
	// A write tool changes the world (an email, a payment): once it ran, a lost or failed turn
	// ends as a visible error instead of a replay.
	if a.WriteTool {
		if _, err := t.Tool(ctx, "notify", consumer.Write, map[string]string{"text": reply},
			func(ctx context.Context) (any, error) {
				if err := a.hook(ctx, PointDuringWrite, t); err != nil {
					return nil, err // failed mid-call: it may or may not have been sent
				}
				return map[string]bool{"sent": true}, nil // a real tool would call out here
			}); err != nil {
			return consumer.Reply{}, err
		}
		if err := a.hook(ctx, PointAfterWrite, t); err != nil {
			return consumer.Reply{}, err
		}
	}
	if err := a.hook(ctx, PointBeforeCommit, t); err != nil {
		return consumer.Reply{}, err
	}
	return consumer.Reply{Content: reply}, nil
}

// model stands in for an LLM call: it takes Latency and echoes the turn's messages.
func (a *Agent) model(ctx context.Context, t *consumer.Turn) (string, error) {
	if err := a.hook(ctx, PointModel, t); err != nil {
		return "", err
	}
	if a.Latency > 0 {
		timer := time.NewTimer(a.Latency)
		defer timer.Stop()
		select {
		case <-timer.C:
		case <-ctx.Done():
			return "", ctx.Err()
		}
	}
	return Reply(t.Messages), nil
}

func (a *Agent) hook(ctx context.Context, point string, t *consumer.Turn) error {
	if a.Hook == nil {
		return nil
	}
	return a.Hook(ctx, point, t)
}

// Reply is the echo of messages: "echo: " followed by their contents joined by " | ".
func Reply(messages []consumer.Message) string {
	parts := make([]string, len(messages))
	for i, m := range messages {
		parts[i] = m.Content
	}
	return "echo: " + strings.Join(parts, " | ")
}
