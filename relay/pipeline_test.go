package relay

import (
	"context"
	"errors"
	"strconv"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pglogrepl"
	"github.com/nats-io/nats.go"
	"github.com/stretchr/testify/require"
)

// fakePipeline is a pipeline whose publishes are recorded instead of sent, so the delivery
// rules can be checked step by step. Replies are given to it by the test (reply, ack).
type fakePipeline struct {
	*pipeline
	sent   []*nats.Msg
	ids    map[*nats.Msg]uint64  // the id each message was published with
	refuse func(*nats.Msg) error // when set, the error of a send (nil: sent)
}

func newFakePipeline(t *testing.T, maxPending int) *fakePipeline {
	t.Helper()
	var confirmed atomic.Uint64
	cfg := Config{DatabaseURL: "x", NATS: &nats.Conn{}, MaxInFlight: maxPending}
	require.NoError(t, cfg.fill())
	f := &fakePipeline{ids: map[*nats.Msg]uint64{}}
	f.pipeline = newPipeline(&cfg, newMetrics(nil), &confirmed, f.openFake, false)
	_, ok := f.openSend() // as the sender does first
	require.True(t, ok)
	return f
}

// openFake is the fake's openSender: it records what is sent, and replies come from the test.
func (f *fakePipeline) openFake(func(ackResult)) (sendFunc, func(), error) {
	send := func(msg *nats.Msg, token string) error {
		id, err := strconv.ParseUint(token, 10, 64)
		if err != nil {
			return err
		}
		if f.refuse != nil {
			if err := f.refuse(msg); err != nil {
				return err
			}
		}
		f.sent = append(f.sent, msg)
		f.ids[msg] = id
		return nil
	}
	return send, func() {}, nil
}

// step handles items and sends what they queued, as the sender would.
func (f *fakePipeline) step(t *testing.T, items ...item) {
	t.Helper()
	for _, it := range items {
		require.NoError(t, f.handle(it))
		f.sendQueued()
	}
}

func (f *fakePipeline) ackMsg(t *testing.T, m *nats.Msg) {
	t.Helper()
	id, ok := f.ids[m]
	require.True(t, ok, "acknowledging a message never published")
	require.NoError(t, f.ack(ackResult{id: id}))
	f.sendQueued()
}

func (f *fakePipeline) lsn() pglogrepl.LSN { return pglogrepl.LSN(f.confirmed.Load()) }

func begin() item               { return item{kind: itemBegin} }
func commit(lsn uint64) item    { return item{kind: itemCommit, lsn: pglogrepl.LSN(lsn)} }
func keepalive(lsn uint64) item { return item{kind: itemKeepalive, lsn: pglogrepl.LSN(lsn)} }
func event(subj string) (item, *nats.Msg) {
	m := nats.NewMsg(subj)
	return item{kind: itemEvent, msg: m}, m
}

func TestConfirmWaitsForEveryAckOfTheTransaction(t *testing.T) {
	f := newFakePipeline(t, 100)
	e1, m1 := event("a")
	e2, m2 := event("b")
	f.step(t, begin(), e1, e2, commit(100))
	require.Zero(t, f.lsn(), "nothing acknowledged yet")
	f.ackMsg(t, m2)
	require.Zero(t, f.lsn(), "one event of the transaction still unacknowledged")
	f.ackMsg(t, m1)
	require.EqualValues(t, 100, f.lsn())
}

func TestConfirmOnlyTheAcknowledgedPrefix(t *testing.T) {
	f := newFakePipeline(t, 100)
	e1, m1 := event("a")
	e2, m2 := event("b")
	e3, m3 := event("c")
	f.step(t, begin(), e1, commit(100), begin(), e2, commit(200), begin(), e3, commit(300))
	f.ackMsg(t, m3)
	f.ackMsg(t, m2)
	require.Zero(t, f.lsn(), "later transactions acknowledged first must wait for the first")
	f.ackMsg(t, m1)
	require.EqualValues(t, 300, f.lsn())
}

