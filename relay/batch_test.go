package relay_test

import (
	"context"
	"math/rand/v2"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// hotBacklog commits n one-row transactions, all in conversation conv, with one DO block
// (no round trip per transaction): a backlog of one hot conversation, in id order.
func hotBacklog(t *testing.T, b *bundle, conv string, n int) {
	t.Helper()
	require.NoError(t, advBurst(context.Background(), b.db.Pool, conv, "hot", n))
}

// One conversation's backlog, relayed by a relay process killed again and again in the middle
// of it, reaches the stream exactly once and in order: batched publishing keeps a
// conversation's order without waiting for each event's PubAck, across kills and replays.
func TestKillLoopOnAHotConversation(t *testing.T) {
	t.Parallel()
	b := setup(t)
	createConversations(t, b.db.Pool, "hot")
	b.startProcess(t).kill(t) // creates the slot: the backlog below comes through it
	hotBacklog(t, b, "hot", 30000)
	want := truth(t, b.db.Pool)

	for range 6 {
		p := b.startProcess(t)
		p.awaitStreaming(t)
		time.Sleep(time.Duration(20+rand.IntN(200)) * time.Millisecond) // a random moment of the catch-up
		p.kill(t)
	}
	b.startProcess(t)
	msgs := b.waitStream(t, "AGENT_TURNS", len(want), 2*time.Minute)
	assertExactlyOnceInOrder(t, msgs, want)
}
