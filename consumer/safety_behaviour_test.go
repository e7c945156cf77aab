package consumer_test

import (
	"context"
	"errors"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"

	"github.com/batonhq/baton/consumer"
	"github.com/batonhq/baton/internal/testsvc"
	"github.com/batonhq/baton/wire"
)

// A write tool that returned an error may still have had its effect (a timeout
// after the request went out): the turn is never replayed, whatever the operation's status.
func TestWriteToolErrorIsNotRetried(t *testing.T) {
	for _, src := range sources {
		t.Run(string(src), func(t *testing.T) {
			t.Parallel()
			b := setup(t, src)
			var writes atomic.Int32
			b.worker(consumer.Config{BackoffBase: 10 * time.Millisecond, Handler: func(ctx context.Context, turn *consumer.Turn) (consumer.Reply, error) {
				_, err := turn.Tool(ctx, "charge_card", consumer.Write, nil, func(context.Context) (any, error) {
					writes.Add(1)
					return nil, errors.New("timeout awaiting the payment provider's answer")
				})
				return consumer.Reply{}, err
			}})
			b.conversation("c")
			b.send("c", "m1", "pay")
			b.waitTerminal(time.Minute)
			require.EqualValues(t, 1, writes.Load(), "the write tool ran twice")
			require.Equal(t, []string{"error"}, testsvc.Query[string](t, b.db, `SELECT status FROM agent_outbox`))
			require.Len(t, testsvc.Query[string](t, b.db, `SELECT id FROM messages WHERE role = 'error'`), 1)
		})
	}
}

// A write tool cut short by shutdown (ShutdownGrace ran out) may have had its
// effect: the turn ends as a visible failure, not released for another worker to replay.
func TestShutdownDuringAWriteToolEndsVisibly(t *testing.T) {
	t.Parallel()
	b := setup(t, polling)
	entered := make(chan struct{})
	var writes atomic.Int32
	handler := func(ctx context.Context, turn *consumer.Turn) (consumer.Reply, error) {
		_, err := turn.Tool(ctx, "send_email", consumer.Write, nil, func(ctx context.Context) (any, error) {
			if writes.Add(1) == 1 {
				close(entered)
			}
			<-ctx.Done() // an HTTP call cancelled mid-flight
			return nil, ctx.Err()
		})
		return consumer.Reply{}, err
	}
	stop := b.worker(consumer.Config{ShutdownGrace: 50 * time.Millisecond, Handler: handler})
	b.conversation("c")
	b.send("c", "m1", "email them")
	<-entered
	stop()
	require.Equal(t, []string{"error"}, testsvc.Query[string](t, b.db, `SELECT status FROM agent_outbox`), "released after a write started")
	require.Len(t, testsvc.Query[string](t, b.db, `SELECT id FROM messages WHERE role = 'error'`), 1)
	require.Equal(t, []int{1}, testsvc.Query[int](t, b.db, `SELECT count(*)::int FROM operations WHERE effect = 'write'`))

	// A new worker does not run the write again: its next turn in the conversation is m2's.
	b.worker(consumer.Config{Handler: echo})
	b.send("c", "m2", "and now?")
	b.waitTerminal(time.Minute)
	require.EqualValues(t, 1, writes.Load())
	require.Equal(t, []string{"error", "done"}, testsvc.Query[string](t, b.db, `SELECT status FROM agent_outbox ORDER BY id`))
}

// What a user sees of a failure is a generic message; the detail (redacted) goes to
// last_error and agent_runs.error.
func TestFailureTextIsGenericAndDetailRedacted(t *testing.T) {
	t.Parallel()
	b := setup(t, polling)
	b.worker(consumer.Config{MaxAttempts: 1, Handler: func(context.Context, *consumer.Turn) (consumer.Reply, error) {
		return consumer.Reply{}, errors.New(`Post "https://bot:s3cr3tpw@api.example.com/v1/chat?api_key=k-12345678": SQLSTATE 42P01 relation "secret_table" does not exist`)
	}})
	b.conversation("c")
	b.send("c", "m1", "hi")
	b.waitTerminal(time.Minute)
	shown := testsvc.Query[string](t, b.db, `SELECT content FROM messages WHERE role = 'error'`)
	require.Len(t, shown, 1)
	for _, leak := range []string{"s3cr3tpw", "k-12345678", "secret_table", "42P01", "api.example.com"} {
		require.NotContains(t, shown[0], leak, "the visible message carries internal error text")
	}
	for _, q := range []string{`SELECT last_error FROM agent_outbox`, `SELECT error FROM agent_runs`} {
		detail := testsvc.Query[string](t, b.db, q)[0]
		require.Contains(t, detail, "secret_table", "the detail is kept for operators")
		require.NotContains(t, detail, "s3cr3tpw")
		require.NotContains(t, detail, "k-12345678")
	}
}

