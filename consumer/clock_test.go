package consumer

import (
	"context"
	"io"
	"log/slog"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// fakeClock is a clock that moves only when a test advances it.
type fakeClock struct {
	mu      sync.Mutex
	now     time.Time
	waiters []*fakeWaiter
}

type fakeWaiter struct {
	at      time.Time
	every   time.Duration // 0 for a timer
	c       chan time.Time
	stopped bool
}

func newFakeClock() *fakeClock {
	return &fakeClock{now: time.Date(2026, 1, 1, 12, 0, 0, 0, time.UTC)}
}

func (f *fakeClock) Now() time.Time {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.now
}

func (f *fakeClock) add(d, every time.Duration) *fakeWaiter {
	f.mu.Lock()
	defer f.mu.Unlock()
	w := &fakeWaiter{at: f.now.Add(d), every: every, c: make(chan time.Time, 1)}
	f.waiters = append(f.waiters, w)
	return w
}

func (f *fakeClock) stop(w *fakeWaiter) bool {
	f.mu.Lock()
	defer f.mu.Unlock()
	was := !w.stopped
	w.stopped = true
	return was
}

func (f *fakeClock) NewTimer(d time.Duration) (<-chan time.Time, func() bool) {
	w := f.add(d, 0)
	return w.c, func() bool { return f.stop(w) }
}

func (f *fakeClock) NewTicker(d time.Duration) (<-chan time.Time, func()) {
	w := f.add(d, d)
	return w.c, func() { f.stop(w) }
}

// advance moves the clock by d and fires what fell due, as package time does: a channel that
// already holds a tick drops the next one.
func (f *fakeClock) advance(d time.Duration) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.now = f.now.Add(d)
	for _, w := range f.waiters {
		for !w.stopped && !w.at.After(f.now) {
			select {
			case w.c <- w.at:
			default:
			}
			if w.every == 0 {
				w.stopped = true
			} else {
				w.at = w.at.Add(w.every)
			}
		}
	}
}

// waitWaiters waits until n timers and tickers are live.
func (f *fakeClock) waitWaiters(t *testing.T, n int) {
	t.Helper()
	require.Eventually(t, func() bool {
		f.mu.Lock()
		defer f.mu.Unlock()
		live := 0
		for _, w := range f.waiters {
			if !w.stopped {
				live++
			}
		}
		return live == n
	}, 10*time.Second, time.Millisecond)
}

// countingDelivery counts how often an event was marked in progress.
type countingDelivery struct {
	noDelivery
	inProgresses *atomic.Int32
}

func (d countingDelivery) inProgress() error {
	d.inProgresses.Add(1)
	return nil
}

// leaseKeeper runs keepLease for a run of conversation "c" holding one event, on a fake clock,
// with a lease too long to come up for renewal. It returns the clock, the turn's context, the
// function that ends the run, and the count of in-progress marks of the held event.
func leaseKeeper(t *testing.T, workerCtx context.Context) (*fakeClock, context.Context, func(), *atomic.Int32) {
	t.Helper()
	clk := newFakeClock()
	marks := new(atomic.Int32)
	w := &Worker{
		cfg: Config{Lease: time.Hour, AckWait: 30 * time.Second, ShutdownGrace: 10 * time.Second,
			Logger: slog.New(slog.NewTextHandler(io.Discard, nil))},
		clock: clk,
		convs: map[string]*convState{"c": {active: true, events: []event{{outboxID: 1, d: countingDelivery{inProgresses: marks}}}}},
	}
	turnCtx, cancel := context.WithCancelCause(context.Background())
	runEnded, done := make(chan struct{}), make(chan struct{})
	go func() {
		defer close(done)
		w.keepLease(workerCtx, runEnded, cancel, "c", "run", []int64{1})
	}()
	var once sync.Once
	end := func() {
		once.Do(func() {
			close(runEnded)
			<-done
			cancel(nil)
		})
	}
	t.Cleanup(end)
	return clk, turnCtx, end, marks
}

// A stopping worker gives a running turn exactly ShutdownGrace, by its clock, before it cancels
// the turn with errStopping; the keeper stops every timer when the run ends.
func TestShutdownGraceIsCountedOnTheClock(t *testing.T) {
	workerCtx, stop := context.WithCancel(context.Background())
	clk, turnCtx, end, _ := leaseKeeper(t, workerCtx)
	clk.waitWaiters(t, 2) // the renewal and in-progress tickers

	stop()
	clk.waitWaiters(t, 3) // and now the grace timer
	clk.advance(10*time.Second - time.Nanosecond)
	require.NoError(t, turnCtx.Err(), "cancelled before the grace ran out")
	clk.advance(time.Nanosecond)
	select {
	case <-turnCtx.Done():
	case <-time.After(10 * time.Second):
		t.Fatal("the turn was not cancelled when the grace ran out")
	}
	require.ErrorIs(t, context.Cause(turnCtx), errStopping)

	end()
	clk.waitWaiters(t, 0)
}

// While a turn runs, the events held for its conversation are marked in progress every
// AckWait/3, so that JetStream does not redeliver them.
func TestHeldEventsAreMarkedInProgress(t *testing.T) {
	clk, turnCtx, _, marks := leaseKeeper(t, context.Background())
	clk.waitWaiters(t, 2)
	clk.advance(9 * time.Second)
	require.Zero(t, marks.Load())
	clk.advance(time.Second)
	require.Eventually(t, func() bool { return marks.Load() == 1 }, 10*time.Second, time.Millisecond)
	clk.advance(10 * time.Second)
	require.Eventually(t, func() bool { return marks.Load() == 2 }, 10*time.Second, time.Millisecond)
	require.NoError(t, turnCtx.Err())
}
