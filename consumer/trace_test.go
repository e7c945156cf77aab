package consumer_test

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgconn"
	"github.com/nats-io/nats.go"
	"github.com/stretchr/testify/require"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	"go.opentelemetry.io/otel/trace"

	"github.com/batonhq/baton/consumer"
	"github.com/batonhq/baton/internal/testsvc"
	"github.com/batonhq/baton/producer"
	"github.com/batonhq/baton/wire"
)

// tracing is an in-memory span exporter and the provider that feeds it.
type tracing struct {
	exp *tracetest.InMemoryExporter
	tp  *sdktrace.TracerProvider
}

func newTracing(t *testing.T) *tracing {
	exp := tracetest.NewInMemoryExporter()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSyncer(exp))
	t.Cleanup(func() { _ = tp.Shutdown(context.Background()) })
	return &tracing{exp: exp, tp: tp}
}

// spans waits until n spans named name were exported and returns them.
func (tr *tracing) spans(t *testing.T, name string, n int) []tracetest.SpanStub {
	t.Helper()
	var got []tracetest.SpanStub
	require.Eventually(t, func() bool {
		got = got[:0]
		for _, s := range tr.exp.GetSpans() {
			if s.Name == name {
				got = append(got, s)
			}
		}
		return len(got) >= n
	}, time.Minute, 10*time.Millisecond, "%d %s spans", n, name)
	return got
}

// subscribe collects the events published on subject.
func (b *bundle) subscribe(subject string) *nats.Subscription {
	sub, err := b.nc.SubscribeSync(subject)
	require.NoError(b.t, err)
	b.t.Cleanup(func() { _ = sub.Unsubscribe() })
	require.NoError(b.t, b.nc.Flush())
	return sub
}

func nextMsg(t *testing.T, sub *nats.Subscription) *nats.Msg {
	t.Helper()
	m, err := sub.NextMsg(time.Minute)
	require.NoError(t, err)
	return m
}

// One user message is one connected trace: the sender's span → (the outbox row's trace
// context, the relay's traceparent header) → the worker's turn span with its claim, tool and
// commit spans → the reply's trace context → the outcome event's traceparent header. Real
// producer, relay (JetStream source) and worker, on real Postgres and NATS.
func TestOneMessageIsOneConnectedTrace(t *testing.T) {
	for _, src := range sources {
		t.Run(string(src), func(t *testing.T) {
			t.Parallel()
			b := setup(t, src)
			tr := newTracing(t)
			var turns, outcomes *nats.Subscription
			if src == jetStream {
				turns, outcomes = b.subscribe("agent.turns.>"), b.subscribe("agent.outcomes.>")
			}
			b.worker(consumer.Config{TracerProvider: tr.tp, Handler: func(ctx context.Context, turn *consumer.Turn) (consumer.Reply, error) {
				out, err := turn.Tool(ctx, "lookup", consumer.Read, "q", func(context.Context) (any, error) { return "found", nil })
				if err != nil {
					return consumer.Reply{}, err
				}
				return consumer.Reply{Content: "echo: " + out.(string)}, nil
			}})
			b.conversation("c")

			ctx, send := tr.tp.Tracer("app").Start(context.Background(), "send")
			_, err := b.prod.Send(ctx, b.app, producer.Message{ConversationID: "c", ID: "m1", Content: "hi"})
			require.NoError(t, err)
			send.End()
			sender := send.SpanContext()

			turn := tr.spans(t, "baton.turn", 1)
			require.Len(t, turn, 1)
			ts := turn[0]
			require.Equal(t, sender.TraceID(), ts.SpanContext.TraceID(), "the turn is in the sender's trace")
			require.Equal(t, sender.SpanID(), ts.Parent.SpanID(), "the turn's parent is the sender's span")
			require.True(t, ts.Parent.IsRemote())
			attrs := map[string]string{}
			for _, a := range ts.Attributes {
				attrs[string(a.Key)] = a.Value.String()
			}
			require.Equal(t, "c", attrs["baton.conversation_id"])
			require.Equal(t, `["m1"]`, attrs["baton.message_ids"])
			require.Equal(t, "1", attrs["baton.attempt"])
			require.NotEmpty(t, attrs["baton.outbox_ids"])
			for _, name := range []string{"baton.claim", "baton.tool", "baton.commit"} {
				child := tr.spans(t, name, 1)
				require.Len(t, child, 1, name)
				require.Equal(t, ts.SpanContext.TraceID(), child[0].SpanContext.TraceID(), name)
				require.Equal(t, ts.SpanContext.SpanID(), child[0].Parent.SpanID(), "%s is a child of the turn", name)
			}

			want := "00-" + ts.SpanContext.TraceID().String() + "-" + ts.SpanContext.SpanID().String() + "-01"
			require.Equal(t, []string{want}, testsvc.Query[string](t, b.db,
				`SELECT trace_context FROM messages WHERE role = 'assistant'`), "the reply carries the turn span")
			if src == jetStream {
				ev := nextMsg(t, turns)
				require.Equal(t, "00-"+sender.TraceID().String()+"-"+sender.SpanID().String()+"-01",
					ev.Header.Get(wire.HeaderTraceparent), "the turn event carries the sender's span")
				out := nextMsg(t, outcomes)
				require.Equal(t, want, out.Header.Get(wire.HeaderTraceparent), "the outcome carries the turn span")
			}
		})
	}
}

