package relay

import (
	"context"
	"errors"
	"fmt"
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
// (nats.go's goroutine, one PubAck at a time): an event is published by the goroutine that
// frees it, with no hand-off between goroutines on the way from the replication stream to
// NATS or from a PubAck to the next event of its conversation. run owns the lifecycle: the ack
// timeout, a graceful drain, and the end of the pipeline.
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
//   - Events of a transaction are published as they arrive, before its commit: the transaction
//     is confirmed only after its commit, and a replay republishes them under the same ids.
//   - A dead-letter record (a change no retry can publish, set aside by the decoder) is an
//     event like the others: its transaction is confirmed only after the record's PubAck, so
//     a change is never skipped without its record in the dead-letter stream. A failure to
//     publish the record is retried like any other.
//   - Once the pipeline failed or stopped, nothing more is published or confirmed.
type pipeline struct {
	pub        *publisher                           // nil in tests
	send       func(msg *nats.Msg, id uint64) error // pub.publish; tests replace it
	maxPending int
	lowWater   int // room is signalled when outstanding events drop to this
	ackTimeout time.Duration
	m          *metrics

	room   chan struct{} // cap 1: outstanding events dropped to lowWater
	failed chan struct{} // closed with the first error (err)
	idle   chan struct{} // closed when the input ended and every event has its PubAck
	done   chan struct{} // closed when run returns

	mu sync.Mutex
	// subjects holds, for each subject with an event in flight, the events queued behind it.
	// A subject is present while busy; its queue may be empty.
	subjects  map[string][]*pendingEvent
	byID      map[uint64]*pendingEvent // published events by id, until their PubAck
	nextID    uint64
	txs       []*txEntry // FIFO of transactions not yet confirmed
	cur       *txEntry   // the open transaction, nil between transactions
	inFlight  int        // published, no PubAck yet
	queued    int        // waiting behind an earlier event of the same subject
	inputDone bool       // closeInput was called
	stopped   bool       // failed or run returned: nothing more is published or confirmed
	err       error

	confirmed *atomic.Uint64
	acked     atomic.Int64 // events acknowledged (for the caller's progress)
}

// ackResult is the reply to the publish of event id: nil for a PubAck, else its error.
type ackResult struct {
	id  uint64
	err error
}

type pendingEvent struct {
	msg     *nats.Msg
	id      uint64
	tx      *txEntry
	outcome bool
	omitted bool
	// deadLetter is the kind of change whose dead-letter record this is, "" for an event.
	deadLetter string
	sentAt     time.Time
}

type txEntry struct {
	end        pglogrepl.LSN
	pending    int
	closed     bool
	commitTime time.Time
}

func newPipeline(nc *nats.Conn, cfg *Config, m *metrics, confirmed *atomic.Uint64) (*pipeline, error) {
	p := initPipeline(cfg.MaxInFlight, cfg.AckTimeout, m, confirmed)
	pub, err := newPublisher(nc, p.reply)
	if err != nil {
		return nil, err
	}
	p.pub, p.send = pub, pub.publish
	return p, nil
}

func initPipeline(maxPending int, ackTimeout time.Duration, m *metrics, confirmed *atomic.Uint64) *pipeline {
	return &pipeline{
		maxPending: maxPending,
		// Waking the reader for every PubAck when full would hand the CPU back and forth
		// per event; it resumes when an eighth of the window is free.
		lowWater:   maxPending - max(1, maxPending/8),
		ackTimeout: ackTimeout,
		m:          m,
		room:       make(chan struct{}, 1),
		failed:     make(chan struct{}),
		idle:       make(chan struct{}),
		done:       make(chan struct{}),
		subjects:   map[string][]*pendingEvent{},
		byID:       map[uint64]*pendingEvent{},
		confirmed:  confirmed,
	}
}

// errDrainTimeout is returned when a graceful stop gave up waiting for PubAcks.
var errDrainTimeout = errors.New("gave up waiting for PubAcks")

// errStopped is returned to a caller adding to a pipeline that failed or stopped.
var errStopped = errors.New("pipeline stopped")

// run waits until closeInput was called and every event is acknowledged, and checks the ack
// timeout meanwhile. It returns early with the pipeline's first error, and with nil when abort
// is closed. drainTimeout bounds the wait after graceful is closed. When it returns, nothing
// more is published or confirmed, and the PubAck subscription is gone.
func (p *pipeline) run(abort, graceful <-chan struct{}, drainTimeout time.Duration) error {
	defer func() {
		p.mu.Lock()
		p.stopped = true
		p.mu.Unlock()
		close(p.done)
		if p.pub != nil {
			p.pub.close()
		}
		p.m.inFlight.Set(0)
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
	p.m.inFlight.Set(float64(p.inFlight + p.queued))
	if err := p.checkAckTimeout(now); err != nil {
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
	p.err = err
	close(p.failed)
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
// It returns false, having done nothing, when MaxInFlight events are outstanding: wait for
// p.room and call it again.
func (p *pipeline) add(it item) (bool, error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.stopped {
		return false, errStopped
	}
	if it.kind == itemEvent && p.outstanding() >= p.maxPending {
		return false, nil
	}
	if err := p.handle(it); err != nil {
		p.fail(err)
		return false, err
	}
	return true, nil
}

// closeInput says no item follows; run returns once every event has its PubAck.
func (p *pipeline) closeInput() {
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
	if err := p.ack(a); err != nil {
		p.fail(err)
		return
	}
	if p.outstanding() == p.lowWater {
		select {
		case p.room <- struct{}{}:
		default:
		}
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
// PubAck: the session then restarts from the confirmed LSN.
func (p *pipeline) checkAckTimeout(now time.Time) error {
	for _, ev := range p.byID {
		if now.Sub(ev.sentAt) > p.ackTimeout {
			p.m.errors.WithLabelValues("publish").Inc()
			return fmt.Errorf("publish %s on %s: no PubAck within %s", ev.msg.Header.Get(nats.MsgIdHdr), ev.msg.Subject, p.ackTimeout)
		}
	}
	return nil
}

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
		p.advance()
	case itemKeepalive:
		// Only between transactions; inside one, the WAL end may lie past events not yet sent.
		if p.cur == nil {
			if len(p.txs) == 0 {
				p.confirm(it.lsn)
			} else if last := p.txs[len(p.txs)-1]; last.closed && last.end < it.lsn {
				p.txs = append(p.txs, &txEntry{end: it.lsn, closed: true})
			}
		}
	case itemEvent:
		tx := p.cur
		if tx == nil {
			return errors.New("event outside a transaction")
		}
		tx.pending++
		ev := &pendingEvent{msg: it.msg, tx: tx, outcome: it.outcome, omitted: it.omitted, deadLetter: it.deadLetter}
		if q, busy := p.subjects[it.msg.Subject]; busy {
			p.subjects[it.msg.Subject] = append(q, ev)
			p.queued++
		} else {
			p.subjects[it.msg.Subject] = nil
			if err := p.publish(ev); err != nil {
				return err
			}
		}
	case itemIgnored:
		p.m.ignored.Inc()
	}
	return nil
}

func (p *pipeline) publish(ev *pendingEvent) error {
	ev.sentAt = time.Now()
	p.nextID++
	ev.id = p.nextID
	p.byID[ev.id] = ev
	p.inFlight++
	if err := p.send(ev.msg, ev.id); err != nil {
		p.m.errors.WithLabelValues("publish").Inc()
		return fmt.Errorf("publish %s: %w", ev.msg.Header.Get(nats.MsgIdHdr), err)
	}
	return nil
}

func (p *pipeline) ack(a ackResult) error {
	ev, ok := p.byID[a.id]
	if !ok {
		return nil // a reply to nothing this pipeline has in flight
	}
	if a.err != nil {
		p.m.errors.WithLabelValues("publish").Inc()
		return fmt.Errorf("publish %s on %s: %w", ev.msg.Header.Get(nats.MsgIdHdr), ev.msg.Subject, a.err)
	}
	delete(p.byID, a.id)
	p.inFlight--
	p.acked.Add(1)
	now := time.Now()
	p.m.publishLatency.Observe(now.Sub(ev.sentAt).Seconds())
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
	if q := p.subjects[ev.msg.Subject]; len(q) > 0 {
		next := q[0]
		q[0] = nil
		p.subjects[ev.msg.Subject] = q[1:]
		p.queued--
		if err := p.publish(next); err != nil {
			return err
		}
	} else {
		delete(p.subjects, ev.msg.Subject)
	}
	ev.tx.pending--
	p.advance()
	return nil
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
