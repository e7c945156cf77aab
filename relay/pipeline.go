package relay

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pglogrepl"
	"github.com/nats-io/nats.go"
)

// pipeline publishes events to JetStream asynchronously (see publisher) and computes the LSN
// that is safe to confirm to Postgres.
//
// Its state is guarded by mu and changed only by add (the reader, in stream order) and reply
// (nats.go's goroutine, one PubAck at a time): the goroutine that frees an event queues it for
// publishing, and the sender (sendLoop) publishes the queue in order. The sender is the only
// goroutine that calls into nats.go to publish: PublishMsg can block for as long as the
// connection's FlusherTimeout (a minute by default) when the server stops reading, holding
// nats.go's connection lock, and nothing else may wait on that — not the reader and its
// status updates to Postgres, not the ack-timeout check, not shutdown. run owns the
// lifecycle: the sender, the ack timeout, a graceful drain, and the end of the pipeline.
//
// Delivery rules kept here:
//   - Per-subject order: an event is published only after every earlier event on its subject has
//     a PubAck. A failed or lost publish (an error reply, "no responders", or no reply within
//     AckTimeout) therefore can never be overtaken by a later event of the
//     same conversation; the session ends and replays from the confirmed LSN, where JetStream's
//     Nats-Msg-Id deduplication drops what was already stored. Different conversations are
//     pipelined, up to MaxInFlight events.
//   - Confirmation: the confirmed LSN is the end LSN of the newest transaction that, with every
//     transaction before it, has a PubAck for each of its events. A keepalive's WAL end is
//     confirmed only when it arrives outside a transaction with nothing before it unacknowledged.
//   - Behind an unacknowledged event, a run of finished transactions with no event waiting for
//     a PubAck (a neighbour's transactions, which reach the relay as BEGIN and COMMIT alone) and
//     keepalive positions is kept as one entry with the newest end (see mergeLast): they are
//     confirmed together anyway, so the order of confirmation is unchanged, and the pipeline's
//     memory grows with the transactions that have events in flight, not with the others.
//   - Events of a transaction are published as they arrive, before its commit: the transaction
//     is confirmed only after its commit, and a replay republishes them under the same ids.
//   - A dead-letter record (a change no retry can publish, set aside by the decoder) is an
//     event like the others: its transaction is confirmed only after the record's PubAck, so
//     a change is never skipped without its record in the dead-letter stream. A failure to
//     publish the record is retried like any other.
//   - With batched publishing (see batch.go) events are published without the per-subject
//     wait: each stream's events go out as one ordered batch that the server stores without a
//     gap or not at all past a failure, which keeps per-subject order by itself.
//   - Once the pipeline failed or stopped, nothing more is published or confirmed.
//   - An event waits for its PubAck from the moment the sender hands it to nats.go: a send
//     stuck in a full socket ends the session after AckTimeout like a lost reply does, and
//     events queued behind it are not timed.
type pipeline struct {
	open       openSender // how the sender reaches JetStream
	send       sendFunc   // what open returned: set and called by the sender only
	maxPending int
	lowWater   int // room is signalled when outstanding events drop to this
	maxBytes   int // and outstanding bytes (see eventSize) to maxBytes,
	lowBytes   int // and to this
	ackTimeout time.Duration
	m          *metrics
	batched    bool // the streams take fast-ingest batches (see batch.go)
	// alwaysBatches publishes every event in batches when batched, never event by event: the
	// pipeline's behaviour before it learnt to switch (see publishMode), kept for tests.
	alwaysBatches bool
	batchEnter    int // outstanding events at which event by event gives way to batches

	room   chan struct{} // cap 1: add refused an event, and outstanding dropped to the low water marks
	kick   chan struct{} // cap 1: out is not empty
	failed chan struct{} // closed with the first error (err)
	idle   chan struct{} // closed when the input ended and every event has its PubAck
	done   chan struct{} // closed when run returns
	// laneKick (cap 1) tells the sender a reply changed a lane, when batched.
	laneKick chan struct{}

	mu sync.Mutex
	// subjects holds, for each subject with an event in flight, the events queued behind it.
	// A subject is present while busy; its queue may be empty.
	subjects map[string][]*pendingEvent
	byID     map[uint64]*pendingEvent // published events by id, until their PubAck
	out      []*pendingEvent          // published, for the sender to send, in order
	nextID   uint64
	lanes    [laneCount]lane                  // when batched: each stream's batch
	mode     publishMode                      // how events are published now (see batch.go)
	held     []*pendingEvent                  // arrived while the mode changes, in order (counted in queued)
	arrived  uint64                           // events handled: each event's number, for order across modes
	arrivals [batchEnterOutstanding]time.Time // when the last events arrived (see arrive)
	entered  time.Time                        // when the pipeline last went into batches
	left     time.Time                        // when it last came out of them
	dwell    time.Duration                    // its shortest stay in batches since entered (see batchReentry)
	// wasCaughtUp says a keepalive came less than the dwell after entering batches.
	wasCaughtUp bool
	txs         []*txEntry // FIFO of transactions not yet confirmed
	cur         *txEntry   // the open transaction, nil between transactions
	inFlight    int        // published, no PubAck yet
	queued      int        // waiting behind an earlier event of the same subject
	bytes       int        // eventSize of the events in flight or queued
	full        bool       // add refused an event: reply signals room at the low water marks
	inputDone   bool       // closeInput was called
	stopped     bool       // failed or run returned: nothing more is published or confirmed
	err         error

	behind atomic.Bool // publishing in batches: the reader reads in bulk (see bulkLittle)
	// deferKicks lets the reader queue batch events without waking the sender for each: it
	// calls flushOut before it may block (see publishDeferred). Set before the reader starts.
	deferKicks bool
	unkicked   atomic.Bool // events were queued without waking the sender
	halted     atomic.Bool // stopped, for the sender between sends without the lock
	sending    atomic.Bool // the sender is inside a send: nats.go may be stuck writing

	confirmed *atomic.Uint64
	// fence is the session's stream fence (see fence.go), nil when no stream takes one: the
	// sender raises it before its first send and stamps each event with it as it sends it.
	fence *sessionFence
	// atomic publishes every stream's events in atomic batches, one at a time per stream
	// (see atomic.go): a fenced stream is replicated. alanes are the streams' batches then.
	atomic bool
	alanes [laneCount]atomicLane
	// streams names each lane's stream, for errors and baton_relay_stream_full.
	streams [laneCount]string
	log     *slog.Logger
}

