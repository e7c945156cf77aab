//go:build adversary

package relay_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// Adversarial tests of batched publishing (dcdddcf) at the relay level. Pipeline-level ones are
// in batch_adversary_internal_test.go. Run with:
//
//	go test -tags adversary -run TestBatchAdversary -count=1 ./relay/

// allow_batched turned off on a running relay's stream (an operator's `nats stream edit`, an
// IaC tool reconciling the stream to a config without the field, the stream deleted and
// recreated by hand): every batch message is refused with "batch publish not enabled"
// (10205), the session ends and the next one publishes in batches again, because nothing
// makes the relay check the streams again (only no responders, max payload and a PubAck
// timeout do). The relay loops forever without publishing anything, although event-by-event
// publishing would work: a permanent outage until the process restarts.
//
// Fails on dcdddcf: the three rows committed after the edit never reach the stream.
func TestBatchAdversaryAllowBatchedTurnedOff(t *testing.T) {
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
		if held = i.State.Msgs; held >= 4 {
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
func TestBatchAdversaryNATSRestartMidBacklog(t *testing.T) {
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
