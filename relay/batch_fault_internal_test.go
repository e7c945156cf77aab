package relay

import (
	"context"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/stretchr/testify/require"
)

// Faults against batched publishing at the pipeline level (see batch_fault_test.go for the
// relay-level ones).

// startBatched runs a batched pipeline publishing through open and returns it with run's
// result channel; the pipeline is aborted when the test ends.
func startBatched(t *testing.T, nc *nats.Conn, open openSender, ackTimeout time.Duration) (*pipeline, *atomic.Uint64, chan error) {
	t.Helper()
	confirmed := new(atomic.Uint64)
	cfg := Config{DatabaseURL: "x", NATS: nc, AckTimeout: ackTimeout, alwaysBatches: true}
	require.NoError(t, cfg.fill())
	p := newPipeline(&cfg, newMetrics(nil), confirmed, open, true)
	abort := make(chan struct{})
	done := make(chan error, 1)
	go func() { done <- p.run(abort, nil, 0) }()
	t.Cleanup(func() {
		close(abort)
		select {
		case <-p.done:
		case <-time.After(10 * time.Second):
			t.Error("pipeline did not stop")
		}
	})
	return p, confirmed, done
}

// The end-of-batch commit is the only message of a batch that is not an event: when every
// event of the batch was already covered by a flow acknowledgement and the commit's final
// PubAck never arrives, only the commit's own timing ends the session; without it the lane
// stayed "committing" forever, every later event of that stream waited behind it unsent and
// untimed, and the confirmed LSN stopped while the relay looked healthy.
//
// Lost here by dropping the final PubAck in the sender's deliver function. On a real server it
// is lost when the EOB (or its reply) dies with a connection (nats.go reconnects without the
// pipeline noticing), and in a cluster whenever the EOB reaches a replica that just lost
// leadership: processJetStreamFastBatchMsg returns NewJSClusterNotLeaderError() there without
// any reply. A batch whose events are all flow-acknowledged before its EOB is the common case:
// a burst of exactly flow events (here 500), or any batch at flow 1 (the server's initial flow
// whenever the stream has another fast batch open, e.g. the previous session's abandoned one).
//
// Failed on dcdddcf: the second transaction was never confirmed and run never returned.
func TestLostCommitPubAckEndsTheSession(t *testing.T) {
	t.Parallel()
	nc := connectNATS(t)
	batchStream(t, nc, -1)
	var dropped atomic.Int32
	open := func(deliver func(ackResult)) (sendFunc, func(), error) {
		return natsSender(nc)(func(a ackResult) {
			if a.batch != nil && a.batch.final && a.err == nil {
				dropped.Add(1) // the commit's final PubAck is lost
				return
			}
			deliver(a)
		})
	}
	const ackTimeout = 2 * time.Second
	p, confirmed, done := startBatched(t, nc, open, ackTimeout)
	ctx := context.Background()

	// A burst of exactly batchFlow events: the server's flow acknowledgement at 500 covers all.
	items := []item{begin()}
	for i := range batchFlow {
		items = append(items, batchEvent("batch.hot", i, 10))
	}
	items = append(items, commit(100))
	require.NoError(t, p.feed(ctx, items...))
	require.Eventually(t, func() bool { return confirmed.Load() == 100 }, 10*time.Second, 5*time.Millisecond,
		"the burst is confirmed by its flow acknowledgement")
	require.Eventually(t, func() bool { return dropped.Load() == 1 }, 10*time.Second, 5*time.Millisecond,
		"the lane was committed and its final PubAck dropped")

	// One more event of the same stream.
	require.NoError(t, p.feed(ctx, begin(), batchEvent("batch.hot", 1000, 10), commit(200)))
	p.closeInput()
	select {
	case err := <-done:
		// Either outcome is sound: an error ends the session, which replays from the confirmed LSN.
		if err == nil {
			require.EqualValues(t, 200, confirmed.Load())
		}
		t.Logf("pipeline ended: %v", err)
	case <-time.After(4 * ackTimeout):
		p.mu.Lock()
		l := p.lanes[laneTurns]
		state, queued, inFlight := l.state, len(p.out), p.inFlight
		p.mu.Unlock()
		t.Fatalf("stalled: %s after the event, confirmed %d (want 200 or an error), lane state %d (3 = committing), "+
			"%d event(s) queued unsent, %d in flight, no ack timeout (AckTimeout %s)",
			4*ackTimeout, confirmed.Load(), state, queued, inFlight, ackTimeout)
	}
}
