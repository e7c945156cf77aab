package relay

import (
	"encoding/json"
	"runtime"
	"strconv"
	"strings"
	"testing"

	"github.com/jackc/pglogrepl"
	"github.com/stretchr/testify/require"

	"github.com/batonhq/baton/wire"
)

// answersContent is a baton.answers message for messageID answering ids 1…n.
func answersContent(messageID string, n int) string {
	var sb strings.Builder
	sb.Grow(16 + len(messageID) + 8*n)
	sb.WriteString(`{"message_id":` + strconv.Quote(messageID) + `,"outbox_ids":[`)
	for i := range n {
		if i > 0 {
			sb.WriteByte(',')
		}
		sb.WriteString(strconv.Itoa(i + 1))
	}
	sb.WriteString(`]}`)
	return sb.String()
}

// reply is the insert of reply id into messages (relation 16385 of decoderWithRelations).
func reply(id string) []byte {
	return append([]byte{'I'}, insertBody(16385, textCols(id, "c", "assistant", "hi", "2026-11-30 01:02:03+00")...)...)
}

// allocated returns the bytes f allocated on the heap.
func allocated(f func()) uint64 {
	var before, after runtime.MemStats
	runtime.GC()
	runtime.ReadMemStats(&before)
	f()
	runtime.ReadMemStats(&after)
	return after.TotalAlloc - before.TotalAlloc
}

// An answers message is parsed as a stream: the decoder keeps the first wire.MaxBodyOutboxIDs
// ids (all an event carries) and counts the rest, allocating nothing per id past the cap, and
// the reply's outcome carries those ids with the count of the rest, in its body and headers.
func TestDecodeAnswersKeepsNoMoreIDsThanAnEventCarries(t *testing.T) {
	const n = 2_000_000
	content := answersContent("r1", n)
	d := decoderWithRelations(t, 1<<20)
	_, err := d.decodeAt(1, beginMsg())
	require.NoError(t, err)
	msg := logicalMsg(true, wire.AnswersPrefix, content)
	var it item
	bytes := allocated(func() { it, err = d.decodeAt(0x16B3700, msg) })
	require.NoError(t, err)
	require.Equal(t, itemNone, it.kind, "a valid answers message is no event")
	t.Logf("parsing %d ids (%d MB) allocated %d KiB", n, len(content)>>20, bytes>>10)
	require.Less(t, bytes, uint64(1<<20), "parsing %d ids allocated %d MiB", n, bytes>>20)

	it, err = d.decodeAt(0x16B3800, reply("r1"))
	require.NoError(t, err)
	require.True(t, it.outcome)
	require.Empty(t, it.deadLetter)
	var ev wire.OutcomeEvent
	require.NoError(t, json.Unmarshal(it.msg.Data, &ev))
	require.Len(t, ev.OutboxIDs, wire.MaxBodyOutboxIDs)
	for i, id := range ev.OutboxIDs {
		require.Equal(t, int64(i+1), id, "the first ids are kept, in order")
	}
	require.Equal(t, n-wire.MaxBodyOutboxIDs, ev.OutboxIDsOmitted)
	head := strings.Split(it.msg.Header.Get(wire.HeaderOutboxID), ",")
	require.Len(t, head, wire.MaxHeaderOutboxIDs)
	require.Equal(t, "1", head[0])
	require.Equal(t, strconv.Itoa(n-wire.MaxHeaderOutboxIDs), it.msg.Header.Get(wire.HeaderOutboxIDsOmitted))
}