// Hostile trace contexts written into agent_outbox by SQL are dropped: each row is still
// relayed (its turn event without a traceparent) and answered, in a trace of its own.
func TestHostileTraceContextsAreDropped(t *testing.T) {
	t.Parallel()
	b := setup(t, jetStream)
	tr := newTracing(t)
	turns := b.subscribe("agent.turns.>")
	b.worker(consumer.Config{TracerProvider: tr.tp})
	hostile := map[string]string{
		"garbage":        "not a traceparent",
		"overlong":       "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01" + strings.Repeat("-ab", 150),
		"uppercase":      "00-4BF92F3577B34DA6A3CE929D0E0E4736-00F067AA0BA902B7-01",
		"zero trace id":  "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
		"newline":        "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01\n",
		"CRLF injection": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01\r\nBaton-Role: assistant",
		"empty":          "",
	}
	ctx := context.Background()
	for name, tc := range hostile {
		conv := strings.ReplaceAll(name, " ", "-")
		b.conversation(conv)
		_, err := b.db.Pool.Exec(ctx, `WITH m AS (INSERT INTO messages (id, conversation_id, role, content)
			VALUES ($1, $1, 'user', 'hi') RETURNING id)
			INSERT INTO agent_outbox (conversation_id, message_id, trace_context) SELECT $1, id, $2 FROM m`, conv, tc)
		require.NoError(t, err, name)
	}
	// The column is bounded: no role can store a huge header for the relay to read.
	_, err := b.db.Pool.Exec(ctx, `UPDATE agent_outbox SET trace_context = repeat('a', 513)`)
	var pgErr *pgconn.PgError
	require.True(t, errors.As(err, &pgErr) && pgErr.Code == "23514", "want a check violation, got %v", err)

	b.waitTerminal(time.Minute)
	require.Len(t, testsvc.Query[string](t, b.db, `SELECT id FROM messages WHERE role = 'assistant'`), len(hostile),
		"every row answered")
	for range hostile {
		ev := nextMsg(t, turns)
		require.NotContains(t, ev.Header, wire.HeaderTraceparent, "turn event %s", ev.Header.Get(wire.HeaderConversationID))
		for k, vs := range ev.Header {
			require.NotEqual(t, "Baton-Role", k)
			for _, v := range vs {
				require.NotContains(t, v, "\n")
			}
		}
	}
	for _, s := range tr.spans(t, "baton.turn", len(hostile)) {
		require.False(t, s.Parent.IsValid(), "a dropped trace context is no parent")
	}
	require.Empty(t, testsvc.Query[string](t, b.db, `SELECT trace_context FROM messages
		WHERE role = 'assistant' AND trace_context !~ '^00-[0-9a-f]{32}-[0-9a-f]{16}-0[01]$'`),
		"the replies carry their own turn spans, valid")
}

// Without a tracer provider and without a sender's span, nothing is traced: the reply's trace
// context is NULL. With the sender's span but no provider, the reply still joins its trace.
func TestNoTracerProvider(t *testing.T) {
	t.Parallel()
	b := setup(t, polling)
	b.worker(consumer.Config{})
	b.conversation("c")
	b.send("c", "untraced", "hi")
	sc := trace.NewSpanContext(trace.SpanContextConfig{TraceID: trace.TraceID{1}, SpanID: trace.SpanID{2}, TraceFlags: trace.FlagsSampled})
	_, err := b.prod.Send(trace.ContextWithSpanContext(context.Background(), sc), b.db.Pool,
		producer.Message{ConversationID: "c", ID: "traced", Content: "hi"})
	require.NoError(t, err)
	b.waitTerminal(time.Minute)
	got := testsvc.Query[*string](t, b.db, `SELECT r.trace_context FROM agent_outbox o JOIN messages r ON r.id = o.reply_id ORDER BY o.id`)
	require.NotEmpty(t, got)
	for _, tc := range got {
		if tc != nil {
			require.Equal(t, "00-01000000000000000000000000000000-0200000000000000-01", *tc)
		}
	}
}
