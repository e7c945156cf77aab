package relay

import (
	"errors"
	"fmt"
	"strconv"
	"strings"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/nats-io/nuid"
)

// Atomic publishing: how the relay publishes when a fenced stream is replicated.
//
// A replicated stream refuses a publish whose expected-sequence check names a subject that
// another check in flight names (10164: the leader cannot know the outcome of the first before
// it is applied), so pipelined events cannot each carry the fence (see fence.go). Instead, each
// stream gets one JetStream atomic batch at a time (ADR-50; nats-server 2.12 and later, streams
// with allow_atomic): every event queued for the stream, up to atomicMaxMsgs events or
// atomicMaxBytes, in order, the first carrying the fence and the last the commit. The server
// checks the fence and stores the whole batch, or nothing, and answers once; the next batch of
// that stream goes out after that answer, when nothing checks the fence subject any more. A
// batch carries what arrived while the previous one was on its way, so the batches grow with
// the rate and an event waits at most one round trip behind the one before.
//
// Per-conversation order follows: a stream's batches are stored one after another, each whole
// or not at all, and a failed one ends the session before the next is sent.
//
// An atomic batch that holds a Nats-Msg-Id the stream has already is refused whole (10201).
// The replay check (replay.go) leaves out what earlier sessions stored, but anything with
// publish rights on a subject can store a message with an event's Nats-Msg-Id first: that
// batch's events are then published one at a time, each fenced and after the previous one's
// PubAck, where the duplicate is acknowledged as such and dropped, and batches resume after.
const (
	// atomicMaxMsgs bounds the events of one atomic batch (the server's default limit is
	// 1,000: max_batch_size).
	atomicMaxMsgs = 256
	// atomicMaxBytes bounds the events' bytes (eventSize) in one atomic batch, which the
	// server replicates as one entry; a larger event goes alone.
	atomicMaxBytes = 4 << 20
)

// Headers of an atomic batch message (ADR-50).
const (
	batchIDHeader     = "Nats-Batch-Id"
	batchSeqHeader    = "Nats-Batch-Sequence"
	batchCommitHeader = "Nats-Batch-Commit"
)

// Error codes of atomic batches the relay handles: a duplicate Nats-Msg-Id in the batch (its
// events then go one at a time), and a batch larger than the server's max_batch_size (the
// batch is sent again in halves).
const (
	atomicDuplicate jetstream.ErrorCode = 10201
	atomicTooLarge  jetstream.ErrorCode = 10199
	atomicDisabled  jetstream.ErrorCode = 10174 // the stream takes no atomic batches (any more)
)

// atomicLane is the state of one stream's atomic publishing. It is guarded by the pipeline's mu.
type atomicLane struct {
	id     string          // the batch in flight, "" when none
	events []*pendingEvent // its events, in order
	// single holds, after a refused duplicate, the events still to be published one at a
	// time (the first is in flight when sent is set).
	single []*pendingEvent
	sent   bool
	// max is the most events a batch takes (atomicMaxMsgs, halved after a refusal for size).
	max int
}

// busy reports whether the lane waits for an answer or has events to send one at a time.
func (l *atomicLane) busy() bool { return l.id != "" || len(l.single) > 0 }

// unbatch removes the headers of an atomic batch, and the fence its first event carried (the
// next send stamps the fence again), from msg.
func unbatch(msg *nats.Msg) {
	for _, h := range []string{batchIDHeader, batchSeqHeader, batchCommitHeader,
		jetstream.ExpectedLastSubjSeqHeader, jetstream.ExpectedLastSubjSeqSubjHeader} {
		delete(msg.Header, h)
	}
}

// atomicToken is the reply token of the commit of atomic batch id.
func atomicToken(id string) string { return "A." + id }

// parseAtomicToken returns the batch id of a reply token written by atomicToken.
func parseAtomicToken(tok string) (string, bool) {
	return strings.CutPrefix(tok, "A.")
}

// sendAtomic sends, for every stream without a batch in flight, its queued events as one
// atomic batch (or the next event to publish on its own after a refused duplicate), and
// reports whether the pipeline goes on.
func (p *pipeline) sendAtomic() bool {
	for lane := range laneCount {
		if p.halted.Load() {
			return false
		}
		if p.atomicIdle(lane) && !p.refreshFence(lane) {
			return false
		}
		msgs, tokens := p.nextAtomic(lane, time.Now())
		for i, msg := range msgs {
			if !p.sendOne(msg, tokens[i], msg.Subject) {
				return false
			}
		}
	}
	return !p.halted.Load()
}

// atomicIdle reports whether lane has no batch in flight and events queued: its fence may be
// written again before the next batch.
func (p *pipeline) atomicIdle(lane int) bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.alanes[lane].busy() {
		return false
	}
	for _, ev := range p.out {
		if ev.lane == lane {
			return true
		}
	}
	return false
}

