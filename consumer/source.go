package consumer

import (
	"context"
	mrand "math/rand/v2"
	"time"
)

// source tells a worker which conversations have work, and schedules them on its conversation
// loops (Worker.schedule), which run the same claim, turn and commit code whatever the source.
// Config.NATS chooses it: the JetStream source (jetStreamSource) when set, else the polling
// source (pollingSource).
type source interface {
	// run schedules conversations until ctx ends, then returns nil; or returns the error
	// that stopped it.
	run(ctx context.Context) error
	// announcesRows reports whether every new row reaches the worker as an event. Where it
	// does not, a conversation loop whose claim took rows claims again before it ends: rows
	// may have arrived meanwhile, and nothing would say so.
	announcesRows() bool
}

// newSource returns the source cfg chooses for w.
func newSource(w *Worker) source {
	if w.cfg.NATS != nil {
		return &jetStreamSource{w: w}
	}
	return &pollingSource{w: w}
}

// pollingSource claims straight from agent_outbox: it looks for claimable rows every
// PollInterval, and again at once while it keeps finding a full page, so a backlog drains at
// the workers' pace. It holds no events.
type pollingSource struct{ w *Worker }

func (s *pollingSource) announcesRows() bool { return false }

func (s *pollingSource) run(ctx context.Context) error {
	pass := s.w.sweep(0)
	for {
		full := pass(ctx)
		wait := s.w.cfg.PollInterval
		if full {
			wait = min(wait, 10*time.Millisecond)
		}
		if !sleep(ctx, s.w.clock, wait) {
			return nil
		}
	}
}

// sweep returns a pass that schedules conversations with claimable rows at least minAge old,
// oldest first, and reports whether it found a full page. The page is shuffled before it is
// scheduled, so workers polling the same backlog start on different conversations instead of
// colliding on the same claim locks.
func (w *Worker) sweep(minAge time.Duration) func(context.Context) bool {
	return func(ctx context.Context) bool {
		limit := 4 * w.cfg.MaxConcurrentTurns
		convs, err := w.store.pendingConversations(ctx, minAge, limit)
		if err != nil {
			if ctx.Err() == nil {
				w.cfg.Logger.Error("sweep", "error", err)
			}
			return false
		}
		// Spreading conversations over workers needs no secrecy.
		mrand.Shuffle(len(convs), func(i, j int) { convs[i], convs[j] = convs[j], convs[i] }) //nolint:gosec // G404, see above
		for _, c := range convs {
			w.schedule(ctx, c.conversationID, nil, c.since)
		}
		if age, err := w.store.oldestPending(ctx); err == nil {
			w.m.oldestPending.Set(age.Seconds())
		}
		return len(convs) == limit
	}
}

// every calls fn every d until ctx ends.
func (w *Worker) every(ctx context.Context, d time.Duration, fn func(context.Context)) error {
	tick, stop := w.clock.NewTicker(d)
	defer stop()
	for {
		select {
		case <-ctx.Done():
			return nil
		case <-tick:
			fn(ctx)
		}
	}
}
