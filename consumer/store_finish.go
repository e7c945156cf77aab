package consumer

import (
	"context"
	"crypto/rand"
	"encoding/json"
	"errors"
	"fmt"
	"sync"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/batonhq/baton/wire"
)

// outcome is how a run ends in one transaction: a reply (role assistant, rows done) or a
// visible failure (role error, rows error).
type outcome struct {
	role    string // "assistant" or "error"
	content string
	reason  string // last_error for failures
}

// finishReq is the end of one run: a reply (role assistant, rows done) or a visible failure
// (role error, rows error).
type finishReq struct {
	conversationID string
	runID          string
	ids            []int64
	outcome
	// replyID names the message that ends the run; empty: a new one is made (newReplyID).
	replyID string
	// ends are the ends of the run's tool calls not written yet.
	ends []opEnd
	// traceContext is the message's trace_context: the traceparent of the run's turn span, ""
	// for none (NULL).
	traceContext string
}

// status is what the run's rows become.
func (r finishReq) status() string {
	if r.role == "error" {
		return "error"
	}
	return "done"
}

// replyIDPrefix starts the id of every message a worker writes (replies and visible errors):
// producer.ReservedIDPrefix, which the producer refuses in client message ids. The rest of the
// id is 128 random bits, so a reply can never collide with a client's message, nor be guessed.
const replyIDPrefix = "baton:"

// newReplyID returns a fresh id for a message of role that ends a run.
func newReplyID(role string) string {
	var b [16]byte
	_, _ = rand.Read(b[:])
	kind := "reply"
	if role == "error" {
		kind = "error"
	}
	return fmt.Sprintf("%s%s:%x", replyIDPrefix, kind, b)
}

// finishOne commits the end of run r in one transaction: the logical message naming the
// answered rows, the reply or error message, the run's operations attached to it, the claimed
// rows terminal, the conversation's metadata and the run's record. It fails with errLeaseLost
// when any claimed row is no longer this run's, and with errConversationGone when the
// conversation was deleted; either way nothing is written. A lost connection or another
// transient error is retried (see finishRetrying). When Postgres refuses a value of an end it
// carries (see refused), the ends are written on their own (endOperations) and the run is
// committed again without them: one tool call's output never costs the turn its reply.
func (s *store) finishOne(ctx context.Context, r finishReq) error {
	err := s.finishRetrying(ctx, []finishReq{r})
	if len(r.ends) > 0 && refused(err) && s.endOperations(ctx, r.ends) == nil {
		r.ends = nil
		err = s.finishRetrying(ctx, []finishReq{r})
	}
	if errors.Is(err, errLeaseLost) {
		if exists, qerr := conversationExists(ctx, s.pool, r.conversationID); qerr == nil && !exists {
			return errConversationGone
		}
	}
	if err != nil && !runFailed(err) {
		return fmt.Errorf("finish run %s: %w", r.runID, err)
	}
	return err
}

// finishMany ends several runs (of distinct conversations) in one statement and returns each
// one's error (see finishOne). When the shared statement fails for any reason but a transient
// one (which it retries), the runs are finished one by one, so that a run whose commit fails
// for a reason of its own (its lease, its conversation, a value Postgres refuses) fails alone
// and the others still commit.
func (s *store) finishMany(ctx context.Context, reqs []finishReq) ([]error, error) {
	errs := make([]error, len(reqs))
	if len(reqs) == 1 {
		errs[0] = s.finishOne(ctx, reqs[0])
		return errs, nil
	}
	err := s.finishRetrying(ctx, reqs)
	if err == nil {
		return errs, nil
	}
	if ctx.Err() != nil {
		return nil, fmt.Errorf("finish %d runs: %w", len(reqs), err)
	}
	// Apart, and several at a time: a run whose conversation row another transaction holds
	// waits out its lock_timeout without holding up the others.
	apart(len(reqs), func(i int) { errs[i] = s.finishOne(ctx, reqs[i]) })
	return errs, nil
}

// isolateConcurrency is how many requests of a failed shared statement (final commits, tool
// records) are redone at once.
const isolateConcurrency = 8

// apart runs do(i) for each of n requests, isolateConcurrency at a time, and returns when all
// returned: a failed shared statement's requests redone one by one.
func apart(n int, do func(i int)) {
	var wg sync.WaitGroup
	sem := make(chan struct{}, isolateConcurrency)
	for i := range n {
		sem <- struct{}{}
		wg.Go(func() {
			defer func() { <-sem }()
			do(i)
		})
	}
	wg.Wait()
}

