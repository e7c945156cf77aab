package consumer_test

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strconv"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"
	"github.com/stretchr/testify/require"

	"github.com/batonhq/baton/consumer"
	"github.com/batonhq/baton/internal/testsvc"
	"github.com/batonhq/baton/producer"
	"github.com/batonhq/baton/wire"
)

func TestAlwaysFailingHandlerEndsInOneVisibleError(t *testing.T) {
	for _, src := range sources {
		t.Run(string(src), func(t *testing.T) {
			t.Parallel()
			b := setup(t, src)
			var calls atomic.Int32
			b.worker(consumer.Config{
				MaxAttempts: 3,
				BackoffBase: 10 * time.Millisecond,
				Handler: func(context.Context, *consumer.Turn) (consumer.Reply, error) {
					calls.Add(1)
					return consumer.Reply{}, errors.New("model unavailable")
				},
			})
			b.conversation("c")
			b.send("c", "m1", "hi")
			b.waitTerminal(time.Minute)
			require.EqualValues(t, 3, calls.Load(), "one call per attempt, no more")
			require.Equal(t, []string{"error"}, testsvc.Query[string](t, b.db, `SELECT status FROM agent_outbox`))
			require.Equal(t, []int{3}, testsvc.Query[int](t, b.db, `SELECT attempts FROM agent_outbox`))
			errs := testsvc.Query[string](t, b.db, `SELECT content FROM messages WHERE role = 'error'`)
			require.Len(t, errs, 1, "exactly one visible error message")
			require.Equal(t, consumer.DefaultFailureMessage(nil), errs[0], "users see a generic message")
			require.Empty(t, testsvc.Query[string](t, b.db, `SELECT id FROM messages WHERE role = 'assistant'`))
			reason := testsvc.Query[string](t, b.db, `SELECT last_error FROM agent_outbox`)
			require.Equal(t, "attempts exhausted after 3 attempts: model unavailable", reason[0])
			// No more attempts after the cap.
			time.Sleep(200 * time.Millisecond) // a quiet period in which nothing may happen; not a synchronisation
			require.EqualValues(t, 3, calls.Load())
		})
	}
}

func TestConversationDeletedMidTurn(t *testing.T) {
	for _, src := range sources {
		t.Run(string(src), func(t *testing.T) {
			t.Parallel()
			b := setup(t, src)
			entered := make(chan struct{})
			proceed := make(chan struct{})
			var calls atomic.Int32
			reg := prometheus.NewRegistry()
			b.worker(consumer.Config{Registerer: reg, Handler: func(ctx context.Context, turn *consumer.Turn) (consumer.Reply, error) {
				if calls.Add(1) == 1 {
					close(entered)
					<-proceed
				}
				return echo(ctx, turn)
			}})
			b.conversation("doomed")
			b.send("doomed", "m1", "hi")
			select {
			case <-entered:
			case <-time.After(time.Minute):
				t.Fatal("turn never started")
			}
			_, err := b.db.Pool.Exec(context.Background(), `DELETE FROM conversations WHERE id = 'doomed'`)
			require.NoError(t, err)
			close(proceed)
			require.Eventually(t, func() bool { return counter(t, reg, "baton_worker_turns_total", "cancelled") == 1 },
				time.Minute, 10*time.Millisecond)
			require.Empty(t, testsvc.Query[string](t, b.db, `SELECT id FROM conversations`), "nothing recreated")
			require.Empty(t, testsvc.Query[string](t, b.db, `SELECT id FROM messages`))
			require.Empty(t, testsvc.Query[int64](t, b.db, `SELECT id FROM agent_outbox`))
			require.EqualValues(t, 1, calls.Load(), "no error loop")
			if src == jetStream {
				b.requireAllAcked()
			}
		})
	}
}

func TestMessageDuringTurnGoesToTheNextTurn(t *testing.T) {
	for _, src := range sources {
		t.Run(string(src), func(t *testing.T) {
			t.Parallel()
			b := setup(t, src)
			entered := make(chan struct{}, 10)
			proceed := make(chan struct{})
			b.worker(consumer.Config{Handler: func(ctx context.Context, turn *consumer.Turn) (consumer.Reply, error) {
				entered <- struct{}{}
				if turn.Messages[0].ID == "m1" {
					<-proceed
				}
				return echo(ctx, turn)
			}})
			b.conversation("c")
			first := b.send("c", "m1", "first")
			<-entered
			second := b.send("c", "m2", "second")
			close(proceed)
			b.waitTerminal(time.Minute)
			runs := testsvc.Query[[]int64](t, b.db, `SELECT outbox_ids FROM agent_runs WHERE outcome = 'done' ORDER BY started_at`)
			require.Equal(t, [][]int64{{first}, {second}}, runs)
			replies := testsvc.Query[string](t, b.db, `SELECT content FROM messages WHERE role = 'assistant' ORDER BY created_at`)
			require.Equal(t, []string{"echo: first", "echo: second"}, replies)
		})
	}
}

