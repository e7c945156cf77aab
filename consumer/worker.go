package consumer

import (
	"context"
	"crypto/rand"
	"errors"
	"fmt"
	mrand "math/rand/v2"
	"slices"
	"strings"
	"sync"
	"time"
	"unicode/utf8"

	"github.com/nats-io/nats.go/jetstream"
	"golang.org/x/sync/errgroup"
)

// maxBatch is how many conversations one claim or final-commit statement takes at most, and
// batchLinger how long a statement waits for more when the one before it was shared.
const (
	maxBatch    = 32
	batchLinger = 500 * time.Microsecond
)

// errStopping cancels turns still running ShutdownGrace after the worker was told to stop.
var errStopping = errors.New("worker stopping")

// Worker runs turns. Create it with New and call Run.
type Worker struct {
	cfg   Config
	store *store
	m     *metrics

	// claims and finishes share round trips between conversations (see batcher); they run
	// while Run does.
	claims   *batcher[claimReq, claim]
	finishes *batcher[finishReq, error]

	sem   chan struct{}
	mu    sync.Mutex
	convs map[string]*convState
	loops sync.WaitGroup
}

// convState is what a worker holds for one conversation: the events waiting for their rows
// to become terminal, and whether a conversation loop runs.
type convState struct {
	events []event
	active bool
}

// event is one turn event held until its row is terminal. msg is nil for the polling source.
type event struct {
	outboxID int64
	seq      uint64 // stream sequence, 0 for the polling source
	msg      jetstream.Msg
}

// New validates cfg, fills its defaults and returns a Worker.
func New(cfg Config) (*Worker, error) {
	if err := cfg.fill(); err != nil {
		return nil, err
	}
	w := &Worker{
		cfg:   cfg,
		m:     newMetrics(cfg.Registerer),
		sem:   make(chan struct{}, cfg.MaxConcurrentTurns),
		convs: map[string]*convState{},
	}
	w.store = &store{pool: cfg.Pool, lease: cfg.Lease, maxAttempts: cfg.MaxAttempts, backoff: cfg.backoff, worker: cfg.Name,
		maxRows: cfg.MaxTurnMessages, maxBytes: cfg.MaxTurnBytes, failureMessage: cfg.FailureMessage}
	return w, nil
}

// Run consumes turns until ctx ends. It recovers expired leases at start and every
// RecoveryInterval. When ctx ends it stops taking work, gives running turns ShutdownGrace to
// finish (then cancels them and releases their rows), and returns nil.
func (w *Worker) Run(ctx context.Context) error {
	w.claims = newBatcher(maxBatch, batchLinger, 30*time.Second, w.m.batchSize.WithLabelValues("claim"), w.store.claimMany)
	defer w.claims.close()
	w.finishes = newBatcher(maxBatch, batchLinger, 30*time.Second, w.m.batchSize.WithLabelValues("finish"), w.store.finishMany)
	defer w.finishes.close()
	w.recoverOnce(ctx)
	g, gctx := errgroup.WithContext(ctx)
	g.Go(func() error { return w.every(gctx, w.cfg.RecoveryInterval, w.recoverOnce) })
	if w.cfg.NATS != nil {
		g.Go(func() error { return w.consumeJetStream(gctx) })
		sweep := w.sweep(w.cfg.SweepInterval)
		g.Go(func() error {
			return w.every(gctx, w.cfg.SweepInterval, func(ctx context.Context) { sweep(ctx) })
		})
	} else {
		g.Go(func() error { return w.poll(gctx) })
	}
	err := g.Wait()
	w.loops.Wait()
	if ctx.Err() != nil {
		return nil
	}
	return err
}

func (w *Worker) every(ctx context.Context, d time.Duration, fn func(context.Context)) error {
	t := time.NewTicker(d)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return nil
		case <-t.C:
			fn(ctx)
		}
	}
}

// recoverOnce recovers every run whose lease expired.
func (w *Worker) recoverOnce(ctx context.Context) {
	runs, err := w.store.expiredRuns(ctx, 1000)
	if err != nil {
		if ctx.Err() == nil {
			w.cfg.Logger.Error("recovery", "error", err)
		}
		return
	}
	for _, run := range runs {
		r, err := w.store.recoverRun(ctx, run)
		if err != nil {
			w.cfg.Logger.Error("recovery", "run_id", run.runID, "conversation_id", run.conversationID, "error", err)
			continue
		}
		if len(r.ids) == 0 {
			continue
		}
		if len(r.failed) > 0 {
			w.m.recoveries.WithLabelValues("failed").Inc()
		}
		if len(r.retried) > 0 {
			w.m.recoveries.WithLabelValues("pending").Inc()
		}
		w.cfg.Logger.Warn("recovered an expired run", "run_id", run.runID, "conversation_id", r.conversationID,
			"failed", r.failed, "pending", r.retried, "reason", r.reason)
		if len(r.retried) > 0 {
			w.schedule(ctx, r.conversationID, nil, time.Time{})
		}
	}
}

