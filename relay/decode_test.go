package relay

import (
	"encoding/binary"
	"errors"
	"testing"
	"time"

	"github.com/jackc/pglogrepl"
	"github.com/stretchr/testify/require"
)

// insertBody builds the body of a pgoutput insert message (after its 'I').
func insertBody(relID uint32, cols ...tupleColumn) []byte {
	b := binary.BigEndian.AppendUint32(nil, relID)
	b = append(b, 'N')
	b = binary.BigEndian.AppendUint16(b, uint16(len(cols)))
	for _, c := range cols {
		b = append(b, c.kind)
		if c.kind == 't' || c.kind == 'b' {
			b = binary.BigEndian.AppendUint32(b, uint32(len(c.data)))
			b = append(b, c.data...)
		}
	}
	return b
}

func TestDecodeInsert(t *testing.T) {
	cols := []tupleColumn{{kind: 't', data: []byte("42")}, {kind: 'n'}, {kind: 'u'}, {kind: 't', data: []byte{}}, {kind: 'b', data: []byte{0, 1}}}
	body := insertBody(16384, cols...)
	rel, got, err := decodeInsert(body, nil)
	require.NoError(t, err)
	require.EqualValues(t, 16384, rel)
	require.Len(t, got, len(cols))
	for i := range cols {
		require.Equal(t, cols[i].kind, got[i].kind)
		require.Equal(t, string(cols[i].data), string(got[i].data))
	}
	for n := range len(body) {
		_, _, err := decodeInsert(body[:n], nil)
		require.Error(t, err, "truncated to %d bytes", n)
	}
	_, _, err = decodeInsert(append(body, 0), nil)
	require.Error(t, err, "trailing bytes")
	_, _, err = decodeInsert(insertBody(1, tupleColumn{kind: 'x'}), nil)
	require.Error(t, err, "unknown column kind")
}

// FuzzDecodeInsert checks decodeInsert against pglogrepl's decoder: whatever pglogrepl reads
// completely, without panicking, decodeInsert reads the same; nothing makes decodeInsert panic.
func FuzzDecodeInsert(f *testing.F) {
	f.Add(insertBody(16384, tupleColumn{kind: 't', data: []byte("42")}, tupleColumn{kind: 'n'}))
	f.Add(insertBody(1, tupleColumn{kind: 'u'}, tupleColumn{kind: 'b', data: []byte{1, 2, 3}}))
	f.Add(insertBody(7))
	f.Fuzz(func(t *testing.T, body []byte) {
		rel, cols, err := decodeInsert(body, nil)
		if errors.Is(err, errTruncated) {
			return // pglogrepl would allocate the declared length, then panic
		}
		if !pglogreplAllocatesSafely(body) {
			require.Error(t, err) // a column declares more bytes than the message holds
			return
		}
		want, ok := pglogreplInsert(body)
		if !ok {
			return
		}
		require.NoError(t, err)
		require.Equal(t, want.RelationID, rel)
		require.Len(t, cols, len(want.Tuple.Columns))
		for i, c := range want.Tuple.Columns {
			require.Equal(t, c.DataType, cols[i].kind)
			require.Equal(t, string(c.Data), string(cols[i].data))
		}
	})
}

// pglogreplAllocatesSafely reports whether pglogrepl can decode body's tuple without being
// asked to allocate more than body holds. It reads on past columns of unknown kind (which the
// relay refuses) and allocates each declared length before it finds the bytes missing, so one
// input could make the fuzzer's worker allocate gigabytes and be reported as hung.
func pglogreplAllocatesSafely(body []byte) bool {
	if len(body) < 7 {
		return true
	}
	src := body[5:]
	n, off := int(binary.BigEndian.Uint16(src)), 2
	for range n {
		if off >= len(src) {
			return true // pglogrepl panics on the index, which pglogreplInsert recovers
		}
		kind := src[off]
		off++
		if kind != 't' && kind != 'b' {
			continue
		}
		if off+4 > len(src) {
			return true
		}
		size := int64(binary.BigEndian.Uint32(src[off:]))
		if size > int64(len(src)) {
			return false
		}
		off += 4 + int(size)
	}
	return true
}

// pglogreplInsert decodes body with pglogrepl; ok is false when it fails, panics (it does not
// check lengths), leaves bytes unread or meets a column kind pgoutput does not send.
func pglogreplInsert(body []byte) (m *pglogrepl.InsertMessage, ok bool) {
	defer func() {
		if recover() != nil {
			ok = false
		}
	}()
	msg, err := pglogrepl.Parse(append([]byte{'I'}, body...))
	if err != nil {
		return nil, false
	}
	m = msg.(*pglogrepl.InsertMessage)
	n, err := new(pglogrepl.TupleData).Decode(body[5:])
	if err != nil || n != len(body)-5 {
		return nil, false
	}
	for _, c := range m.Tuple.Columns {
		switch c.DataType {
		case 'n', 'u', 't', 'b':
		default:
			return nil, false
		}
	}
	return m, true
}

// FuzzParseUTCTimestamptz checks the fast path against time.Parse: whatever it accepts,
// time.Parse reads as the same instant, and Postgres' UTC output always takes it.
func FuzzParseUTCTimestamptz(f *testing.F) {
	for _, s := range []string{"2026-11-30 01:02:03.456789+00", "2026-11-30 01:02:03+00", "2024-02-29 23:59:59.1+00",
		"2026-02-29 01:02:03+00", "2026-11-30 24:00:00+00", "2026-11-30 01:02:03.+00", "0001-01-01 00:00:00+00 BC"} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, s string) {
		got, ok := parseUTCTimestamptz(s)
		if !ok {
			return
		}
		want, err := time.Parse("2006-01-02 15:04:05.999999999-07", s)
		require.NoError(t, err, "%q", s)
		require.True(t, want.Equal(got), "%q: %v, time.Parse %v", s, got, want)
		require.Equal(t, time.UTC, got.Location())
	})
}

func TestParseUTCTimestamptzTakesPostgresOutput(t *testing.T) {
	at := time.Date(2026, 11, 30, 1, 2, 3, 0, time.UTC)
	for _, frac := range []time.Duration{0, 100 * time.Millisecond, 456789 * time.Microsecond, time.Microsecond} {
		v := at.Add(frac)
		// Postgres prints microseconds without trailing zeros, and no fraction for whole seconds.
		s := v.Format("2006-01-02 15:04:05.999999") + "+00"
		got, ok := parseUTCTimestamptz(s)
		require.True(t, ok, s)
		require.True(t, v.Equal(got), "%s: %v", s, got)
	}
}