func TestBurstIsOneTurn(t *testing.T) {
	for _, src := range sources {
		t.Run(string(src), func(t *testing.T) {
			t.Parallel()
			b := setup(t, src)
			b.conversation("c")
			// Sent before any worker runs: the first claim takes all of them, in order.
			for i := range 5 {
				b.send("c", fmt.Sprintf("m%d", i), strconv.Itoa(i))
			}
			b.worker(consumer.Config{})
			b.waitTerminal(time.Minute)
			require.Equal(t, []string{"echo: 0 | 1 | 2 | 3 | 4"}, testsvc.Query[string](t, b.db, `SELECT content FROM messages WHERE role = 'assistant'`))
		})
	}
}

func TestDuplicateEventsRunOneTurn(t *testing.T) {
	t.Parallel()
	b := setup(t, jetStream)
	b.conversation("c")
	id := b.send("c", "m1", "hi")
	// The same outbox id published twice more under other Msg-Ids (a replay past the
	// duplicate window), so the consumer delivers three events for one row.
	js, err := jetstream.New(b.nc)
	require.NoError(t, err)
	ctx := context.Background()
	s, err := js.Stream(ctx, "AGENT_TURNS")
	require.NoError(t, err)
	var orig *jetstream.RawStreamMsg
	require.Eventually(t, func() bool {
		orig, err = s.GetLastMsgForSubject(ctx, "agent.turns.>") // the event, not the relay's fence
		return err == nil
	}, time.Minute, 10*time.Millisecond)
	for i := range 2 {
		m := nats.NewMsg(orig.Subject)
		for k, v := range orig.Header {
			m.Header[k] = append([]string(nil), v...)
		}
		// A copy carries no fence: the relay's session fence would refuse it.
		delete(m.Header, jetstream.ExpectedLastSubjSeqHeader)
		delete(m.Header, jetstream.ExpectedLastSubjSeqSubjHeader)
		m.Header.Set(nats.MsgIdHdr, fmt.Sprintf("replay-%d", i))
		m.Data = orig.Data
		_, err := js.PublishMsg(ctx, m)
		require.NoError(t, err)
	}
	var calls atomic.Int32
	b.worker(consumer.Config{Handler: func(ctx context.Context, turn *consumer.Turn) (consumer.Reply, error) {
		calls.Add(1)
		return echo(ctx, turn)
	}})
	b.waitTerminal(time.Minute)
	b.requireAllAcked()
	require.EqualValues(t, 1, calls.Load())
	require.Equal(t, []int64{id}, testsvc.Query[int64](t, b.db, `SELECT id FROM agent_outbox WHERE status = 'done'`))
	require.Len(t, testsvc.Query[string](t, b.db, `SELECT id FROM messages WHERE role = 'assistant'`), 1)
}

func TestWriteToolFailureIsNotRetried(t *testing.T) {
	for _, src := range sources {
		t.Run(string(src), func(t *testing.T) {
			t.Parallel()
			b := setup(t, src)
			var calls atomic.Int32
			b.worker(consumer.Config{BackoffBase: 10 * time.Millisecond, Handler: func(ctx context.Context, turn *consumer.Turn) (consumer.Reply, error) {
				calls.Add(1)
				if _, err := turn.Tool(ctx, "lookup", consumer.Read, map[string]string{"q": "x"}, func(context.Context) (any, error) {
					return "found", nil
				}); err != nil {
					return consumer.Reply{}, err
				}
				if _, err := turn.Tool(ctx, "send_email", consumer.Write, map[string]string{"to": "a@b"}, func(context.Context) (any, error) {
					return "sent", nil
				}); err != nil {
					return consumer.Reply{}, err
				}
				return consumer.Reply{}, errors.New("model crashed after sending the email")
			}})
			b.conversation("c")
			b.send("c", "m1", "email them")
			b.waitTerminal(time.Minute)
			require.EqualValues(t, 1, calls.Load(), "a turn whose write tool ran is never replayed")
			require.Equal(t, []string{"error"}, testsvc.Query[string](t, b.db, `SELECT status FROM agent_outbox`))
			require.Len(t, testsvc.Query[string](t, b.db, `SELECT id FROM messages WHERE role = 'error'`), 1)
			// The operations are recorded and attached to the visible error.
			ops := testsvc.Query[string](t, b.db, `SELECT tool || ':' || effect || ':' || status || ':' || (message_id IS NOT NULL)::text
				FROM operations ORDER BY id`)
			require.Equal(t, []string{"lookup:read:done:true", "send_email:write:done:true"}, ops)
		})
	}
}