// poll is the polling source: it looks for claimable rows every PollInterval, and again at
// once while it keeps finding a full page, so a backlog drains at the workers' pace.
func (w *Worker) poll(ctx context.Context) error {
	pass := w.sweep(0)
	for {
		full := pass(ctx)
		wait := w.cfg.PollInterval
		if full {
			wait = min(wait, 10*time.Millisecond)
		}
		if !sleep(ctx, wait) {
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
		mrand.Shuffle(len(convs), func(i, j int) { convs[i], convs[j] = convs[j], convs[i] })
		for _, c := range convs {
			w.schedule(ctx, c.conversationID, nil, c.since)
		}
		if age, err := w.store.oldestPending(ctx); err == nil {
			w.m.oldestPending.Set(age.Seconds())
		}
		return len(convs) == limit
	}
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
	go w.conversationLoop(ctx, conversationID, since)
}

// conversationLoop claims and runs turns for one conversation until nothing is left for it
// here. Only one loop per conversation runs in a worker; across workers the claim decides.
//
// Delivery rule: a held event is acked only once its row is terminal (done or error) or gone;
// until then it is kept, or nacked with a delay so JetStream redelivers it later.
func (w *Worker) conversationLoop(ctx context.Context, conv string, since time.Time) {
	defer w.loops.Done()
	log := w.cfg.Logger.With("conversation_id", conv)
	if !sleep(ctx, debounce(w.cfg.Debounce, since, time.Now())) {
		w.drop(conv)
		return
	}
	for {
		if ctx.Err() != nil {
			w.drop(conv)
			return
		}
		select {
		case w.sem <- struct{}{}:
		case <-ctx.Done():
			w.drop(conv)
			return
		}
		runID := newRunID()
		c, err := w.claims.do(ctx, claimReq{conv, runID})
		var terminal []int64
		if err == nil && len(c.ids) > 0 {
			terminal = w.runTurn(ctx, conv, runID, c)
		}
		<-w.sem
		if err != nil {
			if ctx.Err() == nil {
				log.Error("claim", "error", err)
			}
			w.settle(ctx, conv, time.Second)
			w.drop(conv)
			return
		}
		if !c.locked || c.busy {
			w.m.claimConflicts.Inc()
		}
		if !w.resolve(ctx, conv, c, terminal) {
			return
		}
	}
}

// resolve settles the held events after a claim (and its turn, if any; terminal are the rows
// the turn left terminal). It returns false when the loop should end, having marked the
// conversation idle.
func (w *Worker) resolve(ctx context.Context, conv string, c claim, terminal []int64) bool {
	w.mu.Lock()
	held := w.convs[conv].events
	w.convs[conv].events = nil
	w.mu.Unlock()

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
				w.cfg.Logger.Error("read outbox states", "conversation_id", conv, "error", err)
			}
			for _, ev := range held {
				w.nak(ev, time.Second)
			}
			held = nil
		}
		now := time.Now()
		for _, ev := range held {
			st := states[ev.outboxID]
			switch {
			case st.status == "" && young(ev, now):
				// Not visible yet: logical decoding can send a transaction a moment before
				// other sessions see its commit. A row still missing later was deleted.
				w.nak(ev, 50*time.Millisecond)
			case st.status == "" || st.status == "done" || st.status == "error":
				w.ack(ev)
			case st.status == "processing" || !c.locked || c.busy:
				// Another run holds the conversation: it will take these rows; look again later.
				w.nak(ev, max(time.Second, w.cfg.Debounce))
			case st.available.After(now):
				w.nak(ev, st.available.Sub(now))
			case c.waitUntil.After(now):
				// An earlier row of the conversation backs off: this one waits its turn.
				w.nak(ev, c.waitUntil.Sub(now))
			case len(c.ids) == 0:
				// Claimable yet not claimed (clocks of worker and database disagree on
				// available_at): look again shortly instead of spinning.
				w.nak(ev, 100*time.Millisecond)
			default:
				keep = append(keep, ev)
			}
		}
	}

	w.mu.Lock()
	defer w.mu.Unlock()
	st := w.convs[conv]
	st.events = append(keep, st.events...)
	// Go on while events wait. The polling source also looks again after a turn: rows may
	// have arrived meanwhile, and no event will say so.
	if len(st.events) > 0 || (w.cfg.NATS == nil && len(c.ids) > 0 && ctx.Err() == nil) {
		return true
	}
	st.active = false
	delete(w.convs, conv)
	return false
}

