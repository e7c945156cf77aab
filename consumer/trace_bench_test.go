package consumer

import (
	"context"
	"testing"
	"time"

	"go.opentelemetry.io/otel/sdk/trace/tracetest"

	sdktrace "go.opentelemetry.io/otel/sdk/trace"
)

// BenchmarkTurnSpans is what tracing adds to a turn: its span from the stored traceparent, the
// claim and commit spans and the trace context stored with the reply. Off (no provider
// installed: the global no-op one) against on (an SDK provider recording in memory).
//
//	go test -run '^$' -bench TurnSpans -benchmem -count 3 ./consumer
func BenchmarkTurnSpans(b *testing.B) {
	c := claim{ids: []int64{1}, attempts: 1, messages: []Message{{ID: "m1"}},
		traces: []string{"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"}}
	run := func(b *testing.B, w *Worker) {
		now := time.Now()
		b.ReportAllocs()
		for b.Loop() {
			ctx, span := w.startTurn(context.Background(), "conv", "run", c, now, now)
			_ = turnTraceparent(span, c)
			_, commit := w.tracer.Start(ctx, "baton.commit")
			endSpan(commit, nil)
			span.End()
		}
	}
	b.Run("off", func(b *testing.B) { run(b, &Worker{tracer: newTracer(nil)}) })
	b.Run("on", func(b *testing.B) {
		tp := sdktrace.NewTracerProvider(sdktrace.WithSyncer(tracetest.NewInMemoryExporter()))
		b.Cleanup(func() { _ = tp.Shutdown(context.Background()) })
		run(b, &Worker{tracer: newTracer(tp)})
	})
}