func TestReadToolFailureIsRetried(t *testing.T) {
	t.Parallel()
	b := setup(t, polling)
	var calls atomic.Int32
	b.worker(consumer.Config{BackoffBase: 10 * time.Millisecond, Handler: func(ctx context.Context, turn *consumer.Turn) (consumer.Reply, error) {
		n := calls.Add(1)
		_, err := turn.Tool(ctx, "lookup", consumer.Read, nil, func(context.Context) (any, error) {
			if n == 1 {
				return nil, errors.New("timeout")
			}
			return "ok", nil
		})
		if err != nil {
			return consumer.Reply{}, err
		}
		return echo(ctx, turn)
	}})
	b.conversation("c")
	b.send("c", "m1", "hi")
	b.waitTerminal(time.Minute)
	require.EqualValues(t, 2, calls.Load())
	require.Equal(t, []string{"done"}, testsvc.Query[string](t, b.db, `SELECT status FROM agent_outbox`))
	require.Equal(t, []string{"lookup:error", "lookup:done"}, testsvc.Query[string](t, b.db, `SELECT tool || ':' || status FROM operations ORDER BY id`))
	require.Equal(t, []string{"retry", "done"}, testsvc.Query[string](t, b.db, `SELECT outcome FROM agent_runs ORDER BY started_at`))
}

// gathered returns the series of metric name in regs.
func gathered(t *testing.T, name string, regs ...*prometheus.Registry) []*dto.Metric {
	t.Helper()
	var out []*dto.Metric
	for _, reg := range regs {
		families, err := reg.Gather()
		require.NoError(t, err)
		for _, f := range families {
			if f.GetName() == name {
				out = append(out, f.GetMetric()...)
			}
		}
	}
	return out
}

// counter reads a counter of reg with the given label value (any label name).
func counter(t *testing.T, reg *prometheus.Registry, name, label string) float64 {
	t.Helper()
	return counterSum(t, []*prometheus.Registry{reg}, name, label)
}

// counterSum adds up counter name over regs: its series with a label of value label, or all of
// them when label is "".
func counterSum(t *testing.T, regs []*prometheus.Registry, name, label string) float64 {
	t.Helper()
	var sum float64
	for _, m := range gathered(t, name, regs...) {
		if label == "" || slices.ContainsFunc(m.GetLabel(), func(l *dto.LabelPair) bool { return l.GetValue() == label }) {
			sum += m.GetCounter().GetValue()
		}
	}
	return sum
}

// requireAllAcked waits until the durable consumer has nothing pending or unacknowledged.
func (b *bundle) requireAllAcked() {
	b.t.Helper()
	js, err := jetstream.New(b.nc)
	require.NoError(b.t, err)
	ctx := context.Background()
	require.Eventually(b.t, func() bool {
		c, err := js.Consumer(ctx, wire.StreamName("agent", "turns"), "baton-workers")
		if err != nil {
			return false
		}
		info, err := c.Info(ctx)
		return err == nil && info.NumAckPending == 0 && info.NumPending == 0
	}, time.Minute, 20*time.Millisecond, "events left unacknowledged")
}

// TestLiveSwitchFromPollingToJetStream is the migration a team makes: polling workers run
// under load, JetStream workers start beside them, the polling ones stop; nothing is lost
// and nothing answered twice.
func TestLiveSwitchFromPollingToJetStream(t *testing.T) {
	t.Parallel()
	b := setup(t, jetStream)
	nc := b.nc
	b.nc = nil
	stopPolling1 := b.worker(consumer.Config{Name: "poll-1"})
	stopPolling2 := b.worker(consumer.Config{Name: "poll-2"})
	b.nc = nc

	convs := make([]string, 30)
	for i := range convs {
		convs[i] = fmt.Sprintf("c%02d", i)
		b.conversation(convs[i])
	}
	stop := make(chan struct{})
	sent := make(chan int, 1)
	go func() {
		n := 0
		defer func() { sent <- n }()
		for i := 0; ; i++ {
			select {
			case <-stop:
				return
			default:
			}
			if _, err := b.prod.Send(context.Background(), b.app, producerMessage(convs[i%len(convs)], i)); err != nil {
				t.Error(err)
				return
			}
			n++
			time.Sleep(time.Millisecond) // a steady load, not a synchronisation
		}
	}()
	waitDone := func(n int) {
		require.Eventually(t, func() bool {
			return testsvc.Query[int](t, b.db, `SELECT count(*)::int FROM agent_outbox WHERE status = 'done'`)[0] >= n
		}, time.Minute, 10*time.Millisecond)
	}
	waitDone(200)
	b.worker(consumer.Config{Name: "js-1"})
	b.worker(consumer.Config{Name: "js-2"})
	waitDone(400)
	stopPolling1()
	stopPolling2()
	before := testsvc.Query[int](t, b.db, `SELECT count(*)::int FROM agent_runs WHERE worker LIKE 'js-%'`)[0]
	waitDone(700)
	close(stop)
	total := <-sent
	b.waitTerminal(time.Minute)
	b.requireAllAcked()

	require.Equal(t, []int{total}, testsvc.Query[int](t, b.db, `SELECT count(*)::int FROM agent_outbox WHERE status = 'done'`))
	require.Equal(t, []int{0}, testsvc.Query[int](t, b.db, `SELECT count(*)::int FROM (SELECT o.id FROM agent_outbox o
		JOIN agent_runs r ON o.id = ANY(r.outbox_ids) AND r.outcome = 'done' GROUP BY o.id HAVING count(*) <> 1) x`),
		"every row answered by exactly one committed run")
	workers := testsvc.Query[string](t, b.db, `SELECT DISTINCT split_part(worker, '-', 1) FROM agent_runs ORDER BY 1`)
	require.Equal(t, []string{"js", "poll"}, workers, "both sources did work")
	require.Greater(t, testsvc.Query[int](t, b.db, `SELECT count(*)::int FROM agent_runs WHERE worker LIKE 'js-%'`)[0], before,
		"the JetStream workers carried the load after the switch")
}

