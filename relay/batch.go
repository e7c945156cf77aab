package relay

import (
	"cmp"
	"errors"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/nats-io/nuid"
)

// Batched publishing (JetStream fast-ingest batches, nats-server 2.14 and later, on streams
// with allow_batched): when every stream allows it, the pipeline publishes each stream's
// events as one ordered batch per lane instead of event by event.
//
// A batch is opened by its first message, whose reply tells the flow (the server
// acknowledges every flow messages, and ramps that up); later messages are sent without
// waiting, at most batchWindows flows ahead of the last acknowledgement. The relay asks for
// gap mode "fail": the server stores a batch's messages in the order they were sent, without a
// gap, and stops storing at the first one it cannot store (an error, a lost message, a leader
// change), answering with an error. So a later event of a conversation can never be stored
// when an earlier one was not, whatever the conversations: a batch keeps per-conversation
// order without waiting for each event's PubAck, which is what lets one conversation's
// backlog drain at the rate of many, and its acknowledgements come one per flow messages
// instead of one per event. A failure ends the session, which replays from the confirmed LSN;
// Nats-Msg-Id deduplication skips what was stored (a duplicate counts as stored in a batch).
//
// A lane that has sent nothing for batchIdleCommit, or whose oldest unacknowledged event was
// sent batchMaxWait ago, is committed (an end-of-batch marker, which stores nothing): the
// server then acknowledges every message of the batch, and the batch ends before the server's
// 10 s inactivity limit abandons it. So an event waits at most about batchMaxWait for its
// acknowledgement at any rate: a stream that never pauses gets a flow acknowledgement every
// flow events anyway, and one that trickles slower than that is committed. The next event opens a
// new batch. A lane never has two batches open: the next one starts after the previous one's
// final PubAck, so no failure of an earlier batch can follow a later batch's success.
const (
	// batchFlow is the largest flow the relay allows the server: at most this many messages
	// between acknowledgements.
	batchFlow = 500
	// batchWindows is how many flows may be unacknowledged (the ADR's outstanding acks: 2
	// lets the server store one window while the next is on its way).
	batchWindows = 2
	// batchIdleCommit is how long a lane sends nothing before its batch is committed.
	batchIdleCommit = 2 * time.Millisecond
	// batchMaxWait is how long an event waits for its acknowledgement before its batch is
	// committed, even while the lane keeps sending.
	batchMaxWait = 100 * time.Millisecond
)

// Batches win while the relay is behind: catching up a backlog, or a busy conversation whose
// events would each wait for the previous one's PubAck. At a steady rate the relay keeps up
// with, event by event is quicker: an event goes out at once and its own PubAck answers it,
// where a batch waits for a flow acknowledgement, for the end of a batch and the start of the
// next. So the pipeline switches (publishMode): event by event while it keeps up, into
// batches once batchEnterOutstanding events are outstanding, and back once the walsender says
// it has sent everything (a keepalive, see caughtUp), at least the dwell after entering
// (batchMinDwell, longer when it keeps coming back: see batchReentry).
// Each switch waits until no event published the other way waits for its PubAck, holding
// what arrives meanwhile, so per-subject order holds across it: into batches, once every
// event in flight one by one has its PubAck (events queued behind their subject's then go
// into the batches in arrival order); out of them, once every lane's batch is committed and
// acknowledged.
const (
	// batchEnterOutstanding is how many events outstanding (sent and not acknowledged, or
	// queued behind their subject's) turn event-by-event publishing to batches: never at a
	// rate the relay keeps up with (at 10,000 events/s and a 1 ms round trip, 10 are), at
	// once when catching up or behind a busy conversation.
	batchEnterOutstanding = 256
	// batchBurstSpan: batchEnterOutstanding events arriving within it (10,000 a second or
	// more) are a backlog (see enterWhenBehind).
	batchBurstSpan = 25 * time.Millisecond
	// batchMinDwell is the shortest stay in batches: a relay at the edge of what it keeps up
	// with event by event switches at most some times a second, each switch costing a round
	// trip or two of held events.
	batchMinDwell = 100 * time.Millisecond
	// A relay that enters batches again within batchReentry of leaving them was not keeping up
	// event by event after all (a steady rate at the edge of what it carries that way): each
	// such re-entry doubles its dwell, up to batchMaxDwell, so that it stays in batches, which
	// carry more, instead of switching back and forth, each switch holding new events until
	// what went out the other way is acknowledged. Entering after a longer stay event by event
	// starts again from batchMinDwell. (Measured at 5,000 commits/s on 2 cores with the
	// producers and the database beside it: about 1.5 switches each way a second.)
	batchReentry  = time.Second
	batchMaxDwell = 3200 * time.Millisecond
)

