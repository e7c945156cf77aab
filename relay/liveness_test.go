package relay

import (
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

func TestSilenceBound(t *testing.T) {
	for _, tc := range []struct{ interval, want time.Duration }{
		{100 * time.Millisecond, 10 * time.Second},
		{time.Second, 10 * time.Second},
		{5 * time.Second, 15 * time.Second},
	} {
		require.Equal(t, tc.want, silenceBound(tc.interval, 10*time.Second), "interval %v", tc.interval)
	}
}

// The bound runs from the oldest request still unanswered, not from the latest one: a relay
// that keeps asking does not keep a dead stream alive.
func TestLivenessCountsFromTheOldestUnansweredRequest(t *testing.T) {
	t0 := time.Unix(1000, 0)
	l := liveness{bound: 10 * time.Second}
	dead, _ := l.dead(t0.Add(time.Hour))
	require.False(t, dead, "no request sent: silence is no signal")

	for i := range 12 {
		l.requested(t0.Add(time.Duration(i) * time.Second))
	}
	dead, _ = l.dead(t0.Add(10 * time.Second))
	require.False(t, dead, "exactly the bound is still alive")
	dead, waited := l.dead(t0.Add(11 * time.Second))
	require.True(t, dead)
	require.Equal(t, 11*time.Second, waited)

	l.heard()
	dead, _ = l.dead(t0.Add(time.Minute))
	require.False(t, dead, "any CopyData answers every earlier request")
	l.requested(t0.Add(time.Minute))
	dead, _ = l.dead(t0.Add(time.Minute + 5*time.Second))
	require.False(t, dead)
	dead, _ = l.dead(t0.Add(time.Minute + 11*time.Second))
	require.True(t, dead)
}
