package relay_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/stretchr/testify/require"

	"github.com/batonhq/baton/wire"
)

// Faults against batched publishing at the relay level, found by an adversarial review of it
// (each "Failed on dcdddcf" test failed on that commit). Pipeline-level ones are in
// batch_fault_internal_test.go.

// allow_batched turned off on a running relay's stream (an operator's `nats stream edit`, an
// IaC tool reconciling the stream to a config without the field, the stream deleted and
// recreated by hand): every batch message is refused with "batch publish not enabled"
// (10205) and the session ends. The relay then checks the streams again before the next
// session (it used to retry batches forever, publishing nothing, until a restart).
//
// Failed on dcdddcf: the three rows committed after the edit never reached the stream.
func TestAllowBatchedTurnedOffWhileRunning(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := ctxT(t, 2*time.Minute)
	createConversations(t, b.db.Pool, "c")
	b.startActive(t)
	want := map[int64]string{}
	id, err := send(ctx, b.db.Pool, "c", "m0")
	require.NoError(t, err)
	want[id] = "c"
	b.waitStream(t, "AGENT_TURNS", 1, 30*time.Second)

	st, err := b.js.Stream(ctx, "AGENT_TURNS")
	require.NoError(t, err)
	cfg := st.CachedInfo().Config
	require.True(t, cfg.AllowBatchPublish, "the relay turned allow_batched on")
	cfg.AllowBatchPublish = false
	info, err := b.js.UpdateStream(ctx, cfg)
	require.NoError(t, err)
	require.False(t, info.CachedInfo().Config.AllowBatchPublish)

	for i := 1; i <= 3; i++ {
		id, err := send(ctx, b.db.Pool, "c", fmt.Sprintf("m%d", i))
		require.NoError(t, err)
		want[id] = "c"
	}
	deadline := time.Now().Add(20 * time.Second)
	var held uint64
	for time.Now().Before(deadline) {
		s, err := b.js.Stream(context.Background(), "AGENT_TURNS")
		require.NoError(t, err)
		i, err := s.Info(context.Background())
		require.NoError(t, err)
		if held = i.State.Msgs - fenceMsgs(context.Background(), t, s); held >= 4 {
			break
		}
		time.Sleep(50 * time.Millisecond)
	}
	require.EqualValues(t, 4, held, "rows committed after allow_batched was turned off never published (20s)")
	assertExactlyOnceInOrder(t, b.readStream(t, "AGENT_TURNS"), want)
}

// NATS stopped and started again in the middle of one conversation's backlog: batches die
// with the server, nats.go replays its reconnect buffer into a server that knows none of them.
// Expected to hold (exactly once, in order).
func TestNATSRestartMidHotBacklog(t *testing.T) {
	t.Parallel()
	b := setup(t)
	createConversations(t, b.db.Pool, "hot")
	r := b.startActive(t)
	_ = r
	hotBacklog(t, b, "hot", 20000)
	want := truth(t, b.db.Pool)
	b.waitStreamCount(t, "AGENT_TURNS", 2000, time.Minute)
	b.nats.Stop()
	time.Sleep(300 * time.Millisecond)
	require.NoError(t, b.nats.Start())
	msgs := b.waitStream(t, "AGENT_TURNS", len(want), 2*time.Minute)
	assertExactlyOnceInOrder(t, msgs, want)
	requireSlotCaughtUp(t, b)
}

// The lost-commit stall of TestLostCommitPubAckEndsTheSession on a real server and a
// real network fault: the relay's connection is reset after the flow acknowledgement of a
// batch's only event arrived and before the end-of-batch commit's PubAck did. nats.go
// reconnects and the pipeline never hears of it: the commit's PubAck is timed like an event's,
// so the session ends after AckTimeout and the next one publishes the turn (it used to stay
// "committing" forever: the next turn was never published and never timed out).
//
// The server acknowledges every message (flow 1) because another fast batch is open on the
// stream (here the test's own, kept alive by pings; in production another fast publisher,
// or the relay's previous session's abandoned batch). A proxy latency of 200 ms per chunk
// makes the window between the two replies 400 ms wide.
//
// Failed on dcdddcf (when the reset lands in the window, which the log says): the second
// turn never reached the stream. With ClassicPublish the same test passed.
func TestResetBeforeTheCommitPubAck(t *testing.T) {
	t.Parallel()
	resetBeforeCommitAck(t, false)
}

