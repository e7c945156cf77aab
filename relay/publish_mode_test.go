package relay

import (
	"context"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/stretchr/testify/require"
)

// The pipeline publishes event by event while it keeps up and in batches while it is behind
// (see publishMode in batch.go). These tests check that its switches keep every subject's
// order: step by step with a recording sender, and end to end against a real server.

// modeFake is a pipeline whose streams take batches, publishing through a sender that records
// each message with its reply token; the test gives the replies. Its sender's clock stands
// still (clock), so no lane is committed for being idle (batchIdleCommit, 2 ms) unless a test
// says so: a test on a loaded machine takes longer than that between two steps.
type modeFake struct {
	*pipeline
	sent  []sentMsg
	clock time.Time
}

type sentMsg struct {
	msg   *nats.Msg
	token string
}

func newModeFake(t *testing.T, enter int) *modeFake {
	t.Helper()
	var confirmed atomic.Uint64
	cfg := Config{DatabaseURL: "x", NATS: &nats.Conn{}, MaxInFlight: 1000}
	require.NoError(t, cfg.fill())
	f := &modeFake{clock: time.Now()}
	f.pipeline = newPipeline(&cfg, newMetrics(nil), &confirmed, func(func(ackResult)) (sendFunc, func(), error) {
		return func(m *nats.Msg, token string) error {
			f.sent = append(f.sent, sentMsg{m, token})
			return nil
		}, func() {}, nil
	}, true)
	f.batchEnter = enter
	_, ok := f.openSend()
	require.True(t, ok)
	return f
}

// flush sends what the sender would send now, without waiting for any reply.
func (f *modeFake) flush() {
	for {
		n := len(f.sent)
		f.sendQueued()
		for {
			msg, token, wait := f.nextBatched(f.clock)
			if msg == nil || wait {
				break
			}
			f.sendOne(msg, token, msg.Subject)
		}
		if len(f.sent) == n {
			return
		}
	}
}

func (f *modeFake) step(t *testing.T, items ...item) {
	t.Helper()
	for _, it := range items {
		require.NoError(t, f.handle(it))
		f.flush()
	}
}

// subjects returns the subjects of the messages sent from the n-th on, "EOB" for an end of
// batch; a message sent in a batch is marked with a +.
func (f *modeFake) sentFrom(n int) []string {
	var out []string
	for _, s := range f.sent[n:] {
		ref, batched := parseBatchToken(s.token)
		switch {
		case !batched:
			out = append(out, s.msg.Subject)
		case strings.HasSuffix(s.token, "."+strconv.Itoa(opCommitEOB)+".$FI"):
			out = append(out, "EOB")
		default:
			out = append(out, "+"+s.msg.Subject+"#"+strconv.FormatUint(ref.seq, 10))
		}
	}
	return out
}

// ackOne gives the PubAck of the message sent event by event on m.
func (f *modeFake) ackOne(t *testing.T, m *nats.Msg) {
	t.Helper()
	for _, s := range f.sent {
		if s.msg == m {
			id, err := strconv.ParseUint(s.token, 10, 64)
			require.NoError(t, err, "%s was sent in a batch", m.Subject)
			f.reply(ackResult{id: id})
			f.flush()
			return
		}
	}
	t.Fatalf("%s was never sent", m.Subject)
}

// ackBatch gives the reply on the open turns batch: a flow acknowledgement of acked messages,
// or the final PubAck.
func (f *modeFake) ackBatch(acked uint64, final bool) {
	f.reply(ackResult{batch: &batchReply{batchRef: batchRef{id: f.lanes[laneTurns].batch, seq: acked},
		acked: acked, flow: 500, final: final}})
	f.flush()
}

func named(subject string) (item, *nats.Msg) {
	m := nats.NewMsg(subject)
	m.Header.Set(nats.MsgIdHdr, subject)
	return item{kind: itemEvent, msg: m}, m
}