// ackResult is the reply to the publish of event id, or to a message of a batch: err is nil
// for a PubAck (or a batch's flow acknowledgement), else the error the reply reports.
type ackResult struct {
	id  uint64
	err error
	seq uint64 // the stream sequence a PubAck reports (event by event, atomic batches)
	// atomicID is the batch of an answer to an atomic batch's commit (see atomic.go), whose
	// count says how many events it stored.
	atomicID string
	count    uint64
	dup      bool        // a PubAck saying the stream had the event already (event by event only)
	batch    *batchReply // a reply on a batch; id is then unused
}

type pendingEvent struct {
	msg     *nats.Msg
	id      uint64
	tx      *txEntry
	outcome bool
	omitted bool
	// deadLetter is the kind of change whose dead-letter record this is, "" for an event.
	deadLetter string
	size       int    // eventSize
	lane       int    // its stream's lane
	n          uint64 // its number in arrival order
	inBatch    bool   // published in its lane's batch, not event by event
	bseq       uint64 // its number in its lane's batch, once sent
	// sentAt is when the sender handed the event to nats.go (UnixNano), 0 before: the ack
	// timeout counts from there, so a long queue on a slow but working link does not time out,
	// and a send stuck in a full socket does.
	sentAt atomic.Int64
}

// txEntry is a transaction of the FIFO the pipeline confirms in order, or a run of finished
// transactions and keepalive positions without events outstanding (see mergeLast).
type txEntry struct {
	end     pglogrepl.LSN // its end LSN, once closed: the LSN it makes safe to confirm
	pending int           // its events without a PubAck
	closed  bool          // its commit (or the keepalive) arrived: no event joins it any more
	// commitTime is the transaction's commit time, zero for a keepalive and for the backfill's
	// synthetic transaction. Only its events read it (commit-to-PubAck latency); a run
	// merged by mergeLast keeps the newest transaction's.
	commitTime time.Time
}