func resetBeforeCommitAck(t *testing.T, classic bool) {
	b := setup(t)
	b.cfg.ClassicPublish = classic
	ctx := ctxT(t, 2*time.Minute)
	proxy, nc := b.proxiedNATS(t)
	b.cfg.NATS = nc
	createConversations(t, b.db.Pool, "c")
	b.startActive(t)

	// A fast batch of the test's own on AGENT_TURNS (one stored message, no outbox id), open
	// for the whole test.
	foreign, err := wire.TurnSubject("agent", "foreign")
	require.NoError(t, err)
	inbox := nats.NewInbox()
	replies, err := b.nc.SubscribeSync(inbox + ".>")
	require.NoError(t, err)
	t.Cleanup(func() { _ = replies.Unsubscribe() })
	if classic { // the relay did not enable it
		s, err := b.js.Stream(ctx, "AGENT_TURNS")
		require.NoError(t, err)
		cfg := s.CachedInfo().Config
		cfg.AllowBatchPublish = true
		_, err = b.js.UpdateStream(ctx, cfg)
		require.NoError(t, err)
	}
	m := nats.NewMsg(foreign)
	m.Data = []byte("foreign")
	m.Reply = inbox + ".FOREIGN.1.fail.1.0.$FI"
	require.NoError(t, b.nc.PublishMsg(m))
	r, err := replies.NextMsg(5 * time.Second)
	require.NoError(t, err)
	t.Logf("foreign batch opened: %s", r.Data)
	stopPing := make(chan struct{})
	pinged := make(chan struct{})
	go func() {
		defer close(pinged)
		for {
			select {
			case <-stopPing:
				return
			case <-time.After(2 * time.Second):
				_ = b.nc.PublishRequest(foreign, inbox+".FOREIGN.1.fail.1.4.$FI", nil)
			}
		}
	}()
	t.Cleanup(func() { close(stopPing); <-pinged })
	b.waitStreamCount(t, "AGENT_TURNS", 1, 10*time.Second)

	proxy.SetLatency(200 * time.Millisecond)
	want := map[int64]string{}
	id, err := send(ctx, b.db.Pool, "c", "m1")
	require.NoError(t, err)
	want[id] = "c"
	start := time.Now()
	b.waitStreamCount(t, "AGENT_TURNS", 2, 10*time.Second)
	stored := time.Since(start)
	// Stored at ~200 ms after the send; the flow acks reach the relay at ~400 ms, the commit
	// goes out then and its PubAck comes back at ~800 ms.
	time.Sleep(350 * time.Millisecond)
	proxy.ResetAll()
	proxy.SetLatency(0)
	t.Logf("event stored %s after the commit, connection reset %s after it", stored, time.Since(start))

	id, err = send(ctx, b.db.Pool, "c", "m2")
	require.NoError(t, err)
	want[id] = "c"
	deadline := time.Now().Add(4 * b.cfg.AckTimeout)
	var n uint64
	for time.Now().Before(deadline) {
		s, err := b.js.Stream(context.Background(), "AGENT_TURNS")
		require.NoError(t, err)
		info, err := s.Info(context.Background())
		require.NoError(t, err)
		if n = info.State.Msgs - fenceMsgs(context.Background(), t, s); n >= 3 {
			break
		}
		time.Sleep(50 * time.Millisecond)
	}
	require.EqualValues(t, 3, n, "the turn committed after the reset was never published within %s (AckTimeout %s)",
		4*b.cfg.AckTimeout, b.cfg.AckTimeout)
	var ours []got
	for _, g := range b.readStream(t, "AGENT_TURNS") {
		if g.subject != foreign {
			ours = append(ours, g)
		}
	}
	assertExactlyOnceInOrder(t, ours, want)
}

// The same fault with ClassicPublish (the control of the test above).
func TestResetBeforeThePubAckClassic(t *testing.T) {
	t.Parallel()
	resetBeforeCommitAck(t, true)
}