// runFailed reports whether err is about one run of a final commit rather than the commit.
func runFailed(err error) bool {
	return errors.Is(err, errConversationGone) || errors.Is(err, errLeaseLost)
}

// finishRetrying runs finishSQL for reqs, retrying transient failures (see
// retryUncertain). A final commit whose outcome is unknown (the connection was lost while it
// ran, perhaps after it committed) is not simply repeated: the repeat would find the rows no
// longer processing and report a lost lease. It first asks whether the runs' replies exist —
// reply ids are unique per run, so they exist only if this commit happened.
func (s *store) finishRetrying(ctx context.Context, reqs []finishReq) error {
	replies := make([]string, len(reqs))
	for i := range reqs {
		if reqs[i].replyID == "" {
			reqs[i].replyID = newReplyID(reqs[i].role)
		}
		replies[i] = reqs[i].replyID
	}
	return retryUncertain(ctx, func() error { return s.finishIn(ctx, s.pool, reqs) }, func() (bool, error) {
		var n int
		err := s.pool.QueryRow(ctx, repliesExistSQL, replies).Scan(&n)
		return n > 0, err
	})
}

// conversationExists tells a deleted conversation from a lost lease, on q (a pool or a
// transaction).
func conversationExists(ctx context.Context, q interface {
	QueryRow(context.Context, string, ...any) pgx.Row
}, id string) (bool, error) {
	var exists bool
	err := q.QueryRow(ctx, conversationExistsSQL, id).Scan(&exists)
	return exists, err
}

// batchSender is a pool or a transaction.
type batchSender interface {
	SendBatch(ctx context.Context, b *pgx.Batch) pgx.BatchResults
}

// finishIn runs finishSQL for reqs on q (the pool, or a transaction of the caller's): all
// commit, or none. A deleted conversation fails it with errConversationGone, a run that no
// longer owns its rows with errLeaseLost. Texts Baton makes (reasons, visible errors) are
// sanitized; a reply's content is the handler's, checked before.
func (s *store) finishIn(ctx context.Context, q batchSender, reqs []finishReq) error {
	n := len(reqs)
	convs, runs, statuses, replies := make([]string, n), make([]string, n), make([]string, n), make([]string, n)
	roles, contents, reasons, answers := make([]string, n), make([]string, n), make([]*string, n), make([]string, n)
	traces := make([]*string, n)
	counts := make([]int32, n)
	var ids []int64
	var ends []opEnd
	var endRuns, endReplies []string // the run and the reply of each end
	for i, r := range reqs {
		if r.replyID == "" {
			r.replyID = newReplyID(r.role)
		}
		convs[i], runs[i], statuses[i], replies[i] = r.conversationID, r.runID, r.status(), r.replyID
		roles[i], contents[i] = r.role, r.content
		if r.role == "error" {
			contents[i] = sanitize(r.content, maxDetailBytes)
		}
		if r.reason != "" {
			reason := sanitize(r.reason, maxDetailBytes)
			reasons[i] = &reason
		}
		a, _ := json.Marshal(struct {
			MessageID string  `json:"message_id"`
			OutboxIDs []int64 `json:"outbox_ids"`
		}{replies[i], r.ids})
		answers[i] = string(a)
		if r.traceContext != "" {
			traces[i] = &r.traceContext
		}
		ids = append(ids, r.ids...)
		ends = append(ends, r.ends...)
		for range r.ends {
			endRuns, endReplies = append(endRuns, r.runID), append(endReplies, replies[i])
		}
		counts[i] = int32(len(r.ids)) //nolint:gosec // G115: a run holds at most MaxTurnMessages rows
	}
	endIDs, endStatuses, outputs, errs, took := opEnds(ends)
	batch := &pgx.Batch{}
	batch.Queue(genericPlansSQL, s.lockTimeoutSetting())
	batch.Queue(finishSQL, convs, runs, statuses, replies, roles, contents, reasons, answers, ids, wire.AnswersPrefix, counts, traces,
		endIDs, endStatuses, outputs, errs, took, endRuns, endReplies)
	err := q.SendBatch(ctx, batch).Close()
	var pgErr *pgconn.PgError
	switch {
	case errors.As(err, &pgErr) && pgErr.Code == "23503": // foreign_key_violation
		return errConversationGone
	case errors.As(err, &pgErr) && pgErr.Code == "BT001": // baton_fence
		return errLeaseLost
	}
	return err
}

// transient reports whether err may go away when the same statement is tried again: the
// connection could not be made, failed or was lost, or Postgres answered with a serialization