// publishMode is how the pipeline publishes events now, when the streams take batches.
type publishMode int

const (
	publishSingle   publishMode = iota // event by event, each after its subject's previous one's PubAck
	publishEntering                    // into batches: waiting for the events in flight one by one
	publishBatches                     // in each stream's batch
	publishLeaving                     // out of batches: waiting for the lanes' final PubAcks
)

// caughtUp takes a keepalive, which the walsender sends when it has sent all the WAL it knew
// of and the relay has not confirmed it all yet (WalSndWaitForWal): the relay is no longer
// behind, or not by much. In batches for its dwell already, the pipeline leaves them;
// sooner, it leaves at the first event after that. mu is held.
func (p *pipeline) caughtUp(now time.Time) {
	if p.mode != publishBatches || p.alwaysBatches {
		return
	}
	if now.Sub(p.entered) < p.dwell {
		p.wasCaughtUp = true
		return
	}
	p.leaveBatches()
}

// route publishes ev the way the pipeline publishes now, switching it into or out of batches
// as the backlog says (see batchEnterOutstanding). mu is held.
func (p *pipeline) route(ev *pendingEvent) {
	if p.atomic {
		p.publishDeferred(ev) // into its stream's next atomic batch (see atomic.go)
		return
	}
	switch p.mode {
	case publishSingle:
		p.publishOne(ev)
		p.enterWhenBehind()
	case publishBatches:
		if !p.wasCaughtUp || time.Since(p.entered) < p.dwell {
			p.publishDeferred(ev)
			return
		}
		p.leaveBatches()
		p.route(ev) // held, or event by event when the leave ended at once
	default:
		p.hold(ev)
	}
}

// hold keeps ev until the pipeline's switch ends. mu is held.
func (p *pipeline) hold(ev *pendingEvent) {
	p.held = append(p.held, ev)
	p.queued++
}

// enterBatches ends the switch into batches once no event published one by one waits for its
// PubAck: the events queued behind their subject's and those held go into the batches, in
// arrival order. mu is held.
func (p *pipeline) enterBatches() {
	if p.inFlight > 0 {
		return
	}
	evs := p.held
	for subject, q := range p.subjects {
		evs = append(evs, q...)
		delete(p.subjects, subject)
	}
	slices.SortFunc(evs, func(a, b *pendingEvent) int { return cmp.Compare(a.n, b.n) })
	p.held = nil
	p.queued -= len(evs)
	p.mode = publishBatches
	now := time.Now()
	if !p.left.IsZero() && now.Sub(p.left) < batchReentry {
		p.dwell = min(2*p.dwell, batchMaxDwell)
	} else {
		p.dwell = batchMinDwell
	}
	p.entered, p.wasCaughtUp = now, false
	p.setBatching(true)
	p.m.switches.WithLabelValues("batches").Inc()
	for _, ev := range evs {
		p.publish(ev)
	}
}

// leaveBatches starts the switch out of batches: the sender commits every open lane as soon as
// nothing queued is for it, and events arriving meanwhile are held. mu is held.
func (p *pipeline) leaveBatches() {
	p.mode = publishLeaving
	signal(p.laneKick)
	p.leftBatches()
}

// leftBatches ends the switch out of batches once nothing is queued for a batch and every
// lane's batch has its final PubAck: the held events are published one by one. mu is held.
func (p *pipeline) leftBatches() {
	if len(p.out) > 0 {
		return
	}
	for i := range p.lanes {
		if p.lanes[i].state != laneIdle {
			return
		}
	}
	held := p.held
	p.held = nil
	p.queued -= len(held)
	p.mode = publishSingle
	p.left = time.Now()
	p.setBatching(false)
	p.m.switches.WithLabelValues("events").Inc()
	for _, ev := range held {
		p.publishOne(ev)
	}
	// What arrived during the leave may be a backlog (the reader fills the window meanwhile):
	// left one by one, a busy conversation's would go out one round trip at a time until the
	// reader adds its next event, and the reader waits for room, an eighth of the window away.
	p.enterWhenBehind()
}