func producerMessage(conv string, i int) producer.Message {
	return producer.Message{ConversationID: conv, ID: fmt.Sprintf("%s-%d", conv, i), Content: strconv.Itoa(i)}
}

func TestShutdownReleasesRunningTurns(t *testing.T) {
	t.Parallel()
	b := setup(t, polling)
	entered := make(chan struct{})
	stop := b.worker(consumer.Config{ShutdownGrace: 50 * time.Millisecond, Handler: func(ctx context.Context, _ *consumer.Turn) (consumer.Reply, error) {
		close(entered)
		<-ctx.Done() // a long model call that honours cancellation
		return consumer.Reply{}, ctx.Err()
	}})
	b.conversation("c")
	b.send("c", "m1", "hi")
	<-entered
	stop()
	require.Equal(t, []string{"pending"}, testsvc.Query[string](t, b.db, `SELECT status FROM agent_outbox`), "released, not failed")
	require.Equal(t, []int{0}, testsvc.Query[int](t, b.db, `SELECT attempts FROM agent_outbox`), "a shutdown is not an attempt")
	require.Equal(t, []string{"released"}, testsvc.Query[string](t, b.db, `SELECT outcome FROM agent_runs`))
	b.worker(consumer.Config{})
	b.waitTerminal(time.Minute)
	require.Equal(t, []string{"echo: hi"}, testsvc.Query[string](t, b.db, `SELECT content FROM messages WHERE role = 'assistant'`))
}

// Logical decoding can send a transaction a moment before other sessions see its commit, so
// a worker may receive an event whose row it cannot see yet. It must not take that for a
// deleted row and ack the event away.
func TestEventBeforeItsRowIsVisible(t *testing.T) {
	t.Parallel()
	b := setup(t, jetStream)
	b.conversation("c")
	js, err := jetstream.New(b.nc)
	require.NoError(t, err)
	ctx := context.Background()
	// The event of outbox row 1000, published before the row exists.
	m := nats.NewMsg("agent.turns.c")
	m.Header.Set(wire.HeaderOutboxID, "1000")
	m.Header.Set(nats.MsgIdHdr, wire.TurnMsgID(1000))
	m.Data = []byte(`{"outbox_id":1000,"conversation_id":"c","message_id":"m1000","status":"pending","attempts":0,"created_at":"2026-11-30T00:00:00Z"}`)
	_, err = js.PublishMsg(ctx, m)
	require.NoError(t, err)
	reg := prometheus.NewRegistry()
	b.worker(consumer.Config{SweepInterval: time.Hour, Registerer: reg}) // no sweep to rescue it
	require.Eventually(t, func() bool {
		return counter(t, reg, "baton_worker_events_total", "nacked")+counter(t, reg, "baton_worker_events_total", "acked") > 0
	}, 30*time.Second, 5*time.Millisecond, "the worker never settled the early event")
	_, err = b.db.Pool.Exec(ctx, `WITH m AS (INSERT INTO messages (id, conversation_id, role, content)
			VALUES ('m1000', 'c', 'user', 'early') RETURNING id)
		INSERT INTO agent_outbox (id, conversation_id, message_id) OVERRIDING SYSTEM VALUE SELECT 1000, 'c', id FROM m`)
	require.NoError(t, err)
	require.Eventually(t, func() bool {
		return len(testsvc.Query[string](t, b.db, `SELECT id FROM messages WHERE role = 'assistant'`)) == 1
	}, 5*time.Second, 10*time.Millisecond, "the row became visible but its event was dropped")
}
