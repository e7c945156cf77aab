package consumer

import (
	"fmt"
	"time"
)

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

// missingGrace is how long after it was stored an event's row may still be invisible before a
// missing row is taken as deleted.
const missingGrace = 10 * time.Second

// debounce is how long to wait before claiming work written at since: the rest of the window
// that opened when the first message was written, so the time the event took to arrive counts.
// The wait stays within [0, window] whatever the clocks of database, server and worker say.
func debounce(window time.Duration, since, now time.Time) time.Duration {
	if since.IsZero() {
		return window
	}
	return min(max(since.Add(window).Sub(now), 0), window)
}