// enterWhenBehind starts the switch into batches when, event by event, batchEnter events are
// outstanding because the relay is behind: the last batchEnter events arrived within
// batchBurstSpan (a backlog read at full speed), or a quarter of them wait behind an earlier
// event of their subject (a busy conversation). A stall of the server at a steady rate also
// leaves events outstanding, but batches would not help there, and would cost the steady
// rate's latency until the relay leaves them again. mu is held.
func (p *pipeline) enterWhenBehind() {
	if p.mode != publishSingle || !p.batched || p.outstanding() < p.batchEnter {
		return
	}
	back := uint64(p.batchEnter) //nolint:gosec // G115: batchEnter is 1 to batchEnterOutstanding
	first := p.arrivals[(p.arrived-back+1)%batchEnterOutstanding]
	if p.queued >= max(1, p.batchEnter/4) || time.Since(first) < batchBurstSpan {
		p.mode = publishEntering
		p.enterBatches()
	}
}

// setBatching says whether the pipeline publishes in batches now: to the reader, which then
// reads in bulk (see bulkLittle), and in baton_relay_publishing_batches.
func (p *pipeline) setBatching(on bool) {
	p.behind.Store(on)
	if on {
		p.m.batching.Set(1)
	} else {
		p.m.batching.Set(0)
	}
}

// arrive records when event n arrived: enterWhenBehind looks batchEnter events back. mu is
// held.
func (p *pipeline) arrive(n uint64, now time.Time) {
	p.arrivals[n%batchEnterOutstanding] = now
}

// The operations of a fast-ingest batch message, as its reply subject says.
const (
	opStart     = 0 // the first message: the server answers with the flow
	opAppend    = 1
	opCommitEOB = 3 // end of batch, storing nothing: the server answers with the batch's PubAck
)

// Lanes: the streams, each published in batches of its own.
const (
	laneTurns = iota
	laneOutcomes
	laneDeadLetter
	laneCount
)

// laneOf returns the lane of an event.
func laneOf(outcome bool, deadLetter string) int {
	switch {
	case deadLetter != "":
		return laneDeadLetter
	case outcome:
		return laneOutcomes
	}
	return laneTurns
}

type laneState int

const (
	laneIdle       laneState = iota // no batch: the next event opens one
	laneStarting                    // the first message is sent; waiting for the flow
	laneOpen                        // sending
	laneCommitting                  // the end-of-batch marker is sent; waiting for the PubAck
)

// lane is the batch of one stream. It is guarded by the pipeline's mu.
type lane struct {
	state    laneState
	batch    string          // the open batch's id
	seq      uint64          // messages sent in the batch
	acked    uint64          // messages the server stored, as its acknowledgements say
	flow     uint64          // the server acknowledges every flow messages
	subject  string          // of the batch's first message: the end-of-batch marker goes there
	events   []*pendingEvent // sent and not yet acknowledged, in batch order
	lastSend time.Time
	// committed is when the end-of-batch marker was sent: its PubAck is timed like an event's,
	// since every event of the batch may be acknowledged already and later ones wait unsent.
	committed time.Time
}

// batchToken is the reply token of message seq of batch id with operation op: the server reads
// the batch from the reply subject, <inbox>.<id>.<flow>.<gap>.<seq>.<op>.$FI.
func batchToken(id string, seq uint64, op int) string {
	return id + "." + strconv.Itoa(batchFlow) + ".fail." + strconv.FormatUint(seq, 10) + "." + strconv.Itoa(op) + ".$FI"
}

// batchRef is what a reply's subject says: the batch, and the message it answers.
type batchRef struct {
	id  string
	seq uint64
}

// parseBatchToken reads a reply token written by batchToken.
func parseBatchToken(tok string) (batchRef, bool) {
	rest, ok := strings.CutSuffix(tok, ".$FI")
	if !ok {
		return batchRef{}, false
	}
	f := strings.Split(rest, ".")
	if len(f) != 5 {
		return batchRef{}, false
	}
	seq, err := strconv.ParseUint(f[3], 10, 64)
	if err != nil {
		return batchRef{}, false
	}
	return batchRef{id: f[0], seq: seq}, true
}

// batchReply is a reply on a batch: a flow acknowledgement, or the batch's PubAck (final).
type batchReply struct {
	batchRef
	final bool
	acked uint64 // messages 1..acked of the batch are stored
	// streamSeq is, on the batch's PubAck, the stream sequence of its last message.
	streamSeq uint64
	flow      uint64 // a flow acknowledgement's new flow (0: unchanged)
}

