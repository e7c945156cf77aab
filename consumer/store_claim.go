package consumer

import (
	"context"
	"encoding/json"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
)

// claimReq asks to claim a conversation for a new run.
type claimReq struct {
	conversationID string
	runID          string
}

// claim is what one claim returned.
type claim struct {
	// runID is the run the claim is for: the request's, or a new one when claimMany claimed the
	// conversation again after a shared claim failed (the turn runs under this one).
	runID    string
	locked   bool // this worker held the conversation's lock for the claim
	busy     bool // a run of another worker holds the conversation
	ids      []int64
	attempts int       // the highest attempt number among the claimed rows
	messages []Message // the claimed user messages, in id order
	// oversize: the claim holds one message larger than maxBytes, without its content.
	oversize bool
	// unreadable: the claimed messages could not be decoded; the run ends as a visible
	// failure without a handler call.
	unreadable bool
	// waitUntil: nothing was claimed because the conversation's oldest pending row backs off
	// until then.
	waitUntil time.Time
	// traces are the claimed rows' stored trace contexts, in id order, NULLs left out: what
	// their writers stored, unchecked (see turnParent).
	traces []string
}

// claimMany claims several conversations, each for its own run, in one round trip: for each,
// an ordered, capped prefix of its pending rows (see claimSQL), unless another run holds the
// conversation. The returned ids define the turn, run under the returned run id. The
// conversations must be distinct.
//
// The statements go in one pipelined batch, which Postgres runs as one implicit transaction:
// the locks are held until the claim commits, and the claim statement still gets a snapshot of
// its own, taken after the locks. When a shared claim fails, each conversation is claimed on
// its own, so one conversation's trouble never stops another's claims.
func (s *store) claimMany(ctx context.Context, reqs []claimReq) ([]claim, error) {
	out, err := s.claimAll(ctx, reqs)
	if err == nil {
		return out, nil
	}
	s.unclaim(ctx, reqs) // in case it committed and only the answer was lost
	if len(reqs) == 1 {
		return nil, fmt.Errorf("claim conversation %q: %w", reqs[0].conversationID, err)
	}
	if ctx.Err() != nil {
		return nil, fmt.Errorf("claim %d conversations: %w", len(reqs), err)
	}
	// A claim has no effect outside its transaction, so claiming apart is always safe. Each
	// conversation is claimed under a new run id: the shared claim may have committed, and a
	// run whose claim was handed back keeps its ended record (unclaimSQL), so its id cannot
	// claim again. A conversation whose own claim fails comes back unlocked: its events wait
	// and retry.
	out = make([]claim, len(reqs))
	for i := range reqs {
		one := []claimReq{{conversationID: reqs[i].conversationID, runID: newRunID()}}
		got, err := s.claimAll(ctx, one)
		if err != nil {
			s.unclaim(ctx, one)
			out[i].runID = one[0].runID
			continue
		}
		out[i] = got[0]
	}
	return out, nil
}

// lostClaimReason is the error recorded on the run of a claim that was handed back.
const lostClaimReason = "handed back: the claim's answer was lost before any handler saw it"

// unclaim undoes whatever a claim whose answer was lost (the connection failed, or the
// deadline passed, after it committed) did for reqs' runs: their rows go back to pending with
// the attempt refunded, and their run records end as released (no handler ever saw them). It
// runs on a context of its own, since the claim's may have ended, and tries again after
// transient failures for up to 5 seconds (it is idempotent). A hand back that fails is logged
// and counted (lost_claims_total{result="failed"}): the rows, if the claim committed, wait until
// their lease ends and recovery takes them.
func (s *store) unclaim(ctx context.Context, reqs []claimReq) {
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 5*time.Second)
	defer cancel()
	runs := make([]string, len(reqs))
	convs := make([]string, len(reqs))
	for i, r := range reqs {
		runs[i], convs[i] = r.runID, r.conversationID
	}
	var released int64
	err := retryUncertain(ctx, func() error {
		return s.pool.QueryRow(ctx, unclaimSQL, runs, convs, lostClaimReason).Scan(&released)
	}, func() (bool, error) { return false, nil }) // idempotent: after an unknown outcome, run it again
	switch {
	case err != nil:
		s.countLostClaims("failed", len(reqs))
		if s.log != nil {
			s.log.Error("hand back a claim whose answer was lost: its rows, if it committed, wait for their lease to end",
				"run_ids", runs, "conversation_ids", convs, "error", err)
		}
	case released > 0:
		s.countLostClaims("handed_back", int(released))
	}
}

// countLostClaims counts n runs of lost claims by result.
func (s *store) countLostClaims(result string, n int) {
	if s.lostClaims != nil {
		s.lostClaims.WithLabelValues(result).Add(float64(n))
	}
}

// claimAll runs the claim of reqs as one transaction.
func (s *store) claimAll(ctx context.Context, reqs []claimReq) ([]claim, error) {
	convs := make([]string, len(reqs))
	runs := make([]string, len(reqs))
	for i, r := range reqs {
		convs[i], runs[i] = r.conversationID, r.runID
	}
	batch := &pgx.Batch{}
	batch.Queue(genericPlansSQL, s.lockTimeoutSetting())
	batch.Queue(lockConversationsSQL, convs)
	batch.Queue(claimSQL, convs, runs, s.lease.Milliseconds(), s.worker, s.maxRows, s.maxBytes)
	br := s.pool.SendBatch(ctx, batch)
	byConv := make(map[string]claim, len(reqs))
	_, err := br.Exec()
	if err == nil {
		_, err = br.Exec() // held by a concurrent claimer, or deleted: the claim takes nothing there
	}
	if err == nil {
		var rows pgx.Rows
		rows, err = br.Query()
		if err == nil {
			for rows.Next() {
				var conv string
				var c claim
				var raw []byte
				var wait *time.Time
				if err = rows.Scan(&conv, &c.locked, &c.busy, &c.ids, &c.attempts, &raw, &c.oversize, &wait, &c.traces); err != nil {
					break
				}
				// The claim has committed: a conversation whose messages cannot be decoded
				// still comes back with its rows, to be ended, and the others are unaffected.
				if len(raw) > 0 && json.Unmarshal(raw, &c.messages) != nil {
					c.messages, c.unreadable = nil, true
				}
				if wait != nil {
					c.waitUntil = *wait
				}
				byConv[conv] = c
			}
			rows.Close()
			if err == nil {
				err = rows.Err()
			}
		}
	}
	if cerr := br.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		return nil, err
	}
	out := make([]claim, len(reqs))
	for i, r := range reqs {
		out[i] = byConv[r.conversationID]
		out[i].runID = r.runID
	}
	return out, nil
}

// renew extends the lease of run's rows; false means the run lost them, all or some
// (recovered or reclaimed), and must stop.
func (s *store) renew(ctx context.Context, conversationID, runID string, ids []int64) (bool, error) {
	tag, err := s.pool.Exec(ctx, renewSQL, conversationID, runID, ids, s.lease.Milliseconds())
	if err != nil {
		return false, fmt.Errorf("renew lease of run %s: %w", runID, err)
	}
	return tag.RowsAffected() == int64(len(ids)), nil
}
