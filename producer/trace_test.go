package producer_test

import (
	"context"
	"testing"

	"github.com/stretchr/testify/require"
	"go.opentelemetry.io/otel/trace"

	"github.com/batonhq/baton/producer"
)

// traceContextOf reads the outbox row's trace_context of message id (nil: NULL).
func (b *bundle) traceContextOf(t *testing.T, id string) *string {
	t.Helper()
	var tc *string
	require.NoError(t, b.db.Pool.QueryRow(b.ctx, `SELECT trace_context FROM agent_outbox WHERE message_id = $1`, id).Scan(&tc))
	return tc
}

// Send stores the caller's span context as the outbox row's traceparent, and NULL when the
// context carries none; a retry keeps the first call's.
func TestSendStoresTheCallersTraceparent(t *testing.T) {
	t.Parallel()
	b := setup(t)
	b.conversation(t, "c")

	_, err := b.p.Send(b.ctx, b.db.Pool, producer.Message{ConversationID: "c", ID: "untraced", Content: "hi"})
	require.NoError(t, err)
	require.Nil(t, b.traceContextOf(t, "untraced"), "no span in the context: NULL")

	sc := trace.NewSpanContext(trace.SpanContextConfig{
		TraceID:    trace.TraceID{0x4b, 0xf9, 0x2f, 0x35, 0x77, 0xb3, 0x4d, 0xa6, 0xa3, 0xce, 0x92, 0x9d, 0x0e, 0x0e, 0x47, 0x36},
		SpanID:     trace.SpanID{0x00, 0xf0, 0x67, 0xaa, 0x0b, 0xa9, 0x02, 0xb7},
		TraceFlags: trace.FlagsSampled,
	})
	ctx := trace.ContextWithSpanContext(b.ctx, sc)
	tx, err := b.db.Pool.Begin(ctx)
	require.NoError(t, err)
	_, err = b.p.SendTx(ctx, tx, producer.Message{ConversationID: "c", ID: "traced", Content: "hi"})
	require.NoError(t, err)
	require.NoError(t, tx.Commit(ctx))
	want := "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
	require.Equal(t, &want, b.traceContextOf(t, "traced"))

	// A span context that is not valid (zero ids) is no trace.
	invalid := trace.ContextWithSpanContext(b.ctx, trace.SpanContext{})
	_, err = b.p.Send(invalid, b.db.Pool, producer.Message{ConversationID: "c", ID: "invalid", Content: "hi"})
	require.NoError(t, err)
	require.Nil(t, b.traceContextOf(t, "invalid"))

	// A retry under another span changes nothing.
	res, err := b.p.Send(b.ctx, b.db.Pool, producer.Message{ConversationID: "c", ID: "traced", Content: "hi"})
	require.NoError(t, err)
	require.True(t, res.AlreadyAccepted)
	require.Equal(t, &want, b.traceContextOf(t, "traced"))
}

// Without a span, tracing costs Send no allocation.
func TestTraceContextWithoutSpanAllocatesNothing(t *testing.T) {
	ctx := context.Background()
	require.Zero(t, testing.AllocsPerRun(100, func() { _ = producer.TraceContextForTest(ctx) }))
}

// A send without a span names no trace_context: it works on a schema before version 8 (or for
// an app role not yet granted the column), as during a rolling upgrade.
func TestSendWithoutSpanNeedsNoTraceContextColumn(t *testing.T) {
	t.Parallel()
	b := setup(t)
	b.conversation(t, "c")
	b.exec(t, `ALTER TABLE agent_outbox DROP COLUMN trace_context`)
	_, err := b.p.Send(b.ctx, b.db.Pool, producer.Message{ConversationID: "c", ID: "m1", Content: "hi"})
	require.NoError(t, err)
	b.requireRows(t, 1, 1)
}
