package consumer

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"sync"
	"time"

	"go.opentelemetry.io/otel/trace"
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
	// span is the turn's span (see TracerName); nil for a turn made without one.
	span trace.Span
	// mu guards ends: the ends of tool calls that returned, not yet written (see Tool).
	mu   sync.Mutex
	ends []opEnd
}

// takeEnds takes the ends of the turn's tool calls not written yet.
func (t *Turn) takeEnds() []opEnd {
	t.mu.Lock()
	defer t.mu.Unlock()
	ends := t.ends
	t.ends = nil
	return ends
}

// keepEnds keeps ends to be written with the turn's next statement.
func (t *Turn) keepEnds(ends ...opEnd) {
	t.mu.Lock()
	defer t.mu.Unlock()
	t.ends = append(t.ends, ends...)
}

// History returns the context a model needs: the conversation's user messages whose turns
// ended (answered, or failed visibly) before this turn was claimed, each followed by its reply
// or error message, in the order their turns were claimed (within a turn, in the order of its
// Messages) — the newest limit messages of those, oldest first. It never holds a message this
// turn claimed, nor one that was pending when it was claimed (a later turn answers that),
// whatever the messages' CreatedAt: that is when the sender's transaction began, which may be
// before messages sent, claimed and answered while it was open.
//
// Messages from before Baton recorded claim order (turns claimed before migration 13 or, during
// a rolling upgrade, by workers of an earlier version; messages that were never turns, such as
// an adopted history) come first, by CreatedAt, then ID.
func (t *Turn) History(ctx context.Context, limit int) ([]Message, error) {
	if len(t.Messages) == 0 {
		return nil, nil
	}
	return t.w.history(ctx, historyReq{conversationID: t.ConversationID, runID: t.RunID, limit: limit})
}

// ErrToolFailed wraps the error of a tool the turn called.
var ErrToolFailed = errors.New("tool failed")

// maxToolName bounds a tool's name as recorded.
const maxToolName = 200

// Tool runs one tool call of the turn with its effect declared. The operation is recorded
// as running (with input) and committed before fn runs. Only a run that still holds every row
// it claimed, with a live lease, may start a tool: otherwise Tool returns an error and fn does
// not run.
//
// The call's end (done with output, or error) is written with the turn's next statement: the
// next tool call's record, or the turn's end (its final commit, or whatever ends it otherwise).
// Until then the operation shows as running; finished_at is when the call ended. An output
// that cannot be stored (not encodable as JSON, or JSON that Postgres's jsonb refuses: a
// \u0000 or lone surrogate escape, a number beyond numeric's range) is left out of the record,
// whose error then says why; the call still returns it, and nothing else of the turn fails.
//
// For a Write tool, the operation's row alone means the effect may have happened, whatever
// the row's status: if fn fails (its error may come after the effect, as a timeout does), is
// cut short by shutdown, or the worker dies, the turn ends as a visible failure and is never
// replayed automatically.
//
// The call is a span, baton.tool, a child of the span in ctx or else of the turn's; fn's ctx
// carries it.
func (t *Turn) Tool(ctx context.Context, tool string, effect Effect, input any, fn func(ctx context.Context) (any, error)) (out any, err error) {
	if t.span != nil && !trace.SpanContextFromContext(ctx).IsValid() {
		ctx = trace.ContextWithSpan(ctx, t.span)
	}
	ctx, span := t.w.tracer.Start(ctx, "baton.tool")
	if span.IsRecording() {
		span.SetAttributes(attrTool.String(sanitize(tool, maxToolName)), attrEffect.String(string(effect)))
	}
	defer func() { endSpan(span, err) }()
	return t.tool(ctx, span, tool, effect, input, fn)
}

// tool is Tool inside its span.
func (t *Turn) tool(ctx context.Context, span trace.Span, tool string, effect Effect, input any, fn func(ctx context.Context) (any, error)) (any, error) {
	if effect != Read && effect != Write {
		return nil, fmt.Errorf("tool %s: effect must be read or write, not %q", tool, effect)
	}
	in, err := json.Marshal(input)
	if err != nil {
		return nil, fmt.Errorf("tool %s: encode input: %w", tool, err)
	}
	ends := t.takeEnds()
	start := t.w.clock.Now()
	opID, err := t.w.record(ctx, recordReq{runID: t.RunID, conversationID: t.ConversationID, ids: t.OutboxIDs,
		tool: sanitize(tool, maxToolName), effect: effect, input: in, ends: ends})
	if err != nil {
		// Not written when the statement failed, unless it wrote them on their own first, or
		// it failed for a lost lease (see recordOperationSQL, which writes them still).
		if !errors.Is(err, errLeaseLost) && !errors.As(err, new(endsWrittenError)) {
			t.keepEnds(ends...)
		}
		return nil, fmt.Errorf("tool %s: %w", tool, err)
	}
	t.w.m.operations.WithLabelValues(string(effect)).Inc()
	if span.IsRecording() {
		span.SetAttributes(attrOperationID.Int64(opID))
	}
	out, runErr := fn(ctx)
	end := opEnd{id: opID, took: t.w.clock.Now().Sub(start)}
	if runErr != nil {
		end.status, end.errText = "error", detail(runErr)
		t.keepEnds(end)
		return nil, fmt.Errorf("%w: %s: %w", ErrToolFailed, tool, runErr)
	}
	end.status = "done"
	if end.output, err = json.Marshal(out); err != nil {
		end.errText = sanitize("output not stored: cannot encode it as JSON: "+err.Error(), maxDetailBytes)
	}
	t.keepEnds(end)
	return out, nil
}