func TestKeepaliveConfirmsOnlyWhenNothingIsOutstanding(t *testing.T) {
	f := newFakePipeline(t, 100)
	e1, m1 := event("a")
	f.step(t, keepalive(50))
	require.EqualValues(t, 50, f.lsn(), "an idle outbox confirms the server's WAL end")

	f.step(t, begin(), e1, keepalive(500))
	require.EqualValues(t, 50, f.lsn(), "a keepalive inside a transaction is never confirmed")
	f.step(t, commit(100), keepalive(600))
	require.EqualValues(t, 50, f.lsn(), "a keepalive behind an unacknowledged transaction waits")
	f.ackMsg(t, m1)
	require.EqualValues(t, 600, f.lsn(), "then it is confirmed with the transaction")
}

func TestEmptyTransactionConfirmsAtCommit(t *testing.T) {
	f := newFakePipeline(t, 100)
	f.step(t, begin(), item{kind: itemIgnored}, commit(70))
	require.EqualValues(t, 70, f.lsn())
}

func TestOneEventInFlightPerSubject(t *testing.T) {
	f := newFakePipeline(t, 100)
	a1, ma1 := event("conv.a")
	a2, ma2 := event("conv.a")
	b1, mb1 := event("conv.b")
	f.step(t, begin(), a1, a2, b1, commit(10))
	require.Equal(t, []*nats.Msg{ma1, mb1}, f.sent, "the second event of conv.a waits for the first's PubAck")
	f.ackMsg(t, ma1)
	require.Equal(t, []*nats.Msg{ma1, mb1, ma2}, f.sent)
	f.ackMsg(t, mb1)
	f.ackMsg(t, ma2)
	require.EqualValues(t, 10, f.lsn())
	require.Empty(t, f.subjects)
}

func TestPublishErrorEndsThePipeline(t *testing.T) {
	f := newFakePipeline(t, 100)
	e1, m1 := event("a")
	f.step(t, begin(), e1, commit(10))
	err := f.ack(ackResult{id: f.ids[m1], err: errors.New("boom")})
	require.ErrorContains(t, err, "boom")
	require.Zero(t, f.lsn())
}

// A send that fails (nats.go refused the message, the connection closed) stops the pipeline
// like a failed PubAck: nothing queued behind it goes out, nothing is confirmed.
func TestSendErrorEndsThePipeline(t *testing.T) {
	f := newFakePipeline(t, 100)
	f.refuse = func(msg *nats.Msg) error {
		if msg.Subject == "b" {
			return errors.New("boom")
		}
		return nil
	}
	a1, _ := event("a")
	b1, _ := event("b")
	c1, _ := event("c")
	require.NoError(t, f.handle(begin()))
	for _, it := range []item{a1, b1, c1} {
		ok, err := f.add(it)
		require.NoError(t, err)
		require.True(t, ok)
	}
	require.False(t, f.sendQueued())
	select {
	case <-f.failed:
	default:
		t.Fatal("a failed send must stop the pipeline")
	}
	require.ErrorContains(t, f.err, "boom")
	require.Len(t, f.sent, 1, "nothing after the failed send goes out")
	_, err := f.add(commit(10))
	require.ErrorIs(t, err, errStopped)
	require.Zero(t, f.lsn())
}

func TestAddWaitsForRoomBelowTheLowWaterMark(t *testing.T) {
	f := newFakePipeline(t, 8)
	f.step(t, begin())
	var msgs []*nats.Msg
	for i := range 8 {
		e, m := event(string(rune('a' + i)))
		ok, err := f.add(e)
		require.NoError(t, err)
		require.True(t, ok)
		msgs = append(msgs, m)
	}
	f.sendQueued()
	e, _ := event("z")
	ok, err := f.add(e)
	require.NoError(t, err)
	require.False(t, ok, "MaxInFlight events are outstanding")
	f.reply(ackResult{id: f.ids[msgs[0]]})
	select {
	case <-f.room:
	default:
		t.Fatal("room not signalled at the low-water mark")
	}
	ok, err = f.add(e)
	require.NoError(t, err)
	require.True(t, ok)
}

