package relay

import (
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/batonhq/baton/wire"
)

const testTraceparent = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"

// hostileTraceContexts are stored trace contexts that are not valid traceparents: each is
// dropped, and the event is published without one.
var hostileTraceContexts = map[string]string{
	"garbage":         "not a traceparent",
	"overlong":        testTraceparent + strings.Repeat("-ab", 100),
	"uppercase":       strings.ToUpper(testTraceparent),
	"zero trace id":   "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
	"zero span id":    "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
	"newline":         testTraceparent + "\n",
	"CRLF injection":  "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7\r\nBaton-Role: x",
	"unknown version": "01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
}

func traceDecoder(t *testing.T) *decoder {
	t.Helper()
	d := newDecoder("public", "agent", 1<<20)
	for _, rel := range [][]byte{
		relationMsg(16384, "public", "agent_outbox", append(outboxColumns, "trace_context")...),
		relationMsg(16385, "public", "messages", "id", "conversation_id", "role", "content", "created_at", "trace_context"),
	} {
		_, err := d.decode(rel)
		require.NoError(t, err)
	}
	_, err := d.decode(beginMsg())
	require.NoError(t, err)
	return d
}

func outboxInsert(tc tupleColumn) []byte {
	cols := append(textCols("7", "c", "m1", "pending", "0", "2026-11-30 01:02:03+00"), tc)
	return append([]byte{'I'}, insertBody(16384, cols...)...)
}

func replyInsert(tc tupleColumn) []byte {
	cols := append(textCols("r1", "c", "assistant", "hi", "2026-11-30 01:02:03+00"), tc)
	return append([]byte{'I'}, insertBody(16385, cols...)...)
}

func text(s string) tupleColumn { return tupleColumn{kind: 't', data: []byte(s)} }

// A valid stored trace context becomes the event's traceparent header, on turns and outcomes.
func TestDecodeTraceContext(t *testing.T) {
	d := traceDecoder(t)
	for name, msg := range map[string][]byte{"turn": outboxInsert(text(testTraceparent)), "outcome": replyInsert(text(testTraceparent))} {
		it, err := d.decode(msg)
		require.NoError(t, err, name)
		require.Empty(t, it.deadLetter, name)
		require.False(t, it.traceDropped, name)
		require.Equal(t, []string{testTraceparent}, it.msg.Header[wire.HeaderTraceparent], name)
	}
	for name, msg := range map[string][]byte{"turn": outboxInsert(tupleColumn{kind: 'n'}), "outcome": replyInsert(tupleColumn{kind: 'n'})} {
		it, err := d.decode(msg)
		require.NoError(t, err, name)
		require.Empty(t, it.deadLetter, name)
		require.False(t, it.traceDropped, name, "NULL is no trace, not a dropped one")
		require.NotContains(t, it.msg.Header, wire.HeaderTraceparent, name)
	}
}

// No stored trace context stops or sets aside a row: an invalid one is dropped (and counted),
// and the event is the same as without it.
func TestDecodeHostileTraceContextIsDropped(t *testing.T) {
	for name, tc := range hostileTraceContexts {
		d := traceDecoder(t)
		for kind, msg := range map[string][]byte{"turn": outboxInsert(text(tc)), "outcome": replyInsert(text(tc))} {
			it, err := d.decode(msg)
			require.NoError(t, err, "%s %s", name, kind)
			require.Equal(t, itemEvent, it.kind)
			require.Empty(t, it.deadLetter, "%s %s", name, kind)
			require.True(t, it.traceDropped, "%s %s", name, kind)
			require.NotContains(t, it.msg.Header, wire.HeaderTraceparent, "%s %s", name, kind)
			for _, vs := range it.msg.Header {
				for _, v := range vs {
					require.NotContains(t, v, "Baton-Role: x")
				}
			}
		}
	}
}

// A table without the column (a schema before migration 8) publishes as before.
func TestDecodeWithoutTraceContextColumn(t *testing.T) {
	d := decoderWithRelations(t, 1<<20)
	_, err := d.decode(beginMsg())
	require.NoError(t, err)
	it, err := d.decode(append([]byte{'I'}, insertBody(16384, textCols("7", "c", "m1", "pending", "0", "2026-11-30 01:02:03+00")...)...))
	require.NoError(t, err)
	require.Empty(t, it.deadLetter)
	require.NotContains(t, it.msg.Header, wire.HeaderTraceparent)
}
