package consumer

import (
	"errors"
	"fmt"
	"time"
)

// The decisions of a run's end and of a held event's fate, as pure functions: every path that
// needs one calls it here (the turn runner, endRun, recovery, the conversation loop).

// turnEnd is how a turn's handler call ended, and so what its end commits.
type turnEnd int

const (
	// turnReplied: the handler replied; the reply commits and the rows are done, even when
	// the worker is stopping.
	turnReplied turnEnd = iota
	// turnFailed: no reply; endRun decides per row (endOfRun).
	turnFailed
	// turnStopped: no reply, and the turn was cut short by the shutdown grace running out;
	// endRun decides per row, as stopping.
	turnStopped
	// turnLost: the run lost its rows (its lease); nothing commits, and whoever took the rows
	// (recovery) decides their fate, seeing the run's operations.
	turnLost
)

// endOfTurn tells how a turn ended from the handler's error herr and the cause its context
// was cancelled with (errLeaseLost, errStopping, or none). A lost lease wins over everything,
// then a reply: a handler that replied commits its reply even after the grace ran out.
func endOfTurn(herr, cause error) turnEnd {
	switch {
	case errors.Is(cause, errLeaseLost) || errors.Is(herr, errLeaseLost):
		return turnLost
	case herr == nil:
		return turnReplied
	case errors.Is(cause, errStopping):
		return turnStopped
	default:
		return turnFailed
	}
}

// runEnd is what becomes of a claimed row when its run ends without a reply.
type runEnd int

const (
	// endRetry: pending again after a backoff; the attempt counts.
	endRetry runEnd = iota
	// endRelease: pending again at once and the attempt refunded: the worker stopped, the
	// request did not fail.
	endRelease
	// endFail: a visible failure: an error message in the conversation, the row error.
	endFail
)

func (e runEnd) String() string {
	switch e {
	case endRetry:
		return "retry"
	case endRelease:
		return "released"
	default:
		return "error"
	}
}

// endOfRun decides one claimed row's fate when its run ends without a reply. wrote says the run
// has a write operation (in any status: it ran or may have run), permanent that no attempt can
// succeed, attempts the row's own claims so far, stopping that the worker is shutting down.
//
// Rules, in order: a write ⇒ a visible failure, never a replay (not even on shutdown); a
// permanent failure ⇒ a visible failure; a shutdown ⇒ released, attempt refunded; the row's
// attempts used up ⇒ a visible failure; otherwise retried after a backoff.
func endOfRun(wrote, permanent bool, attempts, maxAttempts int, stopping bool) runEnd {
	switch {
	case wrote, permanent:
		return endFail
	case stopping:
		return endRelease
	case attempts >= maxAttempts:
		return endFail
	default:
		return endRetry
	}
}

// failure is the error that a row ended as a visible failure for: its reason, wrapping the cause.
func failure(wrote, permanent bool, attempts int, cause error) error {
	switch {
	case wrote:
		return fmt.Errorf("%w: %w", ErrSideEffect, cause)
	case permanent:
		return cause
	default:
		return fmt.Errorf("%w after %d attempts: %w", ErrAttemptsExhausted, attempts, cause)
	}
}

// endPlan is what ending a run without a reply does to the rows it holds, decided row by row
// by endOfRun.
type endPlan struct {
	failed []int64 // rows that end as a visible failure
	// retried are the rows that go back to pending, each after delays[i], its attempt
	// refunded when refunds[i].
	retried []int64
	delays  []time.Duration
	refunds []bool
	// result is endFail when any row fails visibly, else what became of the retried rows
	// (endRetry or endRelease).
	result runEnd
	// cause is the failure the visible error shows and records: the first failed row's.
	cause error
}

