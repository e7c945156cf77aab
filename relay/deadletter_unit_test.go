package relay

import (
	"encoding/json"
	"strings"
	"testing"

	"github.com/jackc/pglogrepl"
	"github.com/nats-io/nats.go"
	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"
	"github.com/stretchr/testify/require"

	"github.com/batonhq/baton/wire"
)

func textCols(vals ...string) []tupleColumn {
	cols := make([]tupleColumn, len(vals))
	for i, v := range vals {
		cols[i] = tupleColumn{kind: 't', data: []byte(v)}
	}
	return cols
}

func decoderWithRelations(t *testing.T, maxPayload int) *decoder {
	t.Helper()
	d := newDecoder("public", "agent", maxPayload)
	for _, rel := range [][]byte{
		relationMsg(16384, "public", "agent_outbox", outboxColumns...),
		relationMsg(16385, "public", "messages", "id", "conversation_id", "role", "content", "created_at"),
	} {
		_, err := d.decode(rel)
		require.NoError(t, err)
	}
	return d
}

func requireDeadLetter(t *testing.T, it item, kind, table string, lsn pglogrepl.LSN, raw []byte) wire.DeadLetter {
	t.Helper()
	require.Equal(t, itemEvent, it.kind)
	require.Equal(t, kind, it.deadLetter)
	require.Equal(t, "agent.deadletter."+kind, it.msg.Subject)
	require.Equal(t, wire.DeadLetterMsgID(lsn.String()), it.msg.Header.Get(nats.MsgIdHdr))
	var rec wire.DeadLetter
	require.NoError(t, json.Unmarshal(it.msg.Data, &rec))
	require.Equal(t, lsn.String(), rec.LSN)
	require.Equal(t, kind, rec.Kind)
	require.Equal(t, table, rec.Table)
	require.Equal(t, it.reason, rec.Reason)
	require.NotEmpty(t, rec.Reason)
	require.Equal(t, raw, rec.Raw)
	require.Equal(t, len(raw), rec.RawBytes)
	return rec
}

// No poison loop: a malformed answers message is a dead-letter record, not an error, and the
// outcome of its transaction is still made, without ids.
func TestDecodeMalformedAnswersIsDeadLettered(t *testing.T) {
	for _, content := range []string{"x", "", "null", "[1,2]", "{}", `{"message_id":5}`,
		`{"message_id":"r1","outbox_ids":"7"}`, `{"message_id":"r1","outbox_ids":[1,"x"]}`, `{"message_id":"r1"} trailing`} {
		d := decoderWithRelations(t, 1<<20)
		_, err := d.decodeAt(1, beginMsg())
		require.NoError(t, err)
		it, err := d.decodeAt(0x16B3700, logicalMsg(true, wire.AnswersPrefix, content))
		require.NoError(t, err, "content %q", content)
		requireDeadLetter(t, it, wire.DeadLetterAnswers, "", 0x16B3700, []byte(content))

		it, err = d.decodeAt(0x16B3800, append([]byte{'I'}, insertBody(16385,
			textCols("r1", "c", "assistant", "hi", "2026-11-30 01:02:03+00")...)...))
		require.NoError(t, err)
		require.Empty(t, it.deadLetter)
		require.True(t, it.outcome)
		require.Empty(t, it.msg.Header.Get(wire.HeaderOutboxID), "content %q added ids", content)
	}
	// A non-transactional message is not the worker's: ignored, as before.
	d := decoderWithRelations(t, 1<<20)
	it, err := d.decodeAt(5, logicalMsg(false, wire.AnswersPrefix, "x"))
	require.NoError(t, err)
	require.Equal(t, itemNone, it.kind)
}

