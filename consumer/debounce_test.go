package consumer

import (
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

func TestDebounceCountsTheEventsWay(t *testing.T) {
	now := time.Date(2026, 1, 1, 12, 0, 0, 0, time.UTC)
	for _, c := range []struct {
		name  string
		since time.Time
		want  time.Duration
	}{
		{"unknown: the whole window", time.Time{}, 5 * time.Millisecond},
		{"written 2ms ago", now.Add(-2 * time.Millisecond), 3 * time.Millisecond},
		{"written long ago", now.Add(-time.Minute), 0},
		{"clock ahead: never more than the window", now.Add(time.Hour), 5 * time.Millisecond},
	} {
		require.Equal(t, c.want, debounce(5*time.Millisecond, c.since, now), c.name)
	}
}