// planEnd applies endOfRun to each held row of run r: wrote says the run has a write
// operation, maxAttempts caps each row's own attempts, and backoff gives a retried row's delay
// from its attempts (a released row is claimable at once).
func planEnd(r endReq, held []heldRow, wrote bool, maxAttempts int, backoff func(attempts int) time.Duration) endPlan {
	p := endPlan{result: endRetry}
	for _, h := range held {
		switch end := endOfRun(wrote, r.permanent, h.attempts, maxAttempts, r.stopping); end {
		case endFail:
			p.failed = append(p.failed, h.id)
			if p.cause == nil {
				p.cause = failure(wrote, r.permanent, h.attempts, r.cause)
			}
		default:
			p.retried = append(p.retried, h.id)
			var delay time.Duration
			if end == endRetry {
				delay = backoff(h.attempts)
			}
			p.delays = append(p.delays, delay)
			p.refunds = append(p.refunds, end == endRelease)
			p.result = end
		}
	}
	if len(p.failed) > 0 {
		p.result = endFail
	}
	return p
}

// Results of a turn (the outcome label of baton_worker_turns_total) besides those of its plan
// ("done", and runEnd's "retry", "released", "error").
const (
	resultCancelled    = "cancelled"     // the conversation was deleted during the turn
	resultLeaseLost    = "lease_lost"    // the run lost its rows; nothing of it committed
	resultCommitFailed = "commit_failed" // the end did not commit; recovery takes the rows
)

// afterCommit is a turn's result and the claimed rows now terminal, once its end was committed
// with err: as planned (result, terminal) when it committed; every claimed row when the
// conversation was deleted (nothing is left to answer, their events are finished with); none
// when the lease was lost or the commit failed (the rows stay processing until recovery
// takes them after the lease).
func afterCommit(result string, terminal, claimed []int64, err error) (string, []int64) {
	switch {
	case err == nil:
		return result, terminal
	case errors.Is(err, errConversationGone):
		return resultCancelled, claimed
	case errors.Is(err, errLeaseLost):
		return resultLeaseLost, nil
	default:
		return resultCommitFailed, nil
	}
}

// heldAction is what a conversation loop does with a held event after a claim.
type heldAction int

const (
	// keepEvent: hold it on; its row is claimable and the loop claims again.
	keepEvent heldAction = iota
	// ackEvent: its row is terminal (done or error) or gone.
	ackEvent
	// nakEvent: give it back, to be delivered again after the delay.
	nakEvent
)

// missingGrace is how long after it was stored an event's row may still be invisible before a
// missing row is taken as deleted.
const missingGrace = 10 * time.Second

// settleHeld decides a held event's fate after claim c, from its row's state st (status ""
// when the row is not there), when its source stored it (zero: unknown), the worker's
// Debounce and the time now. It keeps the delivery rule: an event is acked only when its row
// is terminal or gone; otherwise it is kept while its row is claimable here, or nacked with
// the delay after which it is worth looking again.
func settleHeld(st rowState, storedAt time.Time, c claim, debounce time.Duration, now time.Time) (heldAction, time.Duration) {
	switch {
	case st.status == "" && !storedAt.IsZero() && now.Sub(storedAt) < missingGrace:
		// Not visible yet: logical decoding can send a transaction a moment before other
		// sessions see its commit. A row still missing later was deleted.
		return nakEvent, 50 * time.Millisecond
	case st.status == "" || st.status == "done" || st.status == "error":
		return ackEvent, 0
	case st.status == "processing" || !c.locked || c.busy:
		// Another run holds the conversation: it will take these rows; look again later.
		return nakEvent, max(time.Second, debounce)
	case st.available.After(now):
		return nakEvent, st.available.Sub(now)
	case c.waitUntil.After(now):
		// An earlier row of the conversation backs off: this one waits its turn.
		return nakEvent, c.waitUntil.Sub(now)
	case len(c.ids) == 0:
		// Claimable yet not claimed (clocks of worker and database disagree on available_at):
		// look again shortly instead of spinning.
		return nakEvent, 100 * time.Millisecond
	default:
		return keepEvent, 0
	}
}

// debounce is how long to wait before claiming work written at since: the rest of the window
// that opened when the first message was written, so the time the event took to arrive counts.
// The wait stays within [0, window] whatever the clocks of database, server and worker say.
func debounce(window time.Duration, since, now time.Time) time.Duration {
	if since.IsZero() {
		return window
	}
	return min(max(since.Add(window).Sub(now), 0), window)
}
