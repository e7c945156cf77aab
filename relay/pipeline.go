package relay

import (
	"context"
	"errors"
	"fmt"
	"sync/atomic"
	"time"

	"github.com/jackc/pglogrepl"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
)

// pipeline publishes events to JetStream asynchronously and computes the LSN that is safe to
// confirm to Postgres. One goroutine (run) owns all of its state.
//
// Delivery rules kept here:
//   - Per-subject order: an event is published only after every earlier event on its subject has
//     a PubAck. A failed or lost publish therefore can never be overtaken by a later event of the
//     same conversation; the session ends and replays from the confirmed LSN, where JetStream's
//     Nats-Msg-Id deduplication drops what was already stored. Different conversations are
//     pipelined, up to MaxInFlight events.
//   - Confirmation: the confirmed LSN is the end LSN of the newest transaction that, with every
//     transaction before it, has a PubAck for each of its events. A keepalive's WAL end is
//     confirmed only when it arrives outside a transaction with nothing before it unacknowledged.
type pipeline struct {
	js         jetstream.JetStream
	send       func(msg *nats.Msg) error // PublishMsgAsync; tests replace it
	maxPending int
	ackTimeout time.Duration
	m          *metrics

	in   chan []item // one slice per transaction (or per part of a large one)
	acks chan ackResult
	done chan struct{} // closed when run returns; late callbacks are dropped

	// subjects holds, for each subject with an event in flight, the events queued behind it.
	// A subject is present while busy; its queue may be empty.
	subjects map[string][]*pendingEvent
	byMsg    map[*nats.Msg]*pendingEvent
	txs      []*txEntry // FIFO of transactions not yet confirmed
	cur      *txEntry   // the open transaction, nil between transactions
	inFlight int        // published, no PubAck yet
	queued   int        // waiting behind an earlier event of the same subject

	confirmed *atomic.Uint64
	acked     atomic.Int64 // events acknowledged (for the caller's progress)
}

type ackResult struct {
	msg *nats.Msg
	ack *jetstream.PubAck
	err error
}

type pendingEvent struct {
	msg     *nats.Msg
	tx      *txEntry
	outcome bool
	omitted bool
	sentAt  time.Time
}

type txEntry struct {
	end        pglogrepl.LSN
	pending    int
	closed     bool
	commitTime time.Time
}

func newPipeline(nc *nats.Conn, cfg *Config, m *metrics, confirmed *atomic.Uint64) (*pipeline, error) {
	p := &pipeline{
		maxPending: cfg.MaxInFlight,
		ackTimeout: cfg.AckTimeout,
		m:          m,
		in:         make(chan []item, 4),
		acks:       make(chan ackResult, cfg.MaxInFlight+16),
		done:       make(chan struct{}),
		subjects:   map[string][]*pendingEvent{},
		byMsg:      map[*nats.Msg]*pendingEvent{},
		confirmed:  confirmed,
	}
	// No per-publish timeout option (it costs a timer per message): run checks the oldest
	// unacknowledged event on a ticker instead.
	js, err := jetstream.New(nc,
		jetstream.WithPublishAsyncMaxPending(cfg.MaxInFlight+16),
		jetstream.WithPublishAsyncAckHandler(func(_ jetstream.JetStream, msg *nats.Msg, ack *jetstream.PubAck) {
			p.deliverAck(ackResult{msg: msg, ack: ack})
		}),
		jetstream.WithPublishAsyncErrHandler(func(_ jetstream.JetStream, msg *nats.Msg, err error) {
			p.deliverAck(ackResult{msg: msg, err: err})
		}),
	)
	if err != nil {
		return nil, fmt.Errorf("jetstream: %w", err)
	}
	p.js = js
	p.send = func(msg *nats.Msg) error {
		_, err := js.PublishMsgAsync(msg)
		return err
	}
	return p, nil
}

// deliverAck runs on nats.go's goroutine and must not block: acks has room for every event
// that can be in flight, and after run returned nobody reads, so late results are dropped.
func (p *pipeline) deliverAck(a ackResult) {
	select {
	case p.acks <- a:
	case <-p.done:
	}
}

// errDrainTimeout is returned when a graceful stop gave up waiting for PubAcks.
var errDrainTimeout = errors.New("gave up waiting for PubAcks")

// run publishes what arrives on p.in until it is closed and everything is acknowledged. It
// returns early with an error when a publish fails, and with nil when abort is closed.
// drainTimeout bounds the wait after graceful is closed.
func (p *pipeline) run(abort, graceful <-chan struct{}, drainTimeout time.Duration) error {
	defer func() {
		close(p.done)
		if p.js != nil {
			p.js.CleanupPublisher()
		}
		p.m.inFlight.Set(0)
	}()
	in := p.in
	var drainTimer <-chan time.Time
	tick := time.NewTicker(250 * time.Millisecond)
	defer tick.Stop()
	for {
		if in == nil && p.inFlight == 0 && p.queued == 0 {
			return nil
		}
		recv := in
		if p.inFlight+p.queued >= p.maxPending {
			recv = nil // backpressure: the reader blocks, so does the walsender
		}
		select {
		case items, ok := <-recv:
			if !ok {
				in = nil
				continue
			}
			for _, it := range items {
				if err := p.handle(it); err != nil {
					return err
				}
			}
		case a := <-p.acks:
			if err := p.ack(a); err != nil {
				return err
			}
		case now := <-tick.C:
			p.m.inFlight.Set(float64(p.inFlight + p.queued))
			if err := p.checkAckTimeout(now); err != nil {
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

// checkAckTimeout fails the pipeline when an event waited longer than AckTimeout for its
// PubAck: the session then restarts from the confirmed LSN.
func (p *pipeline) checkAckTimeout(now time.Time) error {
	for _, ev := range p.byMsg {
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
		ev := &pendingEvent{msg: it.msg, tx: tx, outcome: it.outcome, omitted: it.omitted}
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
	p.byMsg[ev.msg] = ev
	p.inFlight++
	if err := p.send(ev.msg); err != nil {
		p.m.errors.WithLabelValues("publish").Inc()
		return fmt.Errorf("publish %s: %w", ev.msg.Header.Get(nats.MsgIdHdr), err)
	}
	return nil
}

func (p *pipeline) ack(a ackResult) error {
	ev, ok := p.byMsg[a.msg]
	if !ok {
		return nil // a result for an earlier pipeline's message
	}
	if a.err != nil {
		p.m.errors.WithLabelValues("publish").Inc()
		return fmt.Errorf("publish %s on %s: %w", a.msg.Header.Get(nats.MsgIdHdr), a.msg.Subject, a.err)
	}
	delete(p.byMsg, a.msg)
	p.inFlight--
	p.acked.Add(1)
	now := time.Now()
	p.m.publishLatency.Observe(now.Sub(ev.sentAt).Seconds())
	switch {
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

// feed sends items to run, giving up when ctx ends or run returned.
func (p *pipeline) feed(ctx context.Context, it ...item) error {
	select {
	case p.in <- it:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	case <-p.done:
		return errors.New("pipeline stopped")
	}
}