// Into batches: once batchEnter events are outstanding, nothing more goes out until every
// event in flight one by one has its PubAck; then the events queued behind their subject's
// and those that arrived meanwhile go into the batch in arrival order. Without the wait, a2
// could be stored before a1 failed.
func TestSwitchIntoBatchesWaitsForTheEventsInFlight(t *testing.T) {
	f := newModeFake(t, 4)
	a1, ma1 := named("conv.a1")
	a2, _ := named("conv.a2")
	b1, mb1 := named("conv.b1")
	a3, _ := named("conv.a3")
	c1, _ := named("conv.c1")
	for _, e := range []item{a1, a2, a3} {
		e.msg.Subject = "conv.a" // one conversation
	}
	f.step(t, begin(), a1, a2, b1, a3) // outstanding: a1 and b1 in flight, a2 and a3 queued
	require.Equal(t, publishEntering, f.mode)
	f.step(t, c1, commit(10))
	require.Equal(t, []string{"conv.a", "conv.b1"}, f.sentFrom(0), "nothing more before the events in flight are acknowledged")

	f.ackOne(t, ma1)
	require.Equal(t, []string{"conv.a", "conv.b1"}, f.sentFrom(0), "a2 waits for b1 too: it is to go in a batch")
	f.ackOne(t, mb1)
	require.Equal(t, publishBatches, f.mode)
	require.Equal(t, []string{"+conv.a#1"}, f.sentFrom(2), "the batch opens with the first queued event")
	f.ackBatch(1, false) // the flow
	require.Equal(t, []string{"+conv.a#1", "+conv.a#2", "+conv.c1#3"}, f.sentFrom(2), "then the rest, in arrival order")
	require.EqualValues(t, 1, counterValue(t, f.m.switches.WithLabelValues("batches")))

	// Out of batches: the walsender's keepalive (it sent all it had) after batchMinDwell
	// turns the pipeline back; the next event is held until the batch is committed and
	// acknowledged, then published event by event.
	f.entered = time.Now().Add(-f.dwell)
	f.step(t, keepalive(15))
	require.Equal(t, publishLeaving, f.mode)
	d1, md1 := named("conv.a")
	f.step(t, begin(), d1, commit(20))
	require.Equal(t, []string{"EOB"}, f.sentFrom(5), "the lane is committed at once, the event held")
	require.Zero(t, f.lsn())
	f.ackBatch(3, true)
	require.Equal(t, publishSingle, f.mode)
	require.Equal(t, []string{"EOB", "conv.a"}, f.sentFrom(5), "d1 goes out event by event after the batch's final PubAck")
	require.EqualValues(t, 15, f.lsn(), "the batch and the keepalive after it")
	f.ackOne(t, md1)
	require.EqualValues(t, 20, f.lsn())
	require.EqualValues(t, 1, counterValue(t, f.m.switches.WithLabelValues("events")))
	require.Zero(t, f.outstanding())
}

func (f *modeFake) lsn() uint64 { return f.confirmed.Load() }

// cycle takes the pipeline into batches with two events of one conversation, and, when leave
// is set, out again on a keepalive after the dwell, acknowledging everything on the way.
func (f *modeFake) cycle(t *testing.T, lsn uint64, leave bool) {
	t.Helper()
	e1, m1 := named("conv.hot")
	e2, _ := named("conv.hot")
	n := len(f.sent)
	f.step(t, begin(), e1, e2, commit(lsn))
	require.Equal(t, publishEntering, f.mode)
	f.ackOne(t, m1)
	require.Equal(t, publishBatches, f.mode)
	require.Equal(t, []string{"conv.hot", "+conv.hot#1"}, f.sentFrom(n))
	f.ackBatch(1, false)
	if !leave {
		return
	}
	f.entered = time.Now().Add(-f.dwell)
	f.step(t, keepalive(lsn+1))
	require.Equal(t, publishLeaving, f.mode)
	f.ackBatch(1, true)
	require.Equal(t, publishSingle, f.mode)
	require.Zero(t, f.outstanding())
}

// A relay that comes back into batches soon after leaving them was not keeping up event by
// event: each such re-entry doubles its dwell, up to batchMaxDwell, so that a rate at the
// edge of what event by event carries stays in batches instead of switching back and forth.
// A re-entry after a longer stay event by event starts from batchMinDwell again.
func TestReentrySoonAfterLeavingDoublesTheDwell(t *testing.T) {
	f := newModeFake(t, 2)
	f.cycle(t, 10, true)
	require.Equal(t, batchMinDwell, f.dwell, "a first entry")
	f.cycle(t, 20, false)
	require.Equal(t, 2*batchMinDwell, f.dwell, "back within batchReentry")

	// A keepalive after batchMinDwell no longer ends batches; one after the doubled dwell does.
	f.entered = time.Now().Add(-batchMinDwell)
	f.step(t, keepalive(21))
	require.Equal(t, publishBatches, f.mode, "within the doubled dwell")
	f.entered = time.Now().Add(-f.dwell)
	f.step(t, keepalive(22))
	require.Equal(t, publishLeaving, f.mode)
	f.ackBatch(1, true)
	require.Equal(t, publishSingle, f.mode)

	for range 10 {
		f.cycle(t, 30, true)
	}
	require.Equal(t, batchMaxDwell, f.dwell, "the dwell grows no further")

	f.left = time.Now().Add(-batchReentry)
	f.cycle(t, 40, false)
	require.Equal(t, batchMinDwell, f.dwell, "a relay that kept up event by event for a while starts over")
}