// errBatchGap is the error of a batch the server found a message missing from.
var errBatchGap = errors.New("the server missed a message of the batch (gap)")

// errBatchRefused marks an error saying the stream takes no fast-ingest batches (any more:
// someone turned allow_batched off) or refused the batch's form: the streams are checked
// again before the next session, which then publishes event by event unless the check turns
// batches back on.
var errBatchRefused = errors.New("the stream refused the batch")

// batchRefusals are the JetStream error codes of errBatchRefused: batch publish disabled,
// invalid pattern, invalid batch id, unknown batch id (ADR-50).
var batchRefusals = []jetstream.ErrorCode{10205, 10206, 10207, 10208}

// batchResult reads the reply m on batch message ref.
func batchResult(ref batchRef, m *nats.Msg) ackResult {
	res := ackResult{batch: &batchReply{batchRef: ref}}
	if len(m.Data) == 0 {
		res.err = replyError(m) // a NATS status: no responders, or another
		if res.err == nil {
			res.err = fmt.Errorf("%w: empty reply", errInvalidPubAck)
		}
		return res
	}
	a, err := parsePubAck(m.Data)
	switch {
	case err != nil:
		res.err = err
	case a.apiErr != nil && slices.Contains(batchRefusals, a.apiErr.ErrorCode):
		res.err = fmt.Errorf("%w: %w", errBatchRefused, a.apiErr)
	case a.apiErr != nil:
		res.err = a.apiErr
	case a.kind == "ack":
		res.batch.acked, res.batch.flow = a.seq, a.msgs
	case a.kind == "gap":
		res.err = errBatchGap
	case a.kind != "":
		res.err = fmt.Errorf("%w: batch reply of type %q", errInvalidPubAck, a.kind)
	case a.stream == "":
		res.err = fmt.Errorf("%w: no stream in %q", errInvalidPubAck, m.Data)
	default:
		res.batch.final, res.batch.acked, res.batch.streamSeq = true, a.count, a.seq
	}
	return res
}

// sendBatched sends the queued events in batches (see batch.go) and commits idle lanes, and
// reports whether the pipeline goes on. It returns when nothing is left to send now.
func (p *pipeline) sendBatched() bool {
	for {
		for lane := range laneCount {
			if p.halted.Load() || !p.refreshFence(lane) {
				return false
			}
		}
		msg, token, wait := p.nextBatched(time.Now())
		switch {
		case wait:
			if !p.awaitLanes() {
				return false
			}
			continue
		case msg == nil:
			return !p.halted.Load()
		}
		if !p.sendOne(msg, token, msg.Subject) {
			return false
		}
	}
}

// nextBatched returns the next message to send and its reply token: the end-of-batch marker
// of a lane due for its commit (see lane.commitDue) whose next event is not the next to send,
// or the next queued event in its lane's batch, stamped as sent now. wait says the next
// event's lane cannot take it yet (its batch is starting or committing, or its window is
// full). Nothing to send returns a nil msg.
func (p *pipeline) nextBatched(now time.Time) (msg *nats.Msg, token string, wait bool) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.stopped {
		return nil, "", false
	}
	for i := range p.lanes {
		l := &p.lanes[i]
		if l.state == laneOpen && (p.mode == publishLeaving || !now.Before(l.commitDue())) && (len(p.out) == 0 || p.out[0].lane != i) {
			l.state, l.committed = laneCommitting, now
			return nats.NewMsg(l.subject), batchToken(l.batch, l.seq+1, opCommitEOB), false
		}
	}
	if len(p.out) == 0 || !p.out[0].inBatch {
		return nil, "", false // nothing, or sendQueued's
	}
	ev := p.out[0]
	l := &p.lanes[ev.lane]
	op := opAppend
	switch l.state {
	case laneStarting, laneCommitting:
		return nil, "", true
	case laneOpen:
		if l.seq >= l.acked+l.flow*batchWindows {
			return nil, "", true
		}
	case laneIdle:
		*l = lane{state: laneStarting, batch: nuid.Next(), subject: ev.msg.Subject, flow: 1, events: l.events[:0]}
		op = opStart
	}
	p.out[0] = nil
	p.out = p.out[1:]
	p.fence.stamp(ev.msg, ev.lane)
	l.seq++
	ev.bseq = l.seq
	l.events = append(l.events, ev)
	l.lastSend = now
	ev.sentAt.Store(now.UnixNano())
	return ev.msg, batchToken(l.batch, l.seq, op), false
}