// newPipeline returns a pipeline with cfg's limits (MaxInFlight, MaxInFlightBytes,
// AckTimeout) that publishes through open, in batches when batched, and stores the LSN it
// makes safe to confirm in confirmed.
func newPipeline(cfg *Config, m *metrics, confirmed *atomic.Uint64, open openSender, batched bool) *pipeline {
	maxPending, maxBytes := cfg.MaxInFlight, cfg.MaxInFlightBytes
	p := &pipeline{
		open:       open,
		maxPending: maxPending,
		// Waking the reader for every PubAck when full would hand the CPU back and forth
		// per event; it resumes when an eighth of the window is free.
		lowWater:   maxPending - max(1, maxPending/8),
		maxBytes:   maxBytes,
		lowBytes:   maxBytes - maxBytes/8,
		ackTimeout: cfg.AckTimeout,
		m:          m,
		batched:    batched,
		laneKick:   make(chan struct{}, 1),
		room:       make(chan struct{}, 1),
		kick:       make(chan struct{}, 1),
		failed:     make(chan struct{}),
		idle:       make(chan struct{}),
		done:       make(chan struct{}),
		subjects:   map[string][]*pendingEvent{},
		byID:       map[uint64]*pendingEvent{},
		dwell:      batchMinDwell,
		confirmed:  confirmed,
		// Below MaxInFlight, or a relay configured with a small window would never batch.
		batchEnter: max(1, min(batchEnterOutstanding, maxPending/2)),
		streams:    [laneCount]string{laneTurns: cfg.TurnsStream, laneOutcomes: cfg.OutcomesStream, laneDeadLetter: cfg.DeadLetterStream},
		log:        cfg.Logger,
	}
	if p.log == nil {
		p.log = slog.New(slog.DiscardHandler)
	}
	if batched && cfg.alwaysBatches {
		p.alwaysBatches, p.mode = true, publishBatches
		p.setBatching(true)
	}
	if pipelineMade != nil {
		pipelineMade(cfg, p)
	}
	return p
}

// pipelineMade, when not nil, is told of every pipeline newPipeline makes, with its Config:
// tests read a running session's pipeline through it (export_test.go). It is set before any
// relay runs, and nil outside tests.
var pipelineMade func(*Config, *pipeline)

// errDrainTimeout is returned when a graceful stop gave up waiting for PubAcks.
var errDrainTimeout = errors.New("gave up waiting for PubAcks")

// errStopped is returned to a caller adding to a pipeline that failed or stopped.
var errStopped = errors.New("pipeline stopped")

// run starts the sender, then waits until closeInput was called and every event is
// acknowledged, and checks the ack timeout meanwhile. It returns early with the pipeline's
// first error, and with nil when abort is closed. drainTimeout bounds the wait after graceful
// is closed. When it returns, nothing more is published or confirmed. It never waits for the
// sender: a send stuck in nats.go ends when the connection's write deadline passes, and the
// sender then unsubscribes from PubAcks and returns.
func (p *pipeline) run(abort, graceful <-chan struct{}, drainTimeout time.Duration) error {
	go p.sendLoop()
	defer func() {
		p.mu.Lock()
		p.stopped = true
		p.halted.Store(true)
		p.mu.Unlock()
		close(p.done)
		p.setBatching(false)
		p.m.inFlight.Set(0)
		p.m.inFlightBytes.Set(0)
	}()
	var drainTimer <-chan time.Time
	tick := time.NewTicker(250 * time.Millisecond)
	defer tick.Stop()
	for {
		select {
		case <-p.idle:
			return nil
		case <-p.failed:
			return p.err // written before failed was closed
		case now := <-tick.C:
			if err := p.tick(now); err != nil {
				return err
			}
		case <-graceful:
			graceful = nil
			drainTimer = time.After(drainTimeout)
		case <-drainTimer:
			return errDrainTimeout
		case <-abort:
			return nil
		}
	}
}

func (p *pipeline) tick(now time.Time) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.flushOut() // a safety net: the reader flushes before it blocks
	p.m.inFlight.Set(float64(p.inFlight + p.queued))
	p.m.inFlightBytes.Set(float64(p.bytes))
	err := p.checkAckTimeout(now)
	if err == nil && p.batched {
		err = p.checkCommits(now)
	}
	if err != nil {
		p.fail(err)
		return err
	}
	return nil
}

// fail records the pipeline's first error and stops it. mu is held.
func (p *pipeline) fail(err error) {
	if p.stopped {
		return
	}
	p.stopped = true
	p.halted.Store(true)
	p.err = err
	close(p.failed)
}