// A keepalive sooner than batchMinDwell after entering batches is remembered: the first
// event after the dwell turns the pipeline back to event by event (here at once, the lane
// being idle). A lane committed while in batches does not: a quiet lane is no sign that the
// relay caught up (it may be starved of CPU, or waiting for room).
func TestKeepaliveDuringTheDwellEndsBatchesAfterIt(t *testing.T) {
	f := newModeFake(t, 2)
	a1, ma1 := named("conv.a")
	a2, _ := named("conv.a")
	f.step(t, begin(), a1, a2, commit(10))
	require.Equal(t, publishEntering, f.mode)
	f.ackOne(t, ma1)
	require.Equal(t, publishBatches, f.mode)
	f.ackBatch(1, false)
	f.step(t, keepalive(10))
	require.Equal(t, publishBatches, f.mode, "within the dwell")
	f.lanes[laneTurns].lastSend = time.Now().Add(-time.Second) // quiet since
	f.flush()
	require.Equal(t, []string{"conv.a", "+conv.a#1", "EOB"}, f.sentFrom(0), "the quiet lane is committed")
	f.ackBatch(1, true)
	require.Equal(t, publishBatches, f.mode, "a quiet lane ends no batching")
	require.EqualValues(t, 10, f.lsn())

	f.entered = time.Now().Add(-f.dwell)
	b1, _ := named("conv.b")
	f.step(t, begin(), b1, commit(20))
	require.Equal(t, publishSingle, f.mode)
	require.Equal(t, []string{"conv.b"}, f.sentFrom(3), "sent event by event")
}

// End to end on a real server: bursts (one busy conversation and a few others) and trickles
// between them switch the pipeline into batches and back several times; every event is
// stored once, each subject's in the order given, and the last transaction is confirmed.
func TestSwitchingModesKeepsOrderAndStoresOnce(t *testing.T) {
	t.Parallel()
	nc := connectNATS(t)
	st := batchStream(t, nc, -1)
	var confirmed atomic.Uint64
	cfg := Config{DatabaseURL: "x", NATS: nc, AckTimeout: 10 * time.Second}
	require.NoError(t, cfg.fill())
	p := newPipeline(&cfg, newMetrics(nil), &confirmed, natsSender(nc), true)
	done := make(chan error, 1)
	go func() { done <- p.run(nil, nil, 0) }()
	ctx := context.Background()

	want := map[string][]string{}
	n, lsn := 0, uint64(0)
	emit := func(items ...item) {
		require.NoError(t, p.feed(ctx, items...))
	}
	tx := func(subjects ...string) {
		items := []item{begin()}
		for _, s := range subjects {
			items = append(items, batchEvent(s, n, 50))
			want[s] = append(want[s], "e"+strconv.Itoa(n))
			n++
		}
		lsn += 10
		emit(append(items, commit(lsn))...)
	}
	for round := range 3 {
		var burst []string
		for i := range 1500 {
			s := "batch.hot"
			if i%3 == 0 {
				s = "batch.c" + strconv.Itoa(i%7)
			}
			burst = append(burst, s)
		}
		for i := 0; i < len(burst); i += 100 {
			tx(burst[i : i+100]...)
		}
		// A trickle, each transaction followed by the keepalive of a walsender that sent all
		// it had, for longer than batchMinDwell, and long enough that the next burst is no
		// quick re-entry, which would double the dwell (see batchReentry). This pacing shapes
		// the input; no result depends on its timing.
		for i := range 15 {
			tx("batch.hot", "batch.c"+strconv.Itoa((round+i)%7))
			emit(keepalive(lsn))
			time.Sleep(batchReentry / 12)
		}
	}
	p.closeInput()
	select {
	case err := <-done:
		require.NoError(t, err)
	case <-time.After(60 * time.Second):
		t.Fatal("the pipeline did not end")
	}
	require.Equal(t, lsn, confirmed.Load())
	got := map[string][]string{}
	ids := storedIDs(t, st)
	require.Len(t, ids, n, "each event stored once")
	for seq, id := range ids {
		m, err := st.GetMsg(ctx, uint64(seq+1))
		require.NoError(t, err)
		got[m.Subject] = append(got[m.Subject], id)
	}
	require.Equal(t, want, got, "each subject's events in the order given")
	require.GreaterOrEqual(t, counterValue(t, p.m.switches.WithLabelValues("batches")), 3.0, "each burst went in batches")
	require.GreaterOrEqual(t, counterValue(t, p.m.switches.WithLabelValues("events")), 3.0, "each trickle went event by event")
}

// Events left outstanding by a stalled server at a steady rate do not turn the pipeline to
// batches, which would not help there; a busy conversation's events queued behind each other
// do, whatever the rate.
func TestStallAtASteadyRateStaysEventByEvent(t *testing.T) {
	f := newModeFake(t, 4)
	f.step(t, begin())
	long := time.Now().Add(-time.Second)
	for i := range 4 {
		e, _ := named("conv.c" + strconv.Itoa(i))
		f.step(t, e)
		f.arrivals[f.arrived%batchEnterOutstanding] = long.Add(time.Duration(i) * 100 * time.Millisecond) // a steady rate
	}
	require.Equal(t, publishSingle, f.mode, "4 outstanding, arrived over 300 ms")
	again, _ := named("conv.c0") // queued behind conv.c0's first event
	f.step(t, again)
	require.Equal(t, publishEntering, f.mode, "an event waits behind its subject's")
}
