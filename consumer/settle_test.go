package consumer

import (
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// The delivery rule, step by step: an event is acked only when its row is terminal or gone,
// kept while its row is claimable here, and otherwise nacked for as long as looking again is
// pointless.
func TestSettleHeld(t *testing.T) {
	now := time.Date(2026, 1, 1, 12, 0, 0, 0, time.UTC)
	const debounce = 5 * time.Millisecond
	claimed := claim{locked: true, ids: []int64{1}}
	for _, tc := range []struct {
		name      string
		st        rowState
		storedAt  time.Time
		c         claim
		want      heldAction
		wantDelay time.Duration
	}{
		{name: "row not visible yet", storedAt: now.Add(-time.Second), c: claimed, want: nakEvent, wantDelay: 50 * time.Millisecond},
		{name: "row missing long after the event: deleted", storedAt: now.Add(-missingGrace), c: claimed, want: ackEvent},
		{name: "row missing, age unknown (no delivery)", storedAt: noDelivery{}.storedAt(), c: claimed, want: ackEvent},
		{name: "done", st: rowState{status: "done"}, c: claimed, want: ackEvent},
		{name: "error", st: rowState{status: "error"}, c: claimed, want: ackEvent},
		{name: "processing under another run", st: rowState{status: "processing"}, c: claimed, want: nakEvent, wantDelay: time.Second},
		{name: "conversation locked by another worker", st: rowState{status: "pending"}, c: claim{}, want: nakEvent, wantDelay: time.Second},
		{name: "conversation busy", st: rowState{status: "pending"}, c: claim{locked: true, busy: true}, want: nakEvent, wantDelay: time.Second},
		{name: "row backs off", st: rowState{status: "pending", available: now.Add(3 * time.Second)}, c: claimed,
			want: nakEvent, wantDelay: 3 * time.Second},
		{name: "an earlier row backs off", st: rowState{status: "pending", available: now.Add(-time.Second)},
			c: claim{locked: true, waitUntil: now.Add(2 * time.Second)}, want: nakEvent, wantDelay: 2 * time.Second},
		{name: "claimable, yet nothing claimed", st: rowState{status: "pending", available: now}, c: claim{locked: true},
			want: nakEvent, wantDelay: 100 * time.Millisecond},
		{name: "claimable: kept for the next claim", st: rowState{status: "pending", available: now}, c: claimed, want: keepEvent},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got, delay := settleHeld(tc.st, tc.storedAt, tc.c, debounce, now)
			require.Equal(t, tc.want, got)
			require.Equal(t, tc.wantDelay, delay)
		})
	}
	// A debounce longer than the retry delay of a busy conversation stretches it.
	_, delay := settleHeld(rowState{status: "processing"}, time.Time{}, claimed, 3*time.Second, now)
	require.Equal(t, 3*time.Second, delay)
}
