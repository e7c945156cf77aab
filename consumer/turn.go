package consumer

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
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
	rows, err := t.w.store.pool.Query(ctx, `SELECT id, role, content, created_at FROM (
			SELECT id, role, content, created_at FROM messages
			WHERE conversation_id = $1 AND (created_at, id) < ($2, $3)
			ORDER BY created_at DESC, id DESC LIMIT $4) h
		ORDER BY created_at, id`, t.ConversationID, t.Messages[0].CreatedAt, t.Messages[0].ID, limit)
	if err != nil {
		return nil, fmt.Errorf("load history of %q: %w", t.ConversationID, err)
	}
	msgs, err := pgx.CollectRows(rows, pgx.RowToStructByPos[Message])
	if err != nil {
		return nil, fmt.Errorf("load history of %q: %w", t.ConversationID, err)
	}
	return msgs, nil
}

// recordOperationSQL records a tool call as running, only while the run still holds its rows
// with a live lease. FOR SHARE makes recovery (which takes expired rows FOR UPDATE SKIP
// LOCKED) either wait until this operation is visible to it, or take the rows first, and then
// this insert finds them no longer the run's. So a run that lost its turn can never start a
// tool, and recovery never misses an operation that started: a write tool cannot run in a run
// whose turn is replayed elsewhere.
const recordOperationSQL = `
INSERT INTO operations (run_id, conversation_id, tool, effect, input)
SELECT $1, $2, $3, $4, $5
WHERE EXISTS (SELECT FROM agent_outbox
              WHERE conversation_id = $2 AND run_id = $1 AND status = 'processing' AND lease_expires_at > now()
              FOR SHARE)
RETURNING id`

// ErrToolFailed wraps the error of a tool the turn called.
var ErrToolFailed = errors.New("tool failed")

// Tool runs one tool call of the turn with its effect declared. The operation is recorded
// as running (with input) and committed before fn runs, then finished as done (with output) or
// error. A worker that dies in between leaves a running operation that recovery marks as
// interrupted; for a Write tool that turn then ends as a visible failure, never a replay.
func (t *Turn) Tool(ctx context.Context, tool string, effect Effect, input any, fn func(ctx context.Context) (any, error)) (any, error) {
	if effect != Read && effect != Write {
		return nil, fmt.Errorf("tool %s: effect must be read or write, not %q", tool, effect)
	}
	in, err := json.Marshal(input)
	if err != nil {
		return nil, fmt.Errorf("tool %s: encode input: %w", tool, err)
	}
	pool := t.w.store.pool
	var opID int64
	err = pool.QueryRow(ctx, recordOperationSQL, t.RunID, t.ConversationID, tool, string(effect), in).Scan(&opID)
	if errors.Is(err, pgx.ErrNoRows) {
		return nil, fmt.Errorf("tool %s: not run: %w", tool, errLeaseLost)
	}
	if err != nil {
		return nil, fmt.Errorf("tool %s: record operation: %w", tool, err)
	}
	t.w.m.operations.WithLabelValues(string(effect)).Inc()
	out, runErr := fn(ctx)
	// The operation's end is recorded even when ctx was cancelled meanwhile.
	rctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 10*time.Second)
	defer cancel()
	if runErr != nil {
		if _, err := pool.Exec(rctx, `UPDATE operations SET status = 'error', error = $2, finished_at = now() WHERE id = $1`,
			opID, runErr.Error()); err != nil {
			return nil, fmt.Errorf("tool %s: record failure: %w", tool, err)
		}
		return nil, fmt.Errorf("%w: %s: %w", ErrToolFailed, tool, runErr)
	}
	outJSON, err := json.Marshal(out)
	if err != nil {
		return nil, fmt.Errorf("tool %s: encode output: %w", tool, err)
	}
	if _, err := pool.Exec(rctx, `UPDATE operations SET status = 'done', output = $2, finished_at = now() WHERE id = $1`,
		opID, outJSON); err != nil {
		return nil, fmt.Errorf("tool %s: record result: %w", tool, err)
	}
	return out, nil
}