// drop releases every held event of an ending loop for redelivery and marks it idle.
func (w *Worker) drop(conv string) {
	w.mu.Lock()
	st := w.convs[conv]
	held := st.events
	st.events = nil
	st.active = false
	delete(w.convs, conv)
	w.mu.Unlock()
	for _, ev := range held {
		w.nak(ev, 0)
	}
}

// settle nacks every held event with a delay.
func (w *Worker) settle(_ context.Context, conv string, delay time.Duration) {
	w.mu.Lock()
	held := w.convs[conv].events
	w.convs[conv].events = nil
	w.mu.Unlock()
	for _, ev := range held {
		w.nak(ev, delay)
	}
}

func (w *Worker) ack(ev event) {
	if ev.msg == nil {
		return
	}
	if err := ev.msg.Ack(); err != nil {
		w.cfg.Logger.Warn("ack", "outbox_id", ev.outboxID, "error", err)
		return
	}
	w.m.events.WithLabelValues("acked").Inc()
}

func (w *Worker) nak(ev event, delay time.Duration) {
	if ev.msg == nil {
		return
	}
	var err error
	if delay > 0 {
		err = ev.msg.NakWithDelay(delay)
	} else {
		err = ev.msg.Nak()
	}
	if err != nil {
		w.cfg.Logger.Warn("nak", "outbox_id", ev.outboxID, "error", err)
		return
	}
	w.m.events.WithLabelValues("nacked").Inc()
}

// runTurn runs the handler for a claim and commits its end: a reply, a retry, or a visible
// failure. It returns the claimed rows that are now terminal (or gone).
func (w *Worker) runTurn(ctx context.Context, conv, runID string, c claim) []int64 {
	log := w.cfg.Logger.With("conversation_id", conv, "run_id", runID)
	started := time.Now()
	w.m.running.Inc()
	defer w.m.running.Dec()
	w.m.attempts.Observe(float64(c.attempts))

	// The turn outlives a stopping worker by ShutdownGrace, and ends at once if the lease is lost.
	// The lease is kept until the run's end has committed: a final commit queued behind
	// others must not find the rows recovered meanwhile.
	turnCtx, cancel := context.WithCancelCause(context.WithoutCancel(ctx))
	defer cancel(nil)
	runEnded, keeper := make(chan struct{}), make(chan struct{})
	go func() {
		defer close(keeper)
		w.keepLease(ctx, runEnded, cancel, conv, runID, c.ids)
	}()
	defer func() {
		close(runEnded)
		<-keeper
	}()

	var reply Reply
	var herr error
	switch {
	case c.oversize:
		herr = fmt.Errorf("%w (Config.MaxTurnBytes is %d)", ErrMessageTooLarge, w.cfg.MaxTurnBytes)
	case c.unreadable:
		herr = errUnreadable
	default:
		reply, herr = w.handle(turnCtx, conv, runID, c)
	}
	cancel(nil)
	cause := context.Cause(turnCtx) // fixed now: later cancels change nothing
	if errors.Is(cause, errLeaseLost) || errors.Is(herr, errLeaseLost) {
		// Recovery (or whoever took the rows) decides their fate, seeing this run's operations.
		w.m.turns.WithLabelValues("lease_lost").Inc()
		log.Warn("lease lost during the turn; its result is discarded")
		return nil
	}

	// Commits run to completion even when the worker is stopping.
	dbCtx, dbCancel := context.WithTimeout(context.WithoutCancel(ctx), 30*time.Second)
	defer dbCancel()
	var result string
	var terminal []int64
	var err error
	if herr == nil {
		result, terminal = "done", c.ids
		err = w.finish(dbCtx, finishReq{conversationID: conv, runID: runID, ids: c.ids,
			outcome: outcome{role: "assistant", content: reply.Content}})
	} else {
		// Not a reply: endOfRun decides per row, seeing every write operation of the run.
		stopping := errors.Is(cause, errStopping)
		var e ended
		e, err = w.store.endRun(dbCtx, endReq{conversationID: conv, runID: runID, ids: c.ids, cause: herr,
			stopping: stopping, permanent: c.oversize || c.unreadable})
		result, terminal = e.result, e.failed
		log.Warn("turn failed", "error", detail(herr), "attempt", c.attempts, "stopping", stopping,
			"result", result, "failed", e.failed, "pending", e.retried)
	}
	switch {
	case errors.Is(err, errConversationGone):
		result, terminal = "cancelled", c.ids
		log.Info("conversation deleted during the turn; result discarded")
	case errors.Is(err, errLeaseLost):
		result, terminal = "lease_lost", nil
		log.Warn("lease lost before the commit; result discarded")
	case err != nil:
		result, terminal = "commit_failed", nil
		log.Error("commit turn", "error", err) // rows stay processing; recovery takes them after the lease
	}
	w.m.turns.WithLabelValues(result).Inc()
	w.m.turnSeconds.Observe(time.Since(started).Seconds())
	return terminal
}