// The attempt cap applies to each row's own attempts: a new message claimed with a
// row that already failed twice does not fail on its first attempt.
func TestAttemptsArePerRow(t *testing.T) {
	t.Parallel()
	b := setup(t, polling)
	b.conversation("c")
	old := b.send("c", "m1", "poison")
	_, err := b.db.Pool.Exec(context.Background(), `UPDATE agent_outbox SET attempts = 2 WHERE id = $1`, old)
	require.NoError(t, err)
	fresh := b.send("c", "m2", "fine")
	b.worker(consumer.Config{MaxAttempts: 3, BackoffBase: 10 * time.Millisecond, Handler: func(ctx context.Context, turn *consumer.Turn) (consumer.Reply, error) {
		for _, m := range turn.Messages {
			if m.Content == "poison" {
				return consumer.Reply{}, errors.New("cannot answer this one")
			}
		}
		return echo(ctx, turn)
	}})
	b.waitTerminal(time.Minute)
	require.Equal(t, []string{"error 3"}, testsvc.Query[string](t, b.db, `SELECT status || ' ' || attempts FROM agent_outbox WHERE id = $1`, old))
	require.Equal(t, []string{"done"}, testsvc.Query[string](t, b.db, `SELECT status FROM agent_outbox WHERE id = $1`, fresh),
		"the new message failed on its first attempt")
	require.Equal(t, []string{"echo: fine"}, testsvc.Query[string](t, b.db, `SELECT content FROM messages WHERE role = 'assistant'`))
}

// A message larger than a turn may carry ends as a visible failure at once, without
// a handler call and without a retry loop; the conversation's next message still gets its turn.
func TestOversizeMessageFailsVisiblyOnce(t *testing.T) {
	t.Parallel()
	b := setup(t, polling)
	var calls atomic.Int32
	var shown atomic.Value
	b.worker(consumer.Config{MaxTurnBytes: 1 << 10, BackoffBase: 10 * time.Millisecond,
		FailureMessage: func(err error) string {
			shown.Store(err)
			if errors.Is(err, consumer.ErrMessageTooLarge) {
				return "That message is too long."
			}
			return "Something went wrong."
		},
		Handler: func(ctx context.Context, turn *consumer.Turn) (consumer.Reply, error) {
			calls.Add(1)
			return echo(ctx, turn)
		}})
	b.conversation("c")
	big := b.send("c", "m1", strings.Repeat("x", 2<<10))
	small := b.send("c", "m2", "short")
	b.waitTerminal(time.Minute)
	require.Equal(t, []string{"error 1"}, testsvc.Query[string](t, b.db, `SELECT status || ' ' || attempts FROM agent_outbox WHERE id = $1`, big))
	require.Equal(t, []string{"done"}, testsvc.Query[string](t, b.db, `SELECT status FROM agent_outbox WHERE id = $1`, small))
	require.Equal(t, []string{"That message is too long.", "echo: short"},
		testsvc.Query[string](t, b.db, `SELECT content FROM messages WHERE role <> 'user' ORDER BY created_at`))
	require.EqualValues(t, 1, calls.Load(), "the handler saw only the short message")
	require.ErrorIs(t, shown.Load().(error), consumer.ErrMessageTooLarge)
}

// A forged turn event naming a conversation id Postgres cannot hold (a NUL byte) is terminated
// as malformed: it never joins a claim, where it would fail every conversation claimed with it.
func TestForgedEventWithUnstorableConversationID(t *testing.T) {
	t.Parallel()
	b := setup(t, jetStream)
	js, err := jetstream.New(b.nc)
	require.NoError(t, err)
	m := nats.NewMsg("agent.turns.forged")
	m.Header.Set(wire.HeaderOutboxID, "77")
	m.Data = []byte(`{"outbox_id":77,"conversation_id":"a\u0000b","message_id":"x","status":"pending","created_at":"2026-11-30T00:00:00Z"}`)
	_, err = js.PublishMsg(context.Background(), m)
	require.NoError(t, err)
	reg := prometheus.NewRegistry()
	b.worker(consumer.Config{Registerer: reg})
	b.conversation("c")
	b.send("c", "m1", "hi")
	b.waitTerminal(time.Minute)
	require.Eventually(t, func() bool { return counter(t, reg, "baton_worker_events_total", "terminated") == 1 },
		30*time.Second, 10*time.Millisecond, "the forged event was not terminated")
	require.Equal(t, []string{"echo: hi"}, testsvc.Query[string](t, b.db, `SELECT content FROM messages WHERE role = 'assistant'`))
}