// nextAtomic takes the messages to send now for lane, with their reply tokens ("" for none):
// the next event of a refused batch on its own, or, when the lane is idle, a new batch of its
// queued events in order, stamped as sent now. mu is taken.
func (p *pipeline) nextAtomic(lane int, now time.Time) ([]*nats.Msg, []string) {
	p.mu.Lock()
	defer p.mu.Unlock()
	l := &p.alanes[lane]
	if p.stopped {
		return nil, nil
	}
	if len(l.single) > 0 {
		if l.sent {
			return nil, nil
		}
		ev := l.single[0]
		l.sent = true
		unbatch(ev.msg)
		p.fence.stamp(ev.msg, lane)
		ev.sentAt.Store(now.UnixNano())
		return []*nats.Msg{ev.msg}, []string{eventToken(ev.id)}
	}
	if l.id != "" {
		return nil, nil
	}
	if l.max == 0 {
		l.max = atomicMaxMsgs
	}
	var batch []*pendingEvent
	bytes, full := 0, false
	rest := p.out[:0]
	for _, ev := range p.out {
		// The lane's events in order: the batch ends at the first that does not fit.
		full = full || ev.lane == lane && (len(batch) >= l.max || len(batch) > 0 && bytes+ev.size > atomicMaxBytes)
		if ev.lane != lane || full {
			rest = append(rest, ev)
			continue
		}
		batch = append(batch, ev)
		bytes += ev.size
	}
	clear(p.out[len(rest):])
	p.out = rest
	if len(batch) == 0 {
		return nil, nil
	}
	l.id, l.events = nuid.Next(), batch
	msgs := make([]*nats.Msg, len(batch))
	tokens := make([]string, len(batch))
	for i, ev := range batch {
		h := ev.msg.Header
		h[batchIDHeader] = []string{l.id}
		h[batchSeqHeader] = []string{strconv.Itoa(i + 1)}
		if i == 0 {
			p.fence.stamp(ev.msg, lane)
		}
		if i == len(batch)-1 {
			h[batchCommitHeader] = []string{"1"}
			tokens[i] = atomicToken(l.id)
		}
		ev.sentAt.Store(now.UnixNano())
		msgs[i] = ev.msg
	}
	return msgs, tokens
}

// atomicAck takes the answer to the commit of an atomic batch. mu is held. An answer to a
// batch no lane has in flight is dropped.
func (p *pipeline) atomicAck(a ackResult) error {
	li := -1
	for i := range p.alanes {
		if p.alanes[i].id == a.atomicID {
			li = i
		}
	}
	if li < 0 || a.atomicID == "" {
		return nil
	}
	l := &p.alanes[li]
	batch := l.events
	l.id, l.events = "", nil
	var api *jetstream.APIError
	switch {
	case errors.As(a.err, &api) && api.ErrorCode == atomicDuplicate:
		// Published one at a time instead (see the top of this file), each timed from its send.
		for _, ev := range batch {
			ev.sentAt.Store(0)
		}
		l.single, l.sent = batch, false
		p.log.Warn("a message with the Nats-Msg-Id of an event is in the stream already: publishing that batch's events one at a time",
			"stream", p.streams[li], "events", len(batch))
	case errors.As(a.err, &api) && api.ErrorCode == atomicTooLarge && len(batch) > 1:
		l.max = max(1, min(l.max, len(batch))/2)
		for _, ev := range batch {
			ev.sentAt.Store(0)
			unbatch(ev.msg)
		}
		p.out = append(batch, p.out...) // the lane's events first again, in order
		p.log.Warn("the server refused an atomic batch as too large (max_batch_size): sending smaller ones",
			"stream", p.streams[li], "events", len(batch), "now", l.max)
	case a.err != nil:
		p.m.errors.WithLabelValues("publish").Inc()
		last := batch[len(batch)-1].msg
		return fmt.Errorf("publish atomic batch of %d events on %s (first %s): %w", len(batch), p.streams[li],
			batch[0].msg.Header.Get(nats.MsgIdHdr), asFencedOut(asStreamFull(a.err, li, p.streams[li], last)))
	default:
		if a.count != uint64(len(batch)) {
			return fmt.Errorf("%w: atomic batch %s stored %d of %d events", errInvalidPubAck, a.atomicID, a.count, len(batch))
		}
		p.fence.ackedAt(li, a.seq)
		for _, ev := range batch {
			p.acked(ev, true)
		}
		p.advance()
	}
	signal(p.kick)
	return nil
}

// atomicSingleAcked takes the PubAck of ev, published on its own after its batch was refused
// for a duplicate, and lets the lane send the next one. mu is held.
func (p *pipeline) atomicSingleAcked(ev *pendingEvent) {
	l := &p.alanes[ev.lane]
	if len(l.single) == 0 || l.single[0] != ev {
		return
	}
	l.single[0] = nil
	l.single, l.sent = l.single[1:], false
	if len(l.single) == 0 {
		l.single = nil
	}
	signal(p.kick)
}