// sendLoop publishes the events publish queued, in order, until the pipeline stops. It opens
// the sender first, which subscribes to PubAcks, so that no reply can precede its
// subscription, and stops it (unsubscribes) when it returns. Both take nats.go's connection
// lock, which a send stuck in a full socket holds: that is why they happen here and nowhere
// else.
func (p *pipeline) sendLoop() {
	stop, ok := p.openSend()
	if !ok {
		return
	}
	defer stop()
	if !p.raiseFence() {
		return
	}
	send := p.sendQueued
	switch {
	case p.atomic:
		send = p.sendAtomic
	case p.batched:
		send = func() bool { return p.sendQueued() && p.sendBatched() }
	}
	// In batches, the sender also wakes on replies that change a lane, and to commit lanes
	// gone idle (see batch.go); event by event, neither happens.
	commit := time.NewTimer(time.Hour)
	defer commit.Stop()
	for {
		if due, open := p.nextCommit(); open {
			commit.Reset(max(0, time.Until(due)))
		}
		select {
		case <-p.kick:
		case <-p.laneKick:
		case <-commit.C:
		case <-p.failed:
			return
		case <-p.done:
			return
		}
		if !send() {
			return
		}
	}
}

// openSend opens the sender (see openSender), on the sender goroutine, and returns the
// function that stops it. A failure fails the pipeline and returns false.
func (p *pipeline) openSend() (stop func(), ok bool) {
	send, stop, err := p.open(p.reply)
	if err != nil {
		p.mu.Lock()
		p.fail(err)
		p.mu.Unlock()
		return nil, false
	}
	p.send = send
	return stop, true
}

// fenceCtx returns a context for a fence write, which ends when the pipeline fails, or after
// AckTimeout. A pipeline that ended normally (a backfill) lets its write finish: one cut short
// leaves the session unable to raise its fence (sessionFence.unknown).
func (p *pipeline) fenceCtx() (context.Context, context.CancelFunc) {
	ctx, cancel := context.WithTimeout(context.Background(), p.ackTimeout)
	go func() { // ends with ctx: cancel is called by the caller when done
		select {
		case <-p.failed:
		case <-ctx.Done():
		}
		cancel()
	}()
	return ctx, cancel
}

// raiseFence raises the session's fence (see fence.go) before the first send, and reports
// whether the pipeline goes on. A failure fails the pipeline.
func (p *pipeline) raiseFence() bool {
	if p.fence == nil {
		return true
	}
	ctx, cancel := p.fenceCtx()
	err := p.fence.raise(ctx)
	cancel()
	return p.fenceFailed(err)
}

// refreshFence writes the fence of lane again when a limit of its stream calls for it (see
// sessionFence.refreshDue), and reports whether the pipeline goes on.
func (p *pipeline) refreshFence(lane int) bool {
	if p.fence == nil || !p.fence.refreshDue(lane, time.Now()) {
		return true
	}
	ctx, cancel := p.fenceCtx()
	err := p.fence.refresh(ctx, lane)
	cancel()
	return p.fenceFailed(err)
}

// fenceFailed fails the pipeline with err, a fence write's, unless it is nil, and reports
// whether the pipeline goes on.
func (p *pipeline) fenceFailed(err error) bool {
	if err == nil {
		return true
	}
	p.m.errors.WithLabelValues("publish").Inc()
	p.mu.Lock()
	p.fail(err)
	p.mu.Unlock()
	return false
}

// sendQueued sends the events queued to go out one by one (up to the first one queued for a
// batch, which sendBatched sends) and reports whether the pipeline goes on. A send error
// fails the pipeline: the session replays from the confirmed LSN.
func (p *pipeline) sendQueued() bool {
	p.mu.Lock()
	n := 0
	for n < len(p.out) && !p.out[n].inBatch {
		n++
	}
	single := p.out[:n:n]
	p.out = p.out[n:]
	p.mu.Unlock()
	for _, ev := range single {
		if p.halted.Load() || !p.refreshFence(ev.lane) {
			return false
		}
		p.fence.stamp(ev.msg, ev.lane)
		ev.sentAt.Store(time.Now().UnixNano())
		if !p.sendOne(ev.msg, eventToken(ev.id), ev.msg.Header.Get(nats.MsgIdHdr)) {
			return false
		}
	}
	return true
}