// parseAnswers reads exactly the JSON it read before it streamed, for every shape a worker
// or another role may write, valid or not.
func TestParseAnswersCapsAndCounts(t *testing.T) {
	ids := func(from, to int) []int64 {
		var s []int64
		for i := from; i <= to; i++ {
			s = append(s, int64(i))
		}
		return s
	}
	for name, tc := range map[string]struct {
		content string
		id      string
		kept    []int64
		total   int
		err     bool
	}{
		"two ids":          {content: `{"message_id":"r1","outbox_ids":[1,2]}`, id: "r1", kept: []int64{1, 2}, total: 2},
		"spaces":           {content: " { \"outbox_ids\" : [ 1 ,\n2\t] , \"message_id\" : \"r1\" } ", id: "r1", kept: []int64{1, 2}, total: 2},
		"no ids":           {content: `{"message_id":"r1"}`, id: "r1"},
		"null ids":         {content: `{"message_id":"r1","outbox_ids":null}`, id: "r1"},
		"empty ids":        {content: `{"message_id":"r1","outbox_ids":[]}`, id: "r1"},
		"negative and max": {content: `{"message_id":"r1","outbox_ids":[-5,9223372036854775807]}`, id: "r1", kept: []int64{-5, 9223372036854775807}, total: 2},
		"unknown fields":   {content: `{"x":{"outbox_ids":[9]},"message_id":"r1","y":[1,"]"],"outbox_ids":[3]}`, id: "r1", kept: []int64{3}, total: 1},
		"key case":         {content: `{"Message_ID":"r1","OUTBOX_IDS":[4]}`, id: "r1", kept: []int64{4}, total: 1},
		"escaped id":       {content: `{"message_id":"r\u00e9\"1","outbox_ids":[1]}`, id: "ré\"1", kept: []int64{1}, total: 1},
		"repeated key":     {content: `{"message_id":"r1","outbox_ids":[1,2,3],"outbox_ids":[7]}`, id: "r1", kept: []int64{7}, total: 1},
		"at the cap":       {content: answersContent("r1", wire.MaxBodyOutboxIDs), id: "r1", kept: ids(1, wire.MaxBodyOutboxIDs), total: wire.MaxBodyOutboxIDs},
		"over the cap":     {content: answersContent("r1", 3*wire.MaxBodyOutboxIDs+7), id: "r1", kept: ids(1, wire.MaxBodyOutboxIDs), total: 3*wire.MaxBodyOutboxIDs + 7},
		"string id":        {content: `{"message_id":"r1","outbox_ids":[1,"2"]}`, err: true},
		"float id":         {content: `{"message_id":"r1","outbox_ids":[1.5]}`, err: true},
		"exponent id":      {content: `{"message_id":"r1","outbox_ids":[1e3]}`, err: true},
		"overflow id":      {content: `{"message_id":"r1","outbox_ids":[9223372036854775808]}`, err: true},
		"nested ids":       {content: `{"message_id":"r1","outbox_ids":[[1]]}`, err: true},
		"ids not an array": {content: `{"message_id":"r1","outbox_ids":7}`, err: true},
		"bad id past cap":  {content: strings.TrimSuffix(answersContent("r1", 2*wire.MaxBodyOutboxIDs), "]}") + `,"x"]}`, err: true},
		"unterminated":     {content: strings.TrimSuffix(answersContent("r1", 2*wire.MaxBodyOutboxIDs), "]}"), err: true},
		"deep nesting":     {content: `{"message_id":"r1","x":` + strings.Repeat("[", 100_000) + strings.Repeat("]", 100_000) + `}`, err: true},
		"no message id":    {content: `{"outbox_ids":[1]}`, err: true},
		"number message":   {content: `{"message_id":5}`, err: true},
		"trailing data":    {content: `{"message_id":"r1"} x`, err: true},
		"not an object":    {content: `[1,2]`, err: true},
		"null":             {content: `null`, err: true},
		"empty":            {content: ``, err: true},
	} {
		a, err := parseAnswers([]byte(tc.content))
		if tc.err {
			require.Error(t, err, name)
			require.Contains(t, err.Error(), wire.AnswersPrefix, name)
			continue
		}
		require.NoError(t, err, name)
		require.Equal(t, tc.id, a.messageID, name)
		require.Equal(t, tc.kept, a.ids, name)
		require.Equal(t, tc.total, a.total, name)
		require.LessOrEqual(t, cap(a.ids), wire.MaxBodyOutboxIDs, name)
	}
}

