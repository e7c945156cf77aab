package consumer

import (
	"errors"
	"strings"
	"unicode/utf8"

	"github.com/batonhq/baton/internal/config"
)

// Why a turn ended as a visible failure. The error a Config.FailureMessage receives wraps one
// of these (and, where there is one, the handler's error), so it can choose its words.
var (
	// ErrSideEffect: a Write tool ran or may have run, so the turn is not replayed
	// automatically, whatever else happened.
	ErrSideEffect = errors.New("a side-effecting tool call ran or may have run; not retried automatically")
	// ErrAttemptsExhausted: the request's attempts reached Config.MaxAttempts.
	ErrAttemptsExhausted = errors.New("attempts exhausted")
	// ErrWorkerLost: the worker running the turn went away (crashed, was killed, or stalled past
	// its lease).
	ErrWorkerLost = errors.New("the worker running the turn was lost")
	// ErrMessageTooLarge: a single message is larger than Config.MaxTurnBytes, so no turn can
	// carry it.
	ErrMessageTooLarge = errors.New("message larger than a turn may carry")
)

// errUnreadable: the claimed messages could not be decoded (a value no Go type holds), so no
// handler can be given the turn.
var errUnreadable = errors.New("the turn's messages could not be read")

// DefaultFailureMessage is what a user sees of a failed request unless Config.FailureMessage
// says otherwise. It carries nothing of the error: details go to the outbox row's last_error,
// the run's record and the logs, never to the conversation.
func DefaultFailureMessage(error) string {
	return "Sorry, this request could not be completed."
}

// errLeaseLost is returned when a run's rows are no longer its own at commit.
var errLeaseLost = errors.New("lease lost: the run's rows were recovered or reclaimed")

// errConversationGone is returned when the conversation was deleted during the turn.
var errConversationGone = errors.New("conversation deleted during the turn")

// errStopping cancels turns still running ShutdownGrace after the worker was told to stop.
var errStopping = errors.New("worker stopping")

// maxDetailBytes bounds the error detail stored in last_error, agent_runs.error and
// operations.error.
const maxDetailBytes = 4 << 10

// detail is err's text as Baton stores and logs it: secrets masked, valid UTF-8, no NUL bytes,
// at most maxDetailBytes.
func detail(err error) string {
	if err == nil {
		return ""
	}
	s := err.Error()
	// Only the first maxDetailBytes are kept; redact a little more than that, so a secret
	// across the cut is still seen whole, and never spend long on a huge error text.
	if len(s) > 2*maxDetailBytes {
		s = s[:2*maxDetailBytes]
	}
	return sanitize(config.RedactText(s), maxDetailBytes)
}

// sanitize makes s storable as Postgres text: invalid UTF-8 becomes U+FFFD, NUL bytes are
// dropped, and it is cut to at most limit bytes on a rune boundary, marked with "…".
func sanitize(s string, limit int) string {
	s = strings.ToValidUTF8(s, "\uFFFD")
	s = strings.ReplaceAll(s, "\x00", "")
	if len(s) <= limit {
		return s
	}
	const more = "…"
	cut := limit - len(more)
	for cut > 0 && !utf8.RuneStart(s[cut]) {
		cut--
	}
	return s[:cut] + more
}