func TestNothingIsPublishedOrConfirmedAfterAFailure(t *testing.T) {
	f := newFakePipeline(t, 100)
	a1, ma1 := event("a")
	a2, _ := event("a")
	b1, mb1 := event("b")
	f.step(t, begin(), a1, a2, b1, commit(10))
	f.reply(ackResult{id: f.ids[mb1], err: errors.New("boom")})
	select {
	case <-f.failed:
	default:
		t.Fatal("a failed publish must stop the pipeline")
	}
	require.ErrorContains(t, f.err, "boom")
	f.reply(ackResult{id: f.ids[ma1]})
	f.sendQueued()
	require.Len(t, f.sent, 2, "the event queued behind a1 is not published after the failure")
	require.Zero(t, f.lsn())
	_, err := f.add(keepalive(50))
	require.ErrorIs(t, err, errStopped)
}

func TestReplyToAnUnknownEventIsIgnored(t *testing.T) {
	f := newFakePipeline(t, 100)
	e1, m1 := event("a")
	f.step(t, begin(), e1, commit(10))
	f.reply(ackResult{id: 999})
	f.reply(ackResult{id: 998, err: errors.New("late reply of an earlier session")})
	f.reply(ackResult{id: f.ids[m1]})
	require.EqualValues(t, 10, f.lsn())
}

// The ack timeout counts from the hand-off to nats.go: events queued behind a slow send are not
// timed (a long queue of large events on a slow link is progress), the event in the send is.
func TestAckTimeoutCountsFromTheSend(t *testing.T) {
	f := newFakePipeline(t, 100)
	e1, _ := event("a")
	require.NoError(t, f.handle(begin()))
	ok, err := f.add(e1)
	require.NoError(t, err)
	require.True(t, ok)
	later := time.Now().Add(2 * f.ackTimeout)
	require.NoError(t, f.tick(later), "queued, not sent: not timed")
	f.sendQueued()
	require.NoError(t, f.tick(time.Now()))
	require.ErrorContains(t, f.tick(time.Now().Add(2*f.ackTimeout)), "no PubAck within")
}

// The sender goroutine publishes through the openSender the pipeline was given and stops what
// it opened: with one that acknowledges each publish at once, run confirms the transaction and
// returns once the input is closed.
func TestRunPublishesThroughItsSender(t *testing.T) {
	var confirmed atomic.Uint64
	cfg := Config{DatabaseURL: "x", NATS: &nats.Conn{}}
	require.NoError(t, cfg.fill())
	var sent, stopped atomic.Int64
	p := newPipeline(&cfg, newMetrics(nil), &confirmed, func(deliver func(ackResult)) (sendFunc, func(), error) {
		send := func(_ *nats.Msg, token string) error {
			id, err := strconv.ParseUint(token, 10, 64)
			if err != nil {
				return err
			}
			sent.Add(1)
			deliver(ackResult{id: id})
			return nil
		}
		return send, func() { stopped.Add(1) }, nil
	}, false)
	done := make(chan error, 1)
	go func() { done <- p.run(nil, nil, 0) }()
	e1, _ := event("a")
	e2, _ := event("a")
	require.NoError(t, p.feed(context.Background(), begin(), e1, e2, commit(10)))
	p.closeInput()
	select {
	case err := <-done:
		require.NoError(t, err)
	case <-time.After(10 * time.Second):
		t.Fatal("run did not return")
	}
	require.EqualValues(t, 10, confirmed.Load())
	require.EqualValues(t, 2, sent.Load())
	require.Eventually(t, func() bool { return stopped.Load() == 1 }, 10*time.Second, 10*time.Millisecond,
		"the sender stops what it opened")
}

// A sender that cannot open (the PubAck subscription failed) fails the pipeline.
func TestRunFailsWhenItsSenderCannotOpen(t *testing.T) {
	var confirmed atomic.Uint64
	cfg := Config{DatabaseURL: "x", NATS: &nats.Conn{}}
	require.NoError(t, cfg.fill())
	p := newPipeline(&cfg, newMetrics(nil), &confirmed, func(func(ackResult)) (sendFunc, func(), error) {
		return nil, nil, errors.New("no subscription")
	}, false)
	require.ErrorContains(t, p.run(nil, nil, 0), "no subscription")
	_, err := p.add(begin())
	require.ErrorIs(t, err, errStopped)
}