// Many answers messages in one transaction do not add up without bound either: past
// maxTxAnswersBytes held for the transaction, an answers message is set aside (its reply's
// outcome goes without its ids), and the next transaction starts from nothing.
func TestDecodeAnswersOfOneTransactionAreBounded(t *testing.T) {
	d := decoderWithRelations(t, 8<<20) // room for outcomes of replies with 1 MiB ids
	_, err := d.decodeAt(1, beginMsg())
	require.NoError(t, err)
	big := strings.Repeat("r", 1<<20) // a message id of 1 MiB: any role can emit one
	const msgs = 40
	var setAside int
	held := 0
	for i := range msgs {
		id := big + strconv.Itoa(i)
		at := pglogrepl.LSN(0x1000000 + i*0x100)
		it, err := d.decodeAt(at, logicalMsg(true, wire.AnswersPrefix, answersContent(id, 3)))
		require.NoError(t, err)
		if it.deadLetter != "" {
			setAside++
			require.Equal(t, wire.DeadLetterAnswers, it.deadLetter)
			require.Contains(t, it.reason, "transaction")
			var rec wire.DeadLetter
			require.NoError(t, json.Unmarshal(it.msg.Data, &rec))
			require.Equal(t, at.String(), rec.LSN)
			require.Equal(t, len(answersContent(id, 3)), rec.RawBytes)
			require.Equal(t, answersContent(id, 3)[:len(rec.Raw)], string(rec.Raw))
			continue
		}
		require.Zero(t, setAside, "message %d held after one was set aside", i)
		held++
		require.LessOrEqual(t, d.answersBytes, maxTxAnswersBytes)
	}
	t.Logf("held %d of %d answers messages with 1 MiB message ids", held, msgs)
	require.Positive(t, held)
	require.Equal(t, msgs-held, setAside)
	require.Positive(t, setAside, "%d MiB of answers held for one transaction", msgs)

	// The reply of a held message gets its ids, that of one set aside goes without.
	for i, want := range map[int]string{0: "1,2,3", msgs - 1: ""} {
		it, err := d.decodeAt(pglogrepl.LSN(0x2000000+i), reply(big+strconv.Itoa(i)))
		require.NoError(t, err)
		require.True(t, it.outcome)
		require.Equal(t, want, it.msg.Header.Get(wire.HeaderOutboxID), "reply %d", i)
	}

	// A transaction's answers go with it.
	_, err = d.decodeAt(0x3000000, commitMsg())
	require.NoError(t, err)
	require.Zero(t, d.answersBytes)
	_, err = d.decodeAt(0x3000100, beginMsg())
	require.NoError(t, err)
	it, err := d.decodeAt(0x3000200, logicalMsg(true, wire.AnswersPrefix, answersContent(big, 2)))
	require.NoError(t, err)
	require.Empty(t, it.deadLetter)
	it, err = d.decodeAt(0x3000300, reply(big))
	require.NoError(t, err)
	require.Equal(t, "1,2", it.msg.Header.Get(wire.HeaderOutboxID))

	// Short ids, many answered rows each: the same bound, however the bytes are made.
	d = decoderWithRelations(t, 1<<20)
	_, err = d.decodeAt(1, beginMsg())
	require.NoError(t, err)
	setAside = 0
	ids := answersContent("", wire.MaxBodyOutboxIDs)[len(`{"message_id":""`):]
	var i int
	for ; setAside < 3; i++ {
		require.Less(t, i, 2*maxTxAnswersBytes/(8*wire.MaxBodyOutboxIDs), "never set aside")
		it, err := d.decodeAt(pglogrepl.LSN(0x1000000+i), logicalMsg(true, wire.AnswersPrefix, `{"message_id":"r`+strconv.Itoa(i)+`"`+ids))
		require.NoError(t, err)
		if it.deadLetter != "" {
			setAside++
		}
		require.LessOrEqual(t, d.answersBytes, maxTxAnswersBytes)
	}
	t.Logf("held %d answers messages of 1,000 ids, then set the next ones aside", i-setAside)
}

// parseAnswers reads what json.Unmarshal reads into {MessageID string; OutboxIDs []int64},
// the parse it replaced, keeping the first wire.MaxBodyOutboxIDs ids and counting all; it
// refuses one thing more: a null among the ids, which json.Unmarshal read as id 0.
func FuzzParseAnswers(f *testing.F) {
	for _, s := range []string{`{"message_id":"r1","outbox_ids":[1,2]}`, `{"message_id":"r1","outbox_ids":[1,null]}`,
		`{"message_id":"r1","outbox_ids":[-0, 1 ,"2,3"]}`, `{"MESSAGE_ID":"r1","outbox_ids":null}`, `{"message_id":"r1","outbox_ids":[1e2]}`,
		answersContent("r1", wire.MaxBodyOutboxIDs+2)} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, content []byte) {
		var ref struct {
			MessageID string  `json:"message_id"`
			OutboxIDs []int64 `json:"outbox_ids"`
		}
		refErr := json.Unmarshal(content, &ref)
		a, err := parseAnswers(content)
		switch {
		case refErr != nil || ref.MessageID == "":
			require.Error(t, err, "json.Unmarshal refused it, or no message_id")
		case err != nil:
			var nulls struct {
				OutboxIDs []*int64 `json:"outbox_ids"`
			}
			require.NoError(t, json.Unmarshal(content, &nulls))
			require.Contains(t, nulls.OutboxIDs, (*int64)(nil), "refused %q: %v", content, err)
		default:
			require.Equal(t, ref.MessageID, a.messageID)
			require.Equal(t, len(ref.OutboxIDs), a.total)
			require.Len(t, a.ids, min(len(ref.OutboxIDs), wire.MaxBodyOutboxIDs))
			for i, id := range a.ids {
				require.Equal(t, ref.OutboxIDs[i], id)
			}
		}
	})
}
