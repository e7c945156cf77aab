package relay

import (
	"context"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pglogrepl"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/stretchr/testify/require"

	"github.com/batonhq/baton/wire"
)

// Adversarial tests of the stream fence, the replay check and atomic batches. Each is a pure
// unit test (no server): it drives the code the way the reader and the sender do.

// advAtomicPipeline returns a pipeline that publishes in atomic batches, with room for
// everything the tests add.
func advAtomicPipeline(t *testing.T) *pipeline {
	t.Helper()
	cfg := &Config{MaxInFlight: 10_000, MaxInFlightBytes: 1 << 30, AckTimeout: 10 * time.Second,
		TurnsStream: "AGENT_TURNS", OutcomesStream: "AGENT_OUTCOMES", DeadLetterStream: "AGENT_DEADLETTER"}
	p := newPipeline(cfg, newMetrics(nil), &atomic.Uint64{}, nil, false)
	p.atomic = true
	return p
}

func advOutcome(subject, id string, size int) item {
	m := nats.NewMsg(subject)
	m.Header.Set(nats.MsgIdHdr, id)
	m.Data = []byte(strings.Repeat("x", size))
	return item{kind: itemEvent, msg: m, outcome: true}
}

func advAdd(t *testing.T, p *pipeline, items ...item) {
	t.Helper()
	for _, it := range items {
		ok, err := p.add(it)
		require.NoError(t, err)
		require.True(t, ok)
	}
}

// nextAtomic skips an event of the lane that does not fit the batch's bytes but takes a later,
// smaller one of the same lane: the later event of a conversation goes out (and is stored)
// before the earlier one. Once the session ends between the two batches, the next session's
// replay check finds the later one stored and skips the earlier one for good.
func TestAdvFenceAtomicBatchKeepsSubjectOrderAcrossTheByteLimit(t *testing.T) {
	p := advAtomicPipeline(t)
	const subj = "agent.outcomes.conv1"
	advAdd(t, p, begin(),
		advOutcome(subj, "outcome:1", 3<<20), // 3 MiB: a long reply
		advOutcome(subj, "outcome:2", 2<<20), // does not fit the rest of atomicMaxBytes
		advOutcome(subj, "outcome:3", 100),   // fits
		commit(100))
	msgs, _ := p.nextAtomic(laneOutcomes, time.Now())
	var ids []string
	for _, m := range msgs {
		ids = append(ids, m.Header.Get(nats.MsgIdHdr))
	}
	require.Equal(t, []string{"outcome:1"}, ids,
		"the first batch must stop at the first event of the lane that does not fit; it took a later event of the same conversation ahead of outcome:2")
}

// A held batch of the replay check that starts inside a transaction (the 512th event, a read
// timeout or a keepalive fell inside it) is decided with commit LSN 0 for the events before
// the next Begin: stored() then finds every one of them "at or before" the subject's last
// stored event and skips it, though no session ever stored it. The confirmed LSN then passes
// the transaction: the events are lost.
func TestAdvFenceReplayBatchSplitInsideATransactionSkipsNewEvents(t *testing.T) {
	const subj = "agent.outcomes.conv1"
	c := &replayCheck{to: pglogrepl.LSN(0x1000), m: newMetrics(nil), last: map[string]*lastStored{
		// An event an earlier session stored long ago, at commit LSN 0/100.
		subj: {lsn: pglogrepl.LSN(0x100), msgID: "outcome:old"},
	}}
	ctx := context.Background()
	tx := pglogrepl.LSN(0x800) // a transaction after it: none of its events is stored
	c.hold(item{kind: itemBegin, lsn: tx})
	c.hold(advOutcome(subj, "outcome:a", 10))
	held, start, wants := c.take() // the reader decides here (decideReplay on a read timeout)
	require.Empty(t, wants, "the subject was looked up already")
	out, err := c.decide(ctx, held, start, nil)
	require.NoError(t, err)
	require.Len(t, out, 2, "Begin and outcome:a go out")

	c.hold(advOutcome(subj, "outcome:b", 10)) // the same transaction, second held batch
	c.hold(item{kind: itemCommit, lsn: tx + 0x30})
	held, start, _ = c.take()
	out, err = c.decide(ctx, held, start, nil)
	require.NoError(t, err)
	var ids []string
	for _, it := range out {
		if it.kind == itemEvent {
			ids = append(ids, it.msg.Header.Get(nats.MsgIdHdr))
		}
	}
	require.Equal(t, []string{"outcome:b"}, ids, "outcome:b (commit 0/800, after the last stored 0/100) was skipped as stored")
}

