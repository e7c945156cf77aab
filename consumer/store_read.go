package consumer

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
)

// recordOperation records a tool call of run as running and returns its id, or errLeaseLost
// when the run no longer holds its turn.
func (s *store) recordOperation(ctx context.Context, runID, conversationID string, ids []int64, tool string, effect Effect, input []byte) (int64, error) {
	var id int64
	err := s.pool.QueryRow(ctx, recordOperationSQL, runID, conversationID, tool, string(effect), input, ids).Scan(&id)
	switch {
	case errors.Is(err, pgx.ErrNoRows):
		return 0, fmt.Errorf("not run: %w", errLeaseLost)
	case err != nil:
		return 0, fmt.Errorf("record operation: %w", err)
	}
	return id, nil
}

// finishOperation records the end of operation id: done with its output, or error.
func (s *store) finishOperation(ctx context.Context, id int64, status string, output []byte, errText string) error {
	_, err := s.pool.Exec(ctx, finishOperationSQL, id, status, output, errText)
	return err
}

// history returns up to limit messages of conversation sent before first, oldest first.
func (s *store) history(ctx context.Context, conversationID string, first Message, limit int) ([]Message, error) {
	rows, err := s.pool.Query(ctx, historySQL, conversationID, first.CreatedAt, first.ID, limit)
	if err != nil {
		return nil, fmt.Errorf("load history of %q: %w", conversationID, err)
	}
	msgs, err := pgx.CollectRows(rows, pgx.RowToStructByPos[Message])
	if err != nil {
		return nil, fmt.Errorf("load history of %q: %w", conversationID, err)
	}
	return msgs, nil
}

// pendingConversation is a conversation with claimable rows, since its oldest was written.
type pendingConversation struct {
	conversationID string
	since          time.Time
}

// pendingConversations lists up to limit conversations whose oldest pending row is claimable
// (not backing off) and at least minAge old, oldest first. Busy conversations (a run holds
// rows of theirs) are left out: their claims would find nothing, and a page full of them
// would hide every other conversation from the polling source.
func (s *store) pendingConversations(ctx context.Context, minAge time.Duration, limit int) ([]pendingConversation, error) {
	rows, err := s.pool.Query(ctx, pendingConversationsSQL, minAge.Milliseconds(), limit)
	if err != nil {
		return nil, fmt.Errorf("look for pending rows: %w", err)
	}
	convs, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (pendingConversation, error) {
		var p pendingConversation
		return p, r.Scan(&p.conversationID, &p.since)
	})
	if err != nil {
		return nil, fmt.Errorf("look for pending rows: %w", err)
	}
	return convs, nil
}

// oldestPending is the age of the oldest pending row (0 when none).
func (s *store) oldestPending(ctx context.Context) (time.Duration, error) {
	var age float64
	err := s.pool.QueryRow(ctx, oldestPendingSQL).Scan(&age)
	return time.Duration(age * float64(time.Second)), err
}

// rowState is the status of one outbox row, for resolving held events.
type rowState struct {
	status    string // "" when the row no longer exists
	available time.Time
}

// states reads the status and available_at of the outbox rows ids; a row missing from the map
// no longer exists (or is not visible yet).
func (s *store) states(ctx context.Context, ids []int64) (map[int64]rowState, error) {
	rows, err := s.pool.Query(ctx, statesSQL, ids)
	if err != nil {
		return nil, fmt.Errorf("outbox states: %w", err)
	}
	defer rows.Close()
	out := make(map[int64]rowState, len(ids))
	for rows.Next() {
		var id int64
		var st rowState
		if err := rows.Scan(&id, &st.status, &st.available); err != nil {
			return nil, fmt.Errorf("outbox states: %w", err)
		}
		out[id] = st
	}
	return out, rows.Err()
}