// awaitLanes waits until a reply changed a lane, or an idle lane is due for its commit, and
// reports whether the pipeline goes on.
func (p *pipeline) awaitLanes() bool {
	t := time.NewTimer(batchIdleCommit)
	defer t.Stop()
	select {
	case <-p.laneKick:
	case <-t.C:
	case <-p.failed:
		return false
	case <-p.done:
		return false
	}
	return true
}

// nextCommit returns when the next open lane is due for its commit, and whether one is open.
func (p *pipeline) nextCommit() (time.Time, bool) {
	p.mu.Lock()
	defer p.mu.Unlock()
	var due time.Time
	open := false
	for i := range p.lanes {
		if l := &p.lanes[i]; l.state == laneOpen {
			d := l.commitDue()
			if p.mode == publishLeaving {
				d = time.Time{} // now
			}
			if !open || d.Before(due) {
				due, open = d, true
			}
		}
	}
	return due, open
}

// batchAck takes a reply on a batch. mu is held. A reply to a batch no lane has open (a
// previous session's, or one already ended) is dropped.
func (p *pipeline) batchAck(a ackResult) error {
	r := a.batch
	var l *lane
	li := 0
	for i := range p.lanes {
		if p.lanes[i].state != laneIdle && p.lanes[i].batch == r.id {
			l, li = &p.lanes[i], i
		}
	}
	if l == nil {
		return nil
	}
	if a.err != nil {
		p.m.errors.WithLabelValues("publish").Inc()
		msg := nats.NewMsg(l.subject) // the end-of-batch marker, unless an event has r.seq
		for _, ev := range l.events {
			if ev.bseq == r.seq {
				msg = ev.msg
			}
		}
		return fmt.Errorf("publish batch %s, message %d on %s: %w", r.id, r.seq, msg.Subject,
			asFencedOut(asStreamFull(a.err, li, p.streams[li], msg)))
	}
	if r.final {
		if r.acked != l.seq {
			return fmt.Errorf("%w: batch %s stored %d of %d messages", errInvalidPubAck, r.id, r.acked, l.seq)
		}
		p.fence.ackedAt(li, r.streamSeq)
		p.ackBatched(l, l.seq)
		l.state, l.batch = laneIdle, ""
		if p.mode == publishLeaving {
			p.leftBatches()
		}
	} else {
		if l.state == laneStarting {
			l.state = laneOpen
		}
		if r.flow > 0 {
			l.flow = r.flow
		}
		p.ackBatched(l, min(r.acked, l.seq))
	}
	signal(p.laneKick)
	return nil
}

// ackBatched acknowledges the events of l up to batch message upTo. mu is held.
func (p *pipeline) ackBatched(l *lane, upTo uint64) {
	if upTo <= l.acked {
		return
	}
	l.acked = upTo
	n := 0
	for n < len(l.events) && l.events[n].bseq <= upTo {
		p.acked(l.events[n], false)
		l.events[n] = nil
		n++
	}
	l.events = l.events[n:]
	p.advance()
}

// checkCommits fails like checkAckTimeout when a lane's end-of-batch marker waited longer than
// AckTimeout for its PubAck (lost with a dropped connection, or not answered by a replica
// that just lost the stream's leadership). mu is held.
func (p *pipeline) checkCommits(now time.Time) error {
	for i := range p.lanes {
		l := &p.lanes[i]
		if l.state == laneCommitting && now.Sub(l.committed) > p.ackTimeout {
			p.m.errors.WithLabelValues("publish").Inc()
			return fmt.Errorf("commit batch %s on %s: no PubAck within %s", l.batch, l.subject, p.ackTimeout)
		}
	}
	return nil
}

// commitDue returns when an open lane is to be committed: batchIdleCommit after its last
// send, or batchMaxWait after its oldest unacknowledged event was sent, whichever comes first.
func (l *lane) commitDue() time.Time {
	due := l.lastSend.Add(batchIdleCommit)
	if len(l.events) > 0 {
		if sent := time.Unix(0, l.events[0].sentAt.Load()); sent.Add(batchMaxWait).Before(due) {
			due = sent.Add(batchMaxWait)
		}
	}
	return due
}
