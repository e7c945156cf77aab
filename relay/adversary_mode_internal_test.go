package relay

// Adversarial step-by-step checks of the switch between publishing event by event and in
// batches (publishMode), with the recording sender of publish_mode_test.go.

import (
	"strconv"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// advIntoBatches takes a fake with batchEnter 4 into batches on conv.a and returns it with one
// open turns batch of 3 messages, all flow-acknowledged.
func advIntoBatches(t *testing.T) *modeFake {
	t.Helper()
	f := newModeFake(t, 4)
	a1, ma1 := named("conv.a")
	items := []item{begin(), a1}
	for range 3 {
		e, _ := named("conv.a")
		items = append(items, e)
	}
	for _, it := range items[1:] {
		it.msg.Subject = "conv.a"
	}
	f.step(t, append(items, commit(10))...)
	require.Equal(t, publishEntering, f.mode)
	f.ackOne(t, ma1)
	require.Equal(t, publishBatches, f.mode)
	f.ackBatch(1, false)
	f.ackBatch(3, false)
	require.Equal(t, []string{"conv.a", "+conv.a#1", "+conv.a#2", "+conv.a#3"}, f.sentFrom(0))
	return f
}

// Leaving batches holds what arrives until every lane's final PubAck, then publishes all of it
// one by one. When what was held is a backlog (the reader fills the window during the round
// trips of the leave: MaxInFlight events, most of them one hot conversation's), the pipeline
// is then event by event with far more than batchEnter outstanding, and it goes back into
// batches only when the reader adds the next event: but the reader waits for room, which
// comes when an eighth of the window is acknowledged, one event per round trip on the hot
// conversation (1,024 round trips at the default MaxInFlight of 8,192). Nothing is lost; the
// catch-up of a hot conversation runs at one event per round trip meanwhile.
//
// Fails on 0d66058: after the final PubAck the 20 held events of conv.a go out one by one,
// each after the previous one's PubAck, although 20 ≥ batchEnter (4) are outstanding.
func TestAdvModeLeavingWithABacklogPublishesItOneByOne(t *testing.T) {
	f := advIntoBatches(t)
	f.entered = time.Now().Add(-f.dwell)
	f.step(t, keepalive(10))
	require.Equal(t, publishLeaving, f.mode)
	require.Equal(t, []string{"EOB"}, f.sentFrom(4))
	items := []item{begin()}
	for range 20 {
		e, _ := named("conv.a")
		e.msg.Subject = "conv.a"
		items = append(items, e)
	}
	f.step(t, append(items, commit(20))...) // held; the reader is now blocked on room (no more input)
	require.Equal(t, 20, f.outstanding())
	f.ackBatch(3, true) // the lane's final PubAck: the leave ends

	// Acknowledge whatever goes out one by one; count it.
	single := 0
	for range 25 {
		last := f.sent[len(f.sent)-1]
		if _, batched := parseBatchToken(last.token); batched {
			break
		}
		if _, err := strconv.ParseUint(last.token, 10, 64); err != nil || f.byID[mustID(t, last.token)] == nil {
			break
		}
		single++
		f.ackOne(t, last.msg)
	}
	require.LessOrEqual(t, single, 1, "a backlog of %d events of one conversation published one round trip at a time (sent: %v)",
		20, f.sentFrom(5))
}

func mustID(t *testing.T, token string) uint64 {
	t.Helper()
	id, err := strconv.ParseUint(token, 10, 64)
	require.NoError(t, err)
	return id
}

// Held: a batch's final PubAck lost while leaving (a connection reset after the end-of-batch
// marker) ends the session after AckTimeout instead of holding the events for ever; the held
// event was never sent, and nothing past the batch is confirmed.
func TestAdvModeLostFinalWhileLeavingTimesOut(t *testing.T) {
	f := advIntoBatches(t)
	f.entered = time.Now().Add(-f.dwell)
	f.step(t, keepalive(10))
	d1, _ := named("conv.a")
	f.step(t, begin(), d1, commit(20))
	require.Equal(t, []string{"EOB"}, f.sentFrom(4))
	require.Error(t, f.checkCommits(time.Now().Add(f.ackTimeout+time.Millisecond)))
	require.Len(t, f.sent, 5, "the held event is not sent")
	require.EqualValues(t, 10, f.lsn())
}

// Held: the flow reply to a batch's first message lost while leaving (the lane is starting)
// ends the session by the ack timeout: the start message is timed like an event.
func TestAdvModeLostStartFlowWhileLeavingTimesOut(t *testing.T) {
	f := newModeFake(t, 2)
	a1, ma1 := named("conv.a")
	a2, _ := named("conv.a")
	a2.msg.Subject, a1.msg.Subject = "conv.a", "conv.a"
	f.step(t, begin(), a1, a2, commit(10))
	f.ackOne(t, ma1) // into batches: a2 opens the turns batch, its flow reply is lost
	require.Equal(t, laneStarting, f.lanes[laneTurns].state)
	f.entered = time.Now().Add(-f.dwell)
	f.step(t, keepalive(10))
	require.Equal(t, publishLeaving, f.mode)
	b1, _ := named("conv.a")
	f.step(t, begin(), b1, commit(20))
	require.Equal(t, []string{"conv.a", "+conv.a#1"}, f.sentFrom(0), "no end of batch before the flow, the new event held")
	require.Error(t, f.checkAckTimeout(time.Now().Add(f.ackTimeout+time.Millisecond)))
}

// Held: an error reply at each state ends the pipeline before anything later of the same
// conversation is sent.
func TestAdvModeErrorReplyAtEachState(t *testing.T) {
	t.Run("entering", func(t *testing.T) {
		f := newModeFake(t, 2)
		a1, ma1 := named("conv.a")
		a2, _ := named("conv.a")
		a2.msg.Subject, a1.msg.Subject = "conv.a", "conv.a"
		f.step(t, begin(), a1, a2, commit(10))
		require.Equal(t, publishEntering, f.mode)
		f.reply(ackResult{id: mustID(t, f.sent[0].token), err: errNoResponders})
		require.True(t, f.stopped)
		f.flush()
		require.Len(t, f.sent, 1)
		_ = ma1
	})
	t.Run("leaving", func(t *testing.T) {
		f := advIntoBatches(t)
		f.entered = time.Now().Add(-f.dwell)
		f.step(t, keepalive(10))
		d1, _ := named("conv.a")
		f.step(t, begin(), d1, commit(20))
		f.reply(ackResult{batch: &batchReply{batchRef: batchRef{id: f.lanes[laneTurns].batch, seq: 4}}, err: errBatchGap})
		require.True(t, f.stopped)
		f.flush()
		require.Len(t, f.sent, 5, "the held event is never sent")
		require.EqualValues(t, 10, f.lsn(), "the batch's events were acknowledged by their flow")
	})
}