// handle calls the handler with the claimed turn.
func (w *Worker) handle(ctx context.Context, conv, runID string, c claim) (Reply, error) {
	t := &Turn{ConversationID: conv, RunID: runID, OutboxIDs: c.ids, Messages: c.messages, Attempt: c.attempts, w: w}
	reply, err := w.callHandler(ctx, t)
	if err != nil {
		return Reply{}, err
	}
	if !utf8.ValidString(reply.Content) || strings.ContainsRune(reply.Content, 0) {
		return Reply{}, errors.New("handler returned a reply that is not valid UTF-8 text")
	}
	return reply, nil
}

// callHandler turns a handler panic into an error, so one bad turn cannot kill the worker.
func (w *Worker) callHandler(ctx context.Context, t *Turn) (reply Reply, err error) {
	defer func() {
		if p := recover(); p != nil {
			err = fmt.Errorf("handler panicked: %v", p)
		}
	}()
	return w.cfg.Handler(ctx, t)
}

// finish commits the end of a run, sharing the statement with other runs ending at the same
// moment.
func (w *Worker) finish(ctx context.Context, r finishReq) error {
	runErr, err := w.finishes.do(ctx, r)
	if err != nil {
		return err
	}
	return runErr
}

// keepLease renews the run's lease every Lease/3 and marks held events in progress, until
// runEnded is closed (the run's end committed, or failed to). It cancels the turn when the
// lease is lost, and ShutdownGrace after ctx ends.
func (w *Worker) keepLease(ctx context.Context, runEnded <-chan struct{}, cancel context.CancelCauseFunc, conv, runID string, ids []int64) {
	t := time.NewTicker(w.cfg.Lease / 3)
	defer t.Stop()
	inProgress := time.NewTicker(w.cfg.AckWait / 3)
	defer inProgress.Stop()
	var grace <-chan time.Time
	stopping := ctx.Done()
	for {
		select {
		case <-runEnded:
			return
		case <-stopping:
			stopping = nil
			grace = time.After(w.cfg.ShutdownGrace)
		case <-grace:
			grace = nil
			cancel(errStopping) // the lease is still kept while the run ends
		case <-inProgress.C:
			w.mu.Lock()
			held := append([]event(nil), w.convs[conv].events...)
			w.mu.Unlock()
			for _, ev := range held {
				if ev.msg != nil {
					_ = ev.msg.InProgress()
				}
			}
		case <-t.C:
			rctx, rcancel := context.WithTimeout(context.WithoutCancel(ctx), w.cfg.Lease/3)
			ok, err := w.store.renew(rctx, conv, runID, ids)
			rcancel()
			if err != nil {
				w.cfg.Logger.Warn("renew lease", "run_id", runID, "error", err)
				continue
			}
			if !ok {
				cancel(errLeaseLost)
				return
			}
		}
	}
}

// missingGrace is how long after it was stored an event's row may still be invisible before a
// missing row is taken as deleted.
const missingGrace = 10 * time.Second

// young reports whether ev was stored in the stream less than missingGrace ago.
func young(ev event, now time.Time) bool {
	if ev.msg == nil {
		return false
	}
	md, err := ev.msg.Metadata()
	return err == nil && now.Sub(md.Timestamp) < missingGrace
}

// debounce is how long to wait before claiming work written at since: the rest of the window
// that opened when the first message was written, so the time the event took to arrive counts.
// The wait stays within [0, window] whatever the clocks of database, server and worker say.
func debounce(window time.Duration, since, now time.Time) time.Duration {
	if since.IsZero() {
		return window
	}
	return min(max(since.Add(window).Sub(now), 0), window)
}

func sleep(ctx context.Context, d time.Duration) bool {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
		return true
	case <-ctx.Done():
		return false
	}
}

// newRunID returns a random (version 4) UUID.
func newRunID() string {
	var b [16]byte
	_, _ = rand.Read(b[:])
	b[6] = b[6]&0x0f | 0x40
	b[8] = b[8]&0x3f | 0x80
	return fmt.Sprintf("%x-%x-%x-%x-%x", b[0:4], b[4:6], b[6:8], b[8:10], b[10:16])
}
