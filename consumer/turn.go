package consumer

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"time"
)

// Effect says what a tool call does outside the conversation.
type Effect string

const (
	// Read tools only look: replaying a turn that called them is safe.
	Read Effect = "read"
	// Write tools change something outside (send an email, charge a card): once one ran or may
	// have run, the turn is never replayed automatically.
	Write Effect = "write"
)

// Reply is what a handler returns: the assistant message committed for the turn.
type Reply struct {
	Content string
}

// Handler runs one turn. It must honour ctx: it is cancelled when the worker stops or the
// run's lease is lost. Returning an error fails the attempt (see Config.MaxAttempts).
type Handler func(ctx context.Context, t *Turn) (Reply, error)

// Message is one message of a conversation.
type Message struct {
	ID        string
	Role      string
	Content   string
	CreatedAt time.Time
}

// Turn is one claimed turn: the exact rows the claim returned, and the user messages they carry.
type Turn struct {
	ConversationID string
	RunID          string
	// OutboxIDs are the claimed rows, in order. They define the turn.
	OutboxIDs []int64
	// Messages are the claimed user messages, in the order they were sent.
	Messages []Message
	// Attempt counts claims of these rows, 1 on the first.
	Attempt int

	w *Worker
}

// History returns up to limit messages of the conversation sent before this turn's first
// message, oldest first: the context a model needs.
func (t *Turn) History(ctx context.Context, limit int) ([]Message, error) {
	if len(t.Messages) == 0 {
		return nil, nil
	}
	return t.w.store.history(ctx, t.ConversationID, t.Messages[0], limit)
}

// ErrToolFailed wraps the error of a tool the turn called.
var ErrToolFailed = errors.New("tool failed")

// maxToolName bounds a tool's name as recorded.
const maxToolName = 200

// Tool runs one tool call of the turn with its effect declared. The operation is recorded
// as running (with input) and committed before fn runs, then finished as done (with output) or
// error. Only a run that still holds every row it claimed, with a live lease, may start a
// tool: otherwise Tool returns an error and fn does not run.
//
// For a Write tool, the operation's row alone means the effect may have happened, whatever
// the row's status: if fn fails (its error may come after the effect, as a timeout does), is
// cut short by shutdown, or the worker dies, the turn ends as a visible failure and is never
// replayed automatically.
func (t *Turn) Tool(ctx context.Context, tool string, effect Effect, input any, fn func(ctx context.Context) (any, error)) (any, error) {
	if effect != Read && effect != Write {
		return nil, fmt.Errorf("tool %s: effect must be read or write, not %q", tool, effect)
	}
	in, err := json.Marshal(input)
	if err != nil {
		return nil, fmt.Errorf("tool %s: encode input: %w", tool, err)
	}
	s := t.w.store
	opID, err := s.recordOperation(ctx, t.RunID, t.ConversationID, t.OutboxIDs, sanitize(tool, maxToolName), effect, in)
	if err != nil {
		return nil, fmt.Errorf("tool %s: %w", tool, err)
	}
	t.w.m.operations.WithLabelValues(string(effect)).Inc()
	out, runErr := fn(ctx)
	// The operation's end is recorded even when ctx was cancelled meanwhile.
	rctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 10*time.Second)
	defer cancel()
	if runErr != nil {
		if err := s.finishOperation(rctx, opID, "error", nil, detail(runErr)); err != nil {
			return nil, fmt.Errorf("tool %s: record failure: %w", tool, err)
		}
		return nil, fmt.Errorf("%w: %s: %w", ErrToolFailed, tool, runErr)
	}
	outJSON, err := json.Marshal(out)
	if err != nil {
		return nil, fmt.Errorf("tool %s: encode output: %w", tool, err)
	}
	if err := s.finishOperation(rctx, opID, "done", outJSON, ""); err != nil {
		return nil, fmt.Errorf("tool %s: record result: %w", tool, err)
	}
	return out, nil
}
