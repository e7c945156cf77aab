package consumer

import (
	"context"
	"log/slog"
	"slices"
	"time"
)

// convState is what a worker holds for one conversation: the events waiting for their rows
// to become terminal, and whether a conversation loop runs.
type convState struct {
	events []event
	active bool
}

// schedule hands an event (or, with ev nil, a hint that rows may be pending) to the
// conversation's loop, starting one if none runs. since is when the work was written (zero:
// unknown); a new loop claims Debounce after it.
func (w *Worker) schedule(ctx context.Context, conversationID string, ev *event, since time.Time) {
	w.mu.Lock()
	defer w.mu.Unlock()
	st := w.convs[conversationID]
	if st == nil {
		st = &convState{}
		w.convs[conversationID] = st
	}
	if ev != nil {
		// A redelivery of a stream message already held replaces it: the newest delivery is
		// the one JetStream expects an ack for. Other messages for the same row (a replay past
		// the duplicate window) are held and acked on their own.
		if i := slices.IndexFunc(st.events, func(h event) bool { return ev.seq != 0 && h.seq == ev.seq }); i >= 0 {
			st.events[i] = *ev
		} else {
			st.events = append(st.events, *ev)
		}
	}
	if st.active {
		return
	}
	if ctx.Err() != nil {
		return
	}
	st.active = true
	w.loops.Add(1)
	l := &convLoop{w: w, conv: conversationID}
	go l.run(ctx, since)
}

// takeHeld takes the events held for conv out of its state.
func (w *Worker) takeHeld(conv string) []event {
	w.mu.Lock()
	defer w.mu.Unlock()
	held := w.convs[conv].events
	w.convs[conv].events = nil
	return held
}

// heldEvents returns a copy of the events held for conv.
func (w *Worker) heldEvents(conv string) []event {
	w.mu.Lock()
	defer w.mu.Unlock()
	return append([]event(nil), w.convs[conv].events...)
}

// ack tells ev's source that its row is terminal or gone.
func (w *Worker) ack(ev event) {
	if err := ev.d.ack(); err != nil {
		w.cfg.Logger.Warn("ack", "outbox_id", ev.outboxID, "error", err)
	}
}

// nak gives ev back to its source, to be delivered again after delay.
func (w *Worker) nak(ev event, delay time.Duration) {
	if err := ev.d.nak(delay); err != nil {
		w.cfg.Logger.Warn("nak", "outbox_id", ev.outboxID, "error", err)
	}
}

// convLoop claims and runs turns for one conversation until nothing is left for it here, and
// settles the events held for it. Only one loop per conversation runs in a worker (schedule
// starts it); across workers the claim decides.
//
// Delivery rule: a held event is acked only once its row is terminal (done or error) or gone;
// until then it is kept, or nacked with a delay so its source delivers it again later
// (settleHeld decides).
type convLoop struct {
	w    *Worker
	conv string
	log  *slog.Logger
}

// run is the loop: it waits out the debounce of work written at since, then claims, runs the
// turn the claim returned, settles the held events, and claims again while events wait.
func (l *convLoop) run(ctx context.Context, since time.Time) {
	w := l.w
	defer w.loops.Done()
	l.log = w.cfg.Logger.With("conversation_id", l.conv)
	if !sleep(ctx, w.clock, debounce(w.cfg.Debounce, since, w.clock.Now())) {
		l.drop()
		return
	}
	for {
		if ctx.Err() != nil {
			l.drop()
			return
		}
		select {
		case w.sem <- struct{}{}:
		case <-ctx.Done():
			l.drop()
			return
		}
		claimed := time.Now() // span timestamps are wall time, whatever the worker's clock
		c, err := w.claims.do(ctx, claimReq{l.conv, newRunID()})
		var terminal []int64
		if err == nil && len(c.ids) > 0 {
			terminal = w.runTurn(ctx, l.conv, c.runID, c, claimed) // c.runID: claimMany may claim again under a new run
		}
		<-w.sem
		if err != nil {
			if ctx.Err() == nil {
				l.log.Error("claim", "error", err)
			}
			l.settle(time.Second)
			l.drop()
			return
		}
		if !c.locked || c.busy {
			w.m.claimConflicts.Inc()
		}
		if !l.resolve(ctx, c, terminal) {
			return
		}
	}
}

// resolve settles the held events after a claim (and its turn, if any; terminal are the rows
// the turn left terminal). It returns false when the loop should end, having marked the
// conversation idle.
func (l *convLoop) resolve(ctx context.Context, c claim, terminal []int64) bool {
	w := l.w
	held := w.takeHeld(l.conv)
	if len(terminal) > 0 {
		// The rows the turn just ended are terminal: ack their events without a query.
		rest := held[:0]
		for _, ev := range held {
			if slices.Contains(terminal, ev.outboxID) {
				w.ack(ev)
			} else {
				rest = append(rest, ev)
			}
		}
		held = rest
	}
	var keep []event
	if len(held) > 0 {
		ids := make([]int64, len(held))
		for i, ev := range held {
			ids[i] = ev.outboxID
		}
		states, err := w.store.states(ctx, ids)
		if err != nil {
			if ctx.Err() == nil {
				l.log.Error("read outbox states", "error", err)
			}
			for _, ev := range held {
				w.nak(ev, time.Second)
			}
			held = nil
		}
		now := w.clock.Now()
		for _, ev := range held {
			switch action, delay := settleHeld(states[ev.outboxID], ev.d.storedAt(), c, w.cfg.Debounce, now); action {
			case ackEvent:
				w.ack(ev)
			case nakEvent:
				w.nak(ev, delay)
			default:
				keep = append(keep, ev)
			}
		}
	}

	w.mu.Lock()
	defer w.mu.Unlock()
	st := w.convs[l.conv]
	st.events = append(keep, st.events...)
	// Go on while events wait. A source that does not announce every row also looks again
	// after a turn: rows may have arrived meanwhile, and no event will say so.
	if len(st.events) > 0 || (!w.src.announcesRows() && len(c.ids) > 0 && ctx.Err() == nil) {
		return true
	}
	st.active = false
	delete(w.convs, l.conv)
	return false
}

// drop gives every held event of an ending loop back for redelivery and marks the
// conversation idle.
func (l *convLoop) drop() {
	w := l.w
	w.mu.Lock()
	st := w.convs[l.conv]
	held := st.events
	st.events = nil
	st.active = false
	delete(w.convs, l.conv)
	w.mu.Unlock()
	for _, ev := range held {
		w.nak(ev, 0)
	}
}

// settle gives every held event back, to be delivered again after delay.
func (l *convLoop) settle(delay time.Duration) {
	for _, ev := range l.w.takeHeld(l.conv) {
		l.w.nak(ev, delay)
	}
}