// Row values no retry can parse, and events that can never fit, are dead-letter records
// carrying the raw insert message; nothing else about the decoder's state changes.
func TestDecodeUnpublishableRowsAreDeadLettered(t *testing.T) {
	outbox := func(id, created string) []byte {
		return append([]byte{'I'}, insertBody(16384, textCols(id, "c", "m", "pending", "0", created)...)...)
	}
	for name, tc := range map[string]struct {
		maxPayload  int
		msg         []byte
		kind, table string
	}{
		"created_at past 9999":     {1 << 20, outbox("7", "10000-01-01 00:00:00+00"), wire.DeadLetterTurn, "public.agent_outbox"},
		"created_at BC":            {1 << 20, outbox("7", "0044-03-15 00:00:00+00 BC"), wire.DeadLetterTurn, "public.agent_outbox"},
		"created_at infinity":      {1 << 20, outbox("7", "infinity"), wire.DeadLetterTurn, "public.agent_outbox"},
		"outbox id not an integer": {1 << 20, outbox("seven", "2026-11-30 01:02:03+00"), wire.DeadLetterTurn, "public.agent_outbox"},
		"binary column": {1 << 20, append([]byte{'I'}, insertBody(16384, tupleColumn{kind: 'b', data: []byte{0, 7}},
			tupleColumn{kind: 't', data: []byte("c")}, tupleColumn{kind: 't', data: []byte("m")}, tupleColumn{kind: 't', data: []byte("pending")},
			tupleColumn{kind: 't', data: []byte("0")}, tupleColumn{kind: 't', data: []byte("2026-11-30 01:02:03+00")})...), wire.DeadLetterTurn, "public.agent_outbox"},
		"outcome created_at unparseable": {1 << 20, append([]byte{'I'}, insertBody(16385,
			textCols("r1", "c", "assistant", "hi", "30/11/2026 01:02:03 UTC")...)...), wire.DeadLetterOutcome, "public.messages"},
		"outcome too large even without content": {300, append([]byte{'I'}, insertBody(16385,
			textCols("r1", strings.Repeat("c", 200), "assistant", "hi", "2026-11-30 01:02:03+00")...)...), wire.DeadLetterOutcome, "public.messages"},
		"turn larger than max payload": {600, append([]byte{'I'}, insertBody(16384, textCols("7", strings.Repeat("c", 100),
			strings.Repeat("m", 300), "pending", "0", "2026-11-30 01:02:03+00")...)...), wire.DeadLetterTurn, "public.agent_outbox"},
	} {
		t.Run(name, func(t *testing.T) {
			msg := tc.msg
			d := decoderWithRelations(t, tc.maxPayload)
			it, err := d.decodeAt(0x2000, msg)
			require.NoError(t, err)
			raw := msg
			if len(raw) > wire.MaxDeadLetterRaw {
				raw = raw[:wire.MaxDeadLetterRaw]
			}
			rec := wire.DeadLetter{}
			require.NoError(t, json.Unmarshal(it.msg.Data, &rec))
			if tc.maxPayload >= 1<<10 {
				requireDeadLetter(t, it, tc.kind, tc.table, 0x2000, raw)
			} else { // raw cut to fit the tiny max payload
				require.Equal(t, tc.kind, it.deadLetter)
				require.Equal(t, tc.table, rec.Table)
				require.Equal(t, len(msg), rec.RawBytes)
				require.Equal(t, msg[:len(rec.Raw)], rec.Raw)
				require.LessOrEqual(t, msgSize(it.msg.Header, it.msg.Data), tc.maxPayload)
			}
		})
	}
}

// A record carries at most wire.MaxDeadLetterRaw bytes of the change, and never more than the max
// payload allows, whatever the change's size.
func TestDeadLetterRecordFits(t *testing.T) {
	raw := []byte(strings.Repeat("z", 5<<20))
	for _, maxPayload := range []int{0, 1 << 20, 64 << 10, 10 << 10, 1000} {
		m := deadLetterMsg("agent", wire.DeadLetterTurn, "public.agent_outbox", strings.Repeat("why ", 1000), 0x1234, 0, raw, maxPayload)
		var rec wire.DeadLetter
		require.NoError(t, json.Unmarshal(m.Data, &rec))
		require.Equal(t, len(raw), rec.RawBytes)
		require.LessOrEqual(t, len(rec.Raw), wire.MaxDeadLetterRaw)
		require.Equal(t, raw[:len(rec.Raw)], rec.Raw)
		require.LessOrEqual(t, len(rec.Reason), maxDeadLetterReason+len("…"))
		if maxPayload > 0 {
			require.LessOrEqual(t, msgSize(m.Header, m.Data), maxPayload, "max payload %d", maxPayload)
		}
		if maxPayload == 0 || maxPayload >= 1<<20 {
			require.Len(t, rec.Raw, wire.MaxDeadLetterRaw)
		}
	}
}

// The dead-letter record is an event like any other: its transaction is confirmed only after
// the record's PubAck, and it is counted by kind only then.
func TestDeadLetterRecordHoldsItsTransaction(t *testing.T) {
	f := newFakePipeline(t, 100)
	e1, m1 := event("agent.turns.c")
	dl := item{kind: itemEvent, deadLetter: wire.DeadLetterAnswers, msg: deadLetterMsg("agent", wire.DeadLetterAnswers, "", "bad", 50, 0, []byte("x"), 0)}
	f.step(t, begin(), e1, dl, commit(100))
	f.ackMsg(t, m1)
	require.Zero(t, f.lsn(), "the dead-letter record has no PubAck yet")
	f.ackMsg(t, dl.msg)
	require.EqualValues(t, 100, f.lsn())
	require.Equal(t, 1.0, counterValue(t, f.m.deadLetter.WithLabelValues(wire.DeadLetterAnswers)))
	require.Equal(t, 1.0, counterValue(t, f.m.turns)+counterValue(t, f.m.backfill), "the record is not counted as an event")
}

func counterValue(t *testing.T, c prometheus.Counter) float64 {
	t.Helper()
	var m dto.Metric
	require.NoError(t, c.Write(&m))
	return m.GetCounter().GetValue()
}
