package consumer_test

import (
	"context"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/batonhq/baton/consumer"
	"github.com/batonhq/baton/producer"
)

// historyLog records, per turn (named by its first message), the turn's messages and what
// History returned to it, as "role:content".
type historyLog struct {
	mu    sync.Mutex
	turns map[string][2][]string
}

func (l *historyLog) handler(gate func(*consumer.Turn)) consumer.Handler {
	return func(ctx context.Context, t *consumer.Turn) (consumer.Reply, error) {
		gate(t)
		h, err := t.History(ctx, 50)
		if err != nil {
			return consumer.Reply{}, err
		}
		var claimed, seen []string
		for _, m := range t.Messages {
			claimed = append(claimed, m.Role+":"+m.Content)
		}
		for _, m := range h {
			seen = append(seen, m.Role+":"+m.Content)
		}
		l.mu.Lock()
		l.turns[t.Messages[0].ID] = [2][]string{claimed, seen}
		l.mu.Unlock()
		return echo(ctx, t)
	}
}

func (l *historyLog) turn(t *testing.T, first string) (claimed, history []string) {
	t.Helper()
	l.mu.Lock()
	defer l.mu.Unlock()
	got, ok := l.turns[first]
	require.True(t, ok, "no turn began with %s", first)
	return got[0], got[1]
}

// History is the conversation's user messages whose turns ended before this turn's claim, each
// followed by its reply, in the order their turns were claimed: never a message pending at the
// claim, never one this turn claimed, whatever the senders' transactions' start times (a
// message's created_at is its sender's transaction's start, and SendTx may run inside a long
// transaction that started before later messages were sent and claimed).
func TestHistoryIsTheTurnsThatEndedBeforeTheClaim(t *testing.T) {
	ctx := context.Background()
	b := setup(t, polling)
	p := b.prod
	// begin starts a sender's transaction now; its messages are sent later.
	begin := func() func(conv, id, content string) {
		tx, err := b.app.Begin(ctx)
		require.NoError(t, err)
		_, err = tx.Exec(ctx, `SELECT now()`)
		require.NoError(t, err)
		t.Cleanup(func() { _ = tx.Rollback(ctx) })
		return func(conv, id, content string) {
			_, err := p.SendTx(ctx, tx, producer.Message{ConversationID: conv, ID: id, Content: content})
			require.NoError(t, err)
			require.NoError(t, tx.Commit(ctx))
		}
	}

	// Conversation "together": d0's sender began before d1 was sent, and both committed before
	// any claim, so one turn claims [d1, d0] (outbox id order). Its history holds neither.
	b.conversation("together")
	late := begin()
	time.Sleep(5 * time.Millisecond) // created_at of d1 after d0's
	b.send("together", "d1", "one")
	late("together", "d0", "zero")

	// Conversation "apart": a0's sender began before a1 was sent; a1's turn is claimed and
	// waits until a0 committed, then reads its history: a0 is pending, not history. a0's own
	// turn comes next and sees a1 and its reply.
	b.conversation("apart")
	late = begin()
	time.Sleep(5 * time.Millisecond)
	b.send("apart", "a1", "one")

	started, release := make(chan struct{}), make(chan struct{})
	log := &historyLog{turns: map[string][2][]string{}}
	b.worker(consumer.Config{Handler: log.handler(func(t *consumer.Turn) {
		if t.Messages[0].ID == "a1" {
			close(started)
			<-release
		}
	})})
	select {
	case <-started:
	case <-time.After(time.Minute):
		t.Fatal("a1's turn did not start within a minute")
	}
	late("apart", "a0", "zero")
	close(release)
	b.waitTerminal(time.Minute)

	claimed, history := log.turn(t, "d1")
	require.Equal(t, []string{"user:one", "user:zero"}, claimed)
	require.Empty(t, history, "a turn's history holds none of its own messages")

	claimed, history = log.turn(t, "a1")
	require.Equal(t, []string{"user:one"}, claimed)
	require.Empty(t, history, "a message pending at the claim is not history")
	claimed, history = log.turn(t, "a0")
	require.Equal(t, []string{"user:zero"}, claimed)
	require.Equal(t, []string{"user:one", "assistant:echo: one"}, history,
		"the turn claimed first comes first, whatever its message's created_at")

	// Later turns see every earlier one in claim order, each message followed by its reply.
	b.send("together", "d2", "two")
	b.send("apart", "a2", "two")
	b.waitTerminal(time.Minute)
	_, history = log.turn(t, "d2")
	require.Equal(t, []string{"user:one", "user:zero", "assistant:echo: one | zero"}, history)
	_, history = log.turn(t, "a2")
	require.Equal(t, []string{"user:one", "assistant:echo: one", "user:zero", "assistant:echo: zero"}, history)
}