// sendOne hands msg to the sender with its reply token and reports whether that worked. An
// error fails the pipeline (what names msg in the error): the session replays from the
// confirmed LSN. sending is set meanwhile, for checkAckTimeout.
func (p *pipeline) sendOne(msg *nats.Msg, token, what string) bool {
	p.sending.Store(true)
	err := p.send(msg, token)
	p.sending.Store(false)
	if err != nil {
		p.m.errors.WithLabelValues("publish").Inc()
		p.mu.Lock()
		p.fail(fmt.Errorf("publish %s: %w", what, err))
		p.mu.Unlock()
		return false
	}
	return true
}

// pending returns the events outstanding, for logs.
func (p *pipeline) pending() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.outstanding()
}

// outstanding returns the events published or queued and not yet acknowledged. mu is held.
func (p *pipeline) outstanding() int { return p.inFlight + p.queued }

// add handles one item of the stream, publishing an event at once unless its subject is busy.
// It returns false, having done nothing, when the event does not fit: MaxInFlight events are
// outstanding, or MaxInFlightBytes would be exceeded (an event alone always fits). Wait for
// p.room and call it again.
func (p *pipeline) add(it item) (bool, error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.stopped {
		return false, errStopped
	}
	if it.kind == itemEvent {
		if n := p.outstanding(); n >= p.maxPending || n > 0 && p.bytes+eventSize(it.msg) > p.maxBytes {
			p.full = true
			return false, nil
		}
	}
	if err := p.handle(it); err != nil {
		p.fail(err)
		return false, err
	}
	return true, nil
}

// closeInput says no item follows; run returns once every event has its PubAck.
func (p *pipeline) closeInput() {
	p.flushOut()
	p.mu.Lock()
	defer p.mu.Unlock()
	p.inputDone = true
	p.checkIdle()
}

// checkIdle closes idle when the input ended and nothing is outstanding. mu is held.
func (p *pipeline) checkIdle() {
	if p.inputDone && p.outstanding() == 0 {
		select {
		case <-p.idle:
		default:
			close(p.idle)
		}
	}
}

// reply takes the result of a publish (on nats.go's goroutine). Replies after the pipeline
// stopped, and to events it does not know, are dropped.
func (p *pipeline) reply(a ackResult) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.stopped {
		return
	}
	ack := p.ack
	switch {
	case a.batch != nil:
		ack = p.batchAck
	case a.atomicID != "":
		ack = p.atomicAck
	}
	if err := ack(a); err != nil {
		p.fail(err)
		return
	}
	if p.full && p.outstanding() <= p.lowWater && p.bytes <= p.lowBytes {
		p.full = false
		signal(p.room)
	}
	p.checkIdle()
}

// wait blocks until add may have room again, ctx ends or the pipeline stops.
func (p *pipeline) wait(ctx context.Context) error {
	select {
	case <-p.room:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	case <-p.failed:
		return errStopped
	case <-p.done:
		return errStopped
	}
}

// checkAckTimeout fails the pipeline when an event waited longer than AckTimeout for its
// PubAck: the session then restarts from the confirmed LSN. The error wraps errNoPubAck when
// the sender is not inside a send, so nats.go took every event without blocking and the
// server did not answer: the streams are then checked again before the next session (a
// stream changed to no_ack answers nothing, ever). While a send is stuck in a full socket
// they are not, since the JetStream API would wait on the same connection lock.
func (p *pipeline) checkAckTimeout(now time.Time) error {
	for _, ev := range p.byID {
		if sent := ev.sentAt.Load(); sent != 0 && now.Sub(time.Unix(0, sent)) > p.ackTimeout {
			p.m.errors.WithLabelValues("publish").Inc()
			err := fmt.Errorf("publish %s on %s: no PubAck within %s", ev.msg.Header.Get(nats.MsgIdHdr), ev.msg.Subject, p.ackTimeout)
			if !p.sending.Load() {
				err = fmt.Errorf("%w: %w", err, errNoPubAck)
			}
			return err
		}
	}
	return nil
}

// eventSize is what an event counts against MaxInFlightBytes: its body and an allowance for
// its subject, headers and bookkeeping, without walking the headers on the hot path (they
// are bounded: at most wire.MaxHeaderOutboxIDs ids).
func eventSize(m *nats.Msg) int { return len(m.Data) + eventOverhead }

// eventOverhead is eventSize's allowance for what an event holds besides its body.
const eventOverhead = 512