// Shards share the dead-letter subjects (<prefix>.deadletter.<kind> names no slot). The last
// record on one is then often another shard's, at a later LSN: a shard's replay skips its own
// records that no session stored, and the changes they stand for are skipped without a record.
func TestAdvFenceReplaySkipsDeadLettersByAnotherShardsRecord(t *testing.T) {
	subj := wire.DeadLetterSubject("agent", wire.DeadLetterTurn)
	c := &replayCheck{to: pglogrepl.LSN(0x9000), m: newMetrics(nil), last: map[string]*lastStored{
		subj: {lsn: pglogrepl.LSN(0x8000), msgID: "deadletter:0/7FF0"}, // shard 1's newest record
	}}
	rec := nats.NewMsg(subj)
	rec.Header.Set(nats.MsgIdHdr, "deadletter:0/5000")
	c.hold(item{kind: itemBegin, lsn: 0x5010})
	c.hold(item{kind: itemEvent, msg: rec, deadLetter: wire.DeadLetterTurn}) // shard 0's, never stored
	c.hold(item{kind: itemCommit, lsn: 0x5020})
	held, start, _ := c.take()
	out, err := c.decide(context.Background(), held, start, nil)
	require.NoError(t, err)
	require.Len(t, out, 3, "shard 0's dead-letter record was skipped because of shard 1's later record on the shared subject")
}

// The decoder sizes an outcome to the server's max payload; the reader then adds
// Baton-Commit-Lsn and the sender the two fence headers (and, in atomic batches, three batch
// headers). An outcome sized near the limit then exceeds it: nats.go refuses it
// (ErrMaxPayload), the session ends and replays the same outcome, for ever (DESIGN 9).
func TestAdvFenceHeadersPushAnOutcomeOverTheMaxPayload(t *testing.T) {
	const maxPayload = 64 << 10
	ev := wire.OutcomeEvent{ConversationID: "conv1", MessageID: "m1", Role: "assistant"}
	var msg *nats.Msg
	// The longest content that the decoder publishes with its content.
	lo, hi := 0, maxPayload
	for lo < hi {
		mid := (lo + hi + 1) / 2
		ev.Content = strings.Repeat("y", mid)
		m, err := outcomeMsg("agent", ev, "", (&Relay{maxPayload: maxPayload}).eventPayload())
		require.NoError(t, err)
		if m.Header.Get(wire.HeaderContentOmitted) == "" {
			lo = mid
		} else {
			hi = mid - 1
		}
	}
	ev.Content = strings.Repeat("y", lo)
	msg, err := outcomeMsg("agent", ev, "", (&Relay{maxPayload: maxPayload}).eventPayload())
	require.NoError(t, err)
	require.Empty(t, msg.Header.Get(wire.HeaderContentOmitted))
	require.LessOrEqual(t, msgSize(msg.Header, msg.Data), maxPayload, "the decoder's own bound")

	// What reader.handleCopyData adds, then what the sender stamps.
	msg.Header[wire.HeaderCommitLSN] = []string{pglogrepl.LSN(0x16B3748AB).String()}
	f := &sessionFence{}
	f.state[laneOutcomes].on = true
	f.lanes[laneOutcomes] = laneFence{header: []string{"123456"}, subj: []string{wire.FenceSubject("agent", wire.KindOutcomes, "baton_0")}}
	f.stamp(msg, laneOutcomes)
	require.LessOrEqual(t, msgSize(msg.Header, msg.Data), maxPayload,
		"an outcome the decoder let through exceeds the max payload once the relay's own headers are added")
}

// After an atomic batch is refused for a duplicate, its events go one at a time, but those
// still waiting keep the sentAt of the refused batch: checkAckTimeout fails the session
// AckTimeout after the batch went out, whatever the singles' progress (256 singles at 40 ms
// each on a replicated stream is 10 s).
func TestAdvFenceSinglesAfterADuplicateKeepTheBatchClock(t *testing.T) {
	p := advAtomicPipeline(t)
	const subj = "agent.outcomes.conv1"
	advAdd(t, p, begin(), advOutcome(subj, "outcome:1", 10), advOutcome(subj, "outcome:2", 10),
		advOutcome(subj, "outcome:3", 10), commit(100))
	sent := time.Now().Add(-p.ackTimeout + time.Second) // the batch went out 9 s ago
	msgs, _ := p.nextAtomic(laneOutcomes, sent)
	require.Len(t, msgs, 3)
	p.mu.Lock()
	require.NoError(t, p.atomicAck(ackResult{atomicID: p.alanes[laneOutcomes].id,
		err: &jetstream.APIError{Code: 400, ErrorCode: atomicDuplicate, Description: "atomic publish batch contains duplicate message id"}}))
	p.mu.Unlock()

	now := time.Now()
	single, _ := p.nextAtomic(laneOutcomes, now) // the first one goes out now
	require.Len(t, single, 1)
	// Two seconds later the first single is still within its AckTimeout, and the others were
	// never sent since the refusal.
	p.mu.Lock()
	err := p.checkAckTimeout(now.Add(2 * time.Second))
	p.mu.Unlock()
	require.NoError(t, err, "events waiting to go out one at a time were timed from the refused batch")
}
