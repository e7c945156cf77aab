package consumer

import (
	"context"
	"fmt"

	"github.com/jackc/pgx/v5"
)

// heldRow is a claimed row locked by the transaction that ends its run.
type heldRow struct {
	id       int64
	attempts int
}

// lockHeld runs sql, which locks claimed rows and returns their id and attempts, in tx.
func lockHeld(ctx context.Context, tx pgx.Tx, sql string, args ...any) ([]heldRow, error) {
	rows, err := tx.Query(ctx, sql, args...)
	if err != nil {
		return nil, err
	}
	return pgx.CollectRows(rows, func(row pgx.CollectableRow) (heldRow, error) {
		var h heldRow
		return h, row.Scan(&h.id, &h.attempts)
	})
}

// boundLockWaits sets lock_timeout for the rest of tx: a row another transaction holds for
// long (an operation or an outbox row an application or an operator updates and leaves open)
// fails the run's end or its recovery (55P03) instead of stalling it, and, for recovery, every
// expired run after it; the run is tried again at the next sweep.
func (s *store) boundLockWaits(ctx context.Context, tx pgx.Tx) error {
	_, err := tx.Exec(ctx, lockTimeoutSQL, s.lockTimeoutSetting())
	return err
}

// endReq ends a run that has no reply: its handler failed, the worker stopped, the run was
// lost, or its claim cannot be answered.
type endReq struct {
	conversationID, runID string
	ids                   []int64
	cause                 error // why: the handler's error, or one of this package's
	stopping              bool  // the worker is shutting down
	permanent             bool  // no attempt can succeed
	// outcome recorded for the run when no row fails visibly: "" for the rows' fate (retry or
	// released); recovery records "recovered".
	outcome string
	// traceContext is the visible failure's trace_context (see finishReq).
	traceContext string
}

// ended says what endRun did.
type ended struct {
	failed  []int64 // rows now error, answered by a visible failure
	retried []int64 // rows pending again
	result  string  // "error" when any row failed visibly, else "retry" or "released"
	reason  string  // the detail stored, redacted
}

// endRun ends a run without a reply, in one transaction that sees all of the run's rows or
// none: it locks the claimed rows, fails with errLeaseLost unless every one is still the run's,
// then applies endOfRun to each row (with the run's write operations and the row's own
// attempts) and commits together the requeued rows, the visible failure of the others (the
// error message, rows error, operations attached), the operations left running marked
// interrupted, and the run's record.
func (s *store) endRun(ctx context.Context, r endReq) (ended, error) {
	var e ended
	replyID := newReplyID("error")
	err := retryUncertain(ctx, func() error {
		return pgx.BeginFunc(ctx, s.pool, func(tx pgx.Tx) error {
			if err := s.boundLockWaits(ctx, tx); err != nil {
				return err
			}
			held, err := lockHeld(ctx, tx, lockRunSQL, r.conversationID, r.runID, r.ids)
			if err != nil {
				return err
			}
			if len(held) != len(r.ids) {
				exists, err := conversationExists(ctx, tx, r.conversationID)
				if err != nil {
					return err
				}
				if !exists {
					return errConversationGone
				}
				return errLeaseLost
			}
			e, err = s.endHeld(ctx, tx, r, held, replyID)
			return err
		})
	}, func() (bool, error) {
		var outcome *string
		err := s.pool.QueryRow(ctx, runOutcomeSQL, r.runID).Scan(&outcome)
		return outcome != nil && *outcome != "recovered", err
	})
	if err != nil && !runFailed(err) {
		return e, fmt.Errorf("end run %s: %w", r.runID, err)
	}
	return e, err
}

// endHeld is the decision and the writes of endRun and recoverRun, in tx, for rows it holds.
// endHeld is the decision and the writes of endRun and recoverRun, in tx, for rows it holds:
// planEnd decides, row by row, and endHeld writes what it decided.
func (s *store) endHeld(ctx context.Context, tx pgx.Tx, r endReq, held []heldRow, replyID string) (ended, error) {
	e := ended{reason: detail(r.cause)}
	var wrote bool
	if err := tx.QueryRow(ctx, writtenSQL, r.runID).Scan(&wrote); err != nil {
		return e, fmt.Errorf("operations of run %s: %w", r.runID, err)
	}
	interrupted := "interrupted: " + e.reason
	if r.stopping {
		interrupted = "interrupted: the worker stopped"
	}
	if _, err := tx.Exec(ctx, closeOperationsSQL, r.runID, sanitize(interrupted, maxDetailBytes)); err != nil {
		return e, fmt.Errorf("close operations of run %s: %w", r.runID, err)
	}
	p := planEnd(r, held, wrote, s.maxAttempts, s.backoff)
	e.failed, e.retried, e.result = p.failed, p.retried, p.result.String()
	if len(e.retried) > 0 {
		delays := make([]int64, len(p.delays))
		for i, d := range p.delays {
			delays[i] = d.Milliseconds()
		}
		if _, err := tx.Exec(ctx, requeueSQL, e.retried, delays, e.reason, p.refunds); err != nil {
			return e, fmt.Errorf("requeue rows of run %s: %w", r.runID, err)
		}
	}
	if len(e.failed) == 0 {
		outcome := r.outcome
		if outcome == "" {
			outcome = e.result
		}
		_, err := tx.Exec(ctx, endRunSQL, r.runID, outcome, e.reason)
		return e, err
	}
	e.reason = detail(p.cause)
	err := s.finishIn(ctx, tx, []finishReq{{conversationID: r.conversationID, runID: r.runID, ids: e.failed,
		replyID: replyID, outcome: outcome{role: "error", content: s.failureMessage(p.cause), reason: e.reason},
		traceContext: r.traceContext}})
	return e, err
}