// errNoPubAck marks an ack timeout of events nats.go took without blocking: see
// checkAckTimeout.
var errNoPubAck = errors.New("the server answered no publish")

func (p *pipeline) handle(it item) error {
	switch it.kind {
	case itemBegin:
		p.cur = &txEntry{commitTime: it.commitTime}
		p.txs = append(p.txs, p.cur)
	case itemCommit:
		if p.cur == nil {
			return fmt.Errorf("commit at %s without begin", it.lsn)
		}
		p.cur.end, p.cur.closed = it.lsn, true
		p.cur = nil
		p.mergeLast()
		p.advance()
	case itemKeepalive:
		if !it.answer {
			p.caughtUp(time.Now())
		}
		// Only between transactions; inside one, the WAL end may lie past events not yet sent.
		if p.cur == nil {
			if len(p.txs) == 0 {
				p.confirm(it.lsn)
			} else if last := p.txs[len(p.txs)-1]; last.closed && last.end < it.lsn {
				p.txs = append(p.txs, &txEntry{end: it.lsn, closed: true})
				p.mergeLast()
			}
		}
	case itemEvent:
		tx := p.cur
		if tx == nil {
			return errors.New("event outside a transaction")
		}
		tx.pending++
		p.arrived++
		p.arrive(p.arrived, time.Now())
		if it.traceDropped {
			p.m.traceDropped.Inc()
		}
		ev := &pendingEvent{msg: it.msg, tx: tx, outcome: it.outcome, omitted: it.omitted, deadLetter: it.deadLetter,
			size: eventSize(it.msg), lane: laneOf(it.outcome, it.deadLetter), n: p.arrived}
		p.bytes += ev.size
		p.route(ev)
	case itemIgnored:
		p.m.ignored.Inc()
	}
	return nil
}

// publishOne publishes ev event by event: at once, unless an earlier event of its subject
// waits for its PubAck, behind which it queues. mu is held.
func (p *pipeline) publishOne(ev *pendingEvent) {
	if q, busy := p.subjects[ev.msg.Subject]; busy {
		p.subjects[ev.msg.Subject] = append(q, ev)
		p.queued++
		return
	}
	p.subjects[ev.msg.Subject] = nil
	p.publish(ev)
}

// publishDeferred queues ev for the sender like publish, in batches, but wakes the sender only
// once sendEager events are queued: the reader calls flushOut before it may block, so a
// backlog's events go to the sender a read's worth at a time instead of a wake-up per event.
// mu is held.
func (p *pipeline) publishDeferred(ev *pendingEvent) {
	if !p.deferKicks || len(p.out) >= sendEager {
		p.publish(ev)
		return
	}
	p.queue(ev)
	p.unkicked.Store(true)
}

// signal wakes whoever waits on ch (cap 1) without blocking: a signal already pending covers it.
func signal(ch chan struct{}) {
	select {
	case ch <- struct{}{}:
	default:
	}
}

// sendEager is how many events publishDeferred queues before it wakes the sender anyway.
const sendEager = 256

// flushOut wakes the sender for the events publishDeferred queued. The reader calls it before
// anything that may block: a socket read, a wait for room. Safe from any goroutine.
func (p *pipeline) flushOut() {
	if p.unkicked.Swap(false) {
		signal(p.kick)
	}
}

// publish queues ev for the sender, in its lane's batch when the pipeline publishes in
// batches, and wakes the sender. mu is held.
func (p *pipeline) publish(ev *pendingEvent) {
	p.queue(ev)
	if len(p.out) == 1 || p.unkicked.Swap(false) {
		signal(p.kick)
	}
}

// queue adds ev to the events for the sender. mu is held.
func (p *pipeline) queue(ev *pendingEvent) {
	ev.inBatch = p.mode == publishBatches
	p.nextID++
	ev.id = p.nextID
	p.byID[ev.id] = ev
	p.inFlight++
	p.out = append(p.out, ev)
}

