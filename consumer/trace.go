package consumer

import (
	"context"
	"time"

	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/trace"

	"github.com/batonhq/baton/wire"
)

// TracerName is the OpenTelemetry instrumentation scope of the worker's spans. They come from
// the global tracer provider (otel.SetTracerProvider): with none installed they are the no-op
// tracer's, which records nothing.
//
// Spans of one turn:
//
//	baton.turn     the claimed turn, from its claim to its end; a child of the first claimed
//	               row's stored traceparent (the sender's span, see producer.Send), linked to
//	               the other rows' ones
//	baton.claim    the claim that returned the turn's rows
//	baton.tool     each Turn.Tool call: the operation's record and the tool function
//	baton.commit   the turn's end: the final commit of a reply, or the end of a failed run
//
// The turn span's context is stored with the reply (or visible failure) in
// messages.trace_context, and the relay puts it on the outcome event (wire.HeaderTraceparent).
const TracerName = "github.com/batonhq/baton/consumer"

// Span attributes.
const (
	attrConversationID = attribute.Key("baton.conversation_id")
	attrRunID          = attribute.Key("baton.run_id")
	attrOutboxIDs      = attribute.Key("baton.outbox_ids")
	attrMessageIDs     = attribute.Key("baton.message_ids")
	attrAttempt        = attribute.Key("baton.attempt")
	attrTool           = attribute.Key("baton.tool")
	attrEffect         = attribute.Key("baton.effect")
	attrOperationID    = attribute.Key("baton.operation_id")
	attrResult         = attribute.Key("baton.result")
)

// newTracer returns the tracer of tp, or of the global provider when tp is nil. The global
// provider's tracer delegates to a provider installed after it was made.
func newTracer(tp trace.TracerProvider) trace.Tracer {
	if tp == nil {
		return otel.Tracer(TracerName)
	}
	return tp.Tracer(TracerName)
}

// parseTraceparent returns the span context of a stored traceparent, which is whatever a
// database role wrote: anything but a valid one (wire.ValidTraceparent) is no parent.
func parseTraceparent(tc string) (trace.SpanContext, bool) {
	if !wire.ValidTraceparent(tc) {
		return trace.SpanContext{}, false
	}
	tid, err1 := trace.TraceIDFromHex(tc[3:35])
	sid, err2 := trace.SpanIDFromHex(tc[36:52])
	if err1 != nil || err2 != nil {
		return trace.SpanContext{}, false
	}
	flags := trace.TraceFlags(unhex(tc[53])<<4 | unhex(tc[54]))
	return trace.NewSpanContext(trace.SpanContextConfig{TraceID: tid, SpanID: sid, TraceFlags: flags, Remote: true}), true
}

func unhex(c byte) byte {
	if c >= 'a' {
		return c - 'a' + 10
	}
	return c - '0'
}

// turnTraceparent is the trace context stored with the turn's reply: the turn span's. A span
// that records nothing (tracing off) carries its parent's context, so the parent's stored
// string is the same value, without formatting it again.
func turnTraceparent(span trace.Span, c claim) string {
	if !span.IsRecording() {
		for _, tc := range c.traces {
			if wire.ValidTraceparent(tc) {
				return tc
			}
		}
		return ""
	}
	return formatTraceparent(span.SpanContext())
}

// formatTraceparent returns sc as a version-00 traceparent, "" when it is not valid.
func formatTraceparent(sc trace.SpanContext) string {
	if !sc.IsValid() {
		return ""
	}
	return "00-" + sc.TraceID().String() + "-" + sc.SpanID().String() + "-" + sc.TraceFlags().String()
}

// startTurn starts the turn span of claim c, from claimed (when the claim began, so the claim
// is inside it), with the claim's span, and returns ctx carrying it. Its parent is the first
// claimed row's valid trace context; the others are links. Without a parent it is a root
// span; with the no-op tracer it carries the parent's context, so replies still join the
// sender's trace.
func (w *Worker) startTurn(ctx context.Context, conv, runID string, c claim, claimed, claimEnded time.Time) (context.Context, trace.Span) {
	var links []trace.Link
	parent := false
	for _, tc := range c.traces {
		sc, ok := parseTraceparent(tc)
		switch {
		case !ok:
		case !parent:
			ctx, parent = trace.ContextWithRemoteSpanContext(ctx, sc), true
		default:
			links = append(links, trace.Link{SpanContext: sc})
		}
	}
	ctx, span := w.tracer.Start(ctx, "baton.turn", trace.WithTimestamp(claimed), trace.WithSpanKind(trace.SpanKindConsumer))
	if span.IsRecording() {
		for _, l := range links {
			span.AddLink(l)
		}
		msgIDs := make([]string, len(c.messages))
		for i, m := range c.messages {
			msgIDs[i] = m.ID
		}
		span.SetAttributes(attrConversationID.String(conv), attrRunID.String(runID),
			attrOutboxIDs.Int64Slice(c.ids), attrMessageIDs.StringSlice(msgIDs), attrAttempt.Int(c.attempts))
		_, claim := w.tracer.Start(ctx, "baton.claim", trace.WithTimestamp(claimed))
		claim.End(trace.WithTimestamp(claimEnded))
	}
	return ctx, span
}

// endSpan marks span failed with err's text as Baton logs it (detail: secrets masked, bounded),
// if err is not nil, and ends it.
func endSpan(span trace.Span, err error) {
	if err != nil && span.IsRecording() {
		span.SetStatus(codes.Error, detail(err))
	}
	span.End()
}