// expiredRun is a run holding processing rows whose lease expired. runID is "" for
// processing rows that name no run (not written by Baton): recovery treats them as one dead
// run of their conversation.
type expiredRun struct{ runID, conversationID string }

// expiredRuns lists runs holding processing rows whose lease expired.
func (s *store) expiredRuns(ctx context.Context, limit int) ([]expiredRun, error) {
	rows, err := s.pool.Query(ctx, expiredRunsSQL, limit)
	if err != nil {
		return nil, fmt.Errorf("find expired leases: %w", err)
	}
	runs, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (expiredRun, error) {
		var e expiredRun
		return e, r.Scan(&e.runID, &e.conversationID)
	})
	if err != nil {
		return nil, fmt.Errorf("find expired leases: %w", err)
	}
	return runs, nil
}

// recovered says what recovery did with one dead run.
type recovered struct {
	conversationID string
	ids            []int64 // every row the run held; none when recovery left the run alone
	ended
}

// recoverRun applies the recovery rule to a run whose lease expired, in one transaction, to
// all of the run's rows or none:
//   - it takes the run's rows with FOR UPDATE SKIP LOCKED, and leaves the run alone unless it
//     got every processing row of the run, each with an expired lease: a renewal or a tool
//     check in flight holds some of them, and the run is not dead;
//   - then endOfRun decides for each row, as for a failed attempt (the cause is ErrWorkerLost):
//     a write operation in any status, or the row's attempts used up ⇒ a visible failure,
//     committed in this same transaction; otherwise the row goes back to pending, its run id
//     cleared, claimable after the backoff. No row is left processing under the dead run.
func (s *store) recoverRun(ctx context.Context, run expiredRun) (recovered, error) {
	r := recovered{conversationID: run.conversationID}
	replyID := newReplyID("error")
	err := retryUncertain(ctx, func() error {
		r.ids = nil
		return pgx.BeginFunc(ctx, s.pool, func(tx pgx.Tx) error {
			if err := s.boundLockWaits(ctx, tx); err != nil {
				return err
			}
			held, err := lockHeld(ctx, tx, lockExpiredRunSQL, run.conversationID, run.runID)
			if err != nil || len(held) == 0 {
				return err
			}
			var all int
			if err := tx.QueryRow(ctx, countRunSQL, run.conversationID, run.runID).Scan(&all); err != nil {
				return err
			}
			if all != len(held) {
				return nil // part of the run is busy or alive: not ours to take now
			}
			runID := run.runID
			if runID == "" {
				// Rows that name no run: give them one, so the rule and the fence apply.
				runID = newRunID()
				ids := make([]int64, len(held))
				for i, h := range held {
					ids[i] = h.id
				}
				if _, err := tx.Exec(ctx, assignRunSQL, ids, runID); err != nil {
					return err
				}
			}
			e, err := s.endHeld(ctx, tx, endReq{conversationID: run.conversationID, runID: runID, cause: ErrWorkerLost,
				outcome: "recovered"}, held, replyID)
			if err != nil {
				return err
			}
			for _, h := range held {
				r.ids = append(r.ids, h.id)
			}
			r.ended = e
			return nil
		})
	}, func() (bool, error) {
		if run.runID == "" {
			var left bool
			err := s.pool.QueryRow(ctx, runlessLeftSQL, run.conversationID).Scan(&left)
			return !left, err
		}
		var outcome *string
		err := s.pool.QueryRow(ctx, runOutcomeSQL, run.runID).Scan(&outcome)
		return outcome != nil, err
	})
	if err != nil {
		if runFailed(err) {
			return recovered{conversationID: run.conversationID}, nil // the conversation was deleted: nothing to recover
		}
		return recovered{conversationID: run.conversationID}, fmt.Errorf("recover run %s: %w", run.runID, err)
	}
	return r, nil
}
