package consumer

import (
	"context"
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

func TestEndOfTurn(t *testing.T) {
	handlerErr := errors.New("model unavailable")
	for _, tc := range []struct {
		name        string
		herr, cause error
		want        turnEnd
	}{
		{name: "reply", want: turnReplied},
		{name: "reply, context cancelled after it", cause: context.Canceled, want: turnReplied},
		{name: "reply after the grace ran out", cause: errStopping, want: turnReplied},
		{name: "reply after the lease was lost", cause: errLeaseLost, want: turnLost},
		{name: "handler error", herr: handlerErr, cause: context.Canceled, want: turnFailed},
		{name: "handler error, grace ran out", herr: handlerErr, cause: errStopping, want: turnStopped},
		{name: "handler error, lease lost", herr: handlerErr, cause: errLeaseLost, want: turnLost},
		{name: "a tool refused: lease lost", herr: fmt.Errorf("tool x: %w", errLeaseLost), cause: context.Canceled, want: turnLost},
	} {
		t.Run(tc.name, func(t *testing.T) {
			require.Equal(t, tc.want, endOfTurn(tc.herr, tc.cause))
		})
	}
}

func TestPlanEnd(t *testing.T) {
	const maxAttempts = 3
	cause := errors.New("model unavailable")
	backoff := func(attempts int) time.Duration { return time.Duration(attempts) * time.Second }
	rows := func(attempts ...int) []heldRow {
		out := make([]heldRow, len(attempts))
		for i, a := range attempts {
			out[i] = heldRow{id: int64(i + 1), attempts: a}
		}
		return out
	}
	for _, tc := range []struct {
		name      string
		held      []heldRow
		wrote     bool
		stopping  bool
		permanent bool
		want      endPlan
		wantCause error // the failure the visible error wraps (nil: none fails)
	}{
		{name: "every row retried after its own backoff", held: rows(1, 2),
			want: endPlan{retried: []int64{1, 2}, delays: []time.Duration{time.Second, 2 * time.Second}, refunds: []bool{false, false}, result: endRetry}},
		{name: "shutdown releases at once, attempts refunded", held: rows(1, 3), stopping: true,
			want: endPlan{retried: []int64{1, 2}, delays: []time.Duration{0, 0}, refunds: []bool{true, true}, result: endRelease}},
		{name: "attempts are per row: only the exhausted row fails", held: rows(3, 1),
			want:      endPlan{failed: []int64{1}, retried: []int64{2}, delays: []time.Duration{time.Second}, refunds: []bool{false}, result: endFail},
			wantCause: ErrAttemptsExhausted},
		{name: "a write fails every row", held: rows(1, 1), wrote: true,
			want: endPlan{failed: []int64{1, 2}, result: endFail}, wantCause: ErrSideEffect},
		{name: "a write fails every row, even on shutdown", held: rows(1), wrote: true, stopping: true,
			want: endPlan{failed: []int64{1}, result: endFail}, wantCause: ErrSideEffect},
		{name: "permanent", held: rows(1), permanent: true,
			want: endPlan{failed: []int64{1}, result: endFail}, wantCause: cause},
	} {
		t.Run(tc.name, func(t *testing.T) {
			r := endReq{cause: cause, stopping: tc.stopping, permanent: tc.permanent}
			got := planEnd(r, tc.held, tc.wrote, maxAttempts, backoff)
			if tc.wantCause == nil {
				require.NoError(t, got.cause)
			} else {
				require.ErrorIs(t, got.cause, tc.wantCause)
				require.ErrorIs(t, got.cause, cause)
			}
			got.cause = nil
			require.Equal(t, tc.want, got)
		})
	}
}

func TestAfterCommit(t *testing.T) {
	claimed := []int64{1, 2}
	for _, tc := range []struct {
		name         string
		result       string
		terminal     []int64
		err          error
		wantResult   string
		wantTerminal []int64
	}{
		{name: "reply committed", result: "done", terminal: claimed, wantResult: "done", wantTerminal: claimed},
		{name: "retry committed", result: "retry", wantResult: "retry"},
		{name: "part failed visibly", result: "error", terminal: []int64{1}, wantResult: "error", wantTerminal: []int64{1}},
		{name: "conversation deleted", result: "done", terminal: claimed, err: fmt.Errorf("x: %w", errConversationGone),
			wantResult: resultCancelled, wantTerminal: claimed},
		{name: "conversation deleted before a retry", result: "retry", err: errConversationGone,
			wantResult: resultCancelled, wantTerminal: claimed},
		{name: "lease lost", result: "done", terminal: claimed, err: errLeaseLost, wantResult: resultLeaseLost},
		{name: "commit failed", result: "done", terminal: claimed, err: errors.New("connection refused"), wantResult: resultCommitFailed},
	} {
		t.Run(tc.name, func(t *testing.T) {
			result, terminal := afterCommit(tc.result, tc.terminal, claimed, tc.err)
			require.Equal(t, tc.wantResult, result)
			require.Equal(t, tc.wantTerminal, terminal)
		})
	}
}