func (p *pipeline) ack(a ackResult) error {
	ev, ok := p.byID[a.id]
	if !ok {
		return nil // a reply to nothing this pipeline has in flight
	}
	if a.err != nil {
		p.m.errors.WithLabelValues("publish").Inc()
		return fmt.Errorf("publish %s on %s: %w", ev.msg.Header.Get(nats.MsgIdHdr), ev.msg.Subject,
			asFencedOut(asStreamFull(a.err, ev.lane, p.streams[ev.lane], ev.msg)))
	}
	p.fence.ackedAt(ev.lane, a.seq)
	p.acked(ev, !a.dup)
	if p.atomic {
		p.atomicSingleAcked(ev)
	}
	switch q := p.subjects[ev.msg.Subject]; {
	case len(q) == 0:
		delete(p.subjects, ev.msg.Subject)
	case p.mode == publishSingle:
		next := q[0]
		q[0] = nil
		p.subjects[ev.msg.Subject] = q[1:]
		p.queued--
		p.publish(next)
	}
	// Else the pipeline is turning to batches, which take the queue when nothing is in flight.
	if p.mode == publishEntering {
		p.enterBatches()
	}
	p.advance()
	return nil
}

// acked accounts for ev's PubAck: it leaves the events in flight, its transaction waits for one
// event less, and the metrics count it. stored says the PubAck is not a duplicate's (batches do
// not say). It ends a full episode of ev's stream (baton_relay_stream_full) when the stream
// stored ev: the event it refused, or one that was no duplicate; a duplicate's PubAck, as a
// replay brings them, says nothing about room. mu is held; the caller advances the confirmed
// LSN.
func (p *pipeline) acked(ev *pendingEvent, stored bool) {
	delete(p.byID, ev.id)
	p.inFlight--
	p.bytes -= ev.size
	now := time.Now()
	p.m.publishLatency.Observe(now.Sub(time.Unix(0, ev.sentAt.Load())).Seconds())
	switch {
	case ev.deadLetter != "":
		p.m.deadLetter.WithLabelValues(ev.deadLetter).Inc()
	case ev.tx.commitTime.IsZero():
		p.m.backfill.Inc()
	case ev.outcome:
		p.m.outcomes.Inc()
		p.m.commitToAck.Observe(now.Sub(ev.tx.commitTime).Seconds())
	default:
		p.m.turns.Inc()
		p.m.commitToAck.Observe(now.Sub(ev.tx.commitTime).Seconds())
	}
	if ev.omitted {
		p.m.omitted.Inc()
	}
	if p.m.full[ev.lane].Load() && (stored || p.m.refused(ev.lane, ev.msg.Header.Get(nats.MsgIdHdr))) {
		p.m.roomAgain(p.log, ev.lane, p.streams[ev.lane])
	}
	ev.tx.pending--
}

// mergeLast folds the newest entry of the FIFO into the one before it when both are closed and
// neither has an event waiting for its PubAck: the older one takes the newer one's end (and its
// commit time, when it has one). No event joins a closed entry, so two such entries stay
// finished and advance would confirm them in the same call, up to the newer end: merged, the
// same LSNs are confirmed at the same moments, and consecutive transactions without events
// (or keepalives) behind an unacknowledged event cost one entry, not one each. mu is held.
func (p *pipeline) mergeLast() {
	n := len(p.txs)
	if n < 2 {
		return
	}
	last, prev := p.txs[n-1], p.txs[n-2]
	if !last.closed || last.pending != 0 || !prev.closed || prev.pending != 0 {
		return
	}
	prev.end = max(prev.end, last.end)
	if !last.commitTime.IsZero() {
		prev.commitTime = last.commitTime
	}
	p.txs[n-1] = nil
	p.txs = p.txs[:n-1]
}

// advance confirms every finished transaction at the head of the FIFO.
func (p *pipeline) advance() {
	n := 0
	for n < len(p.txs) && p.txs[n].closed && p.txs[n].pending == 0 {
		n++
	}
	if n == 0 {
		return
	}
	p.confirm(p.txs[n-1].end)
	clear(p.txs[:n])
	p.txs = p.txs[n:]
}

func (p *pipeline) confirm(lsn pglogrepl.LSN) {
	if uint64(lsn) > p.confirmed.Load() {
		p.confirmed.Store(uint64(lsn))
		p.m.confirmedLSN.Set(float64(lsn))
	}
}

// feed adds items, waiting for room as needed, until ctx ends or the pipeline stops.
func (p *pipeline) feed(ctx context.Context, items ...item) error {
	for _, it := range items {
		for {
			ok, err := p.add(it)
			if err != nil {
				return err
			}
			if ok {
				break
			}
			if err := p.wait(ctx); err != nil {
				return err
			}
		}
	}
	return nil
}
