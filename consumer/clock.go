package consumer

import (
	"context"
	"time"
)

// clock is where a worker reads the time and waits wherever time decides what it does: the
// debounce before a claim, the renewals of a turn's lease and the in-progress marks of its
// events, the shutdown grace, the age of a held event, the sources' intervals. Real time by
// default (realClock); tests step a clock of their own.
type clock interface {
	Now() time.Time
	// NewTimer returns a channel that receives once, d from now, and the function that stops
	// it.
	NewTimer(d time.Duration) (<-chan time.Time, func() bool)
	// NewTicker returns a channel that receives every d, and the function that stops it.
	NewTicker(d time.Duration) (<-chan time.Time, func())
}

// realClock is the clock of package time.
type realClock struct{}

func (realClock) Now() time.Time { return time.Now() }

func (realClock) NewTimer(d time.Duration) (<-chan time.Time, func() bool) {
	t := time.NewTimer(d)
	return t.C, t.Stop
}

func (realClock) NewTicker(d time.Duration) (<-chan time.Time, func()) {
	t := time.NewTicker(d)
	return t.C, t.Stop
}

// sleep waits d on c and reports true, or false as soon as ctx ends.
func sleep(ctx context.Context, c clock, d time.Duration) bool {
	ch, stop := c.NewTimer(d)
	defer stop()
	select {
	case <-ch:
		return true
	case <-ctx.Done():
		return false
	}
}
