package relay

import (
	"encoding/binary"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/batonhq/baton/wire"
)

// pgoutput (protocol version 1) messages, built by hand as the walsender writes them.

func cstring(b []byte, s string) []byte { return append(append(b, s...), 0) }

func relationMsg(relID uint32, namespace, name string, cols ...string) []byte {
	b := binary.BigEndian.AppendUint32([]byte{'R'}, relID)
	b = cstring(b, namespace)
	b = cstring(b, name)
	b = append(b, 'd') // replica identity: default
	b = binary.BigEndian.AppendUint16(b, uint16(len(cols)))
	for i, c := range cols {
		b = append(b, byte(i&1)) // flags: part of the key or not
		b = cstring(b, c)
		b = binary.BigEndian.AppendUint32(b, 25) // text
		b = binary.BigEndian.AppendUint32(b, 0xffffffff)
	}
	return b
}

func beginMsg() []byte {
	b := binary.BigEndian.AppendUint64([]byte{'B'}, 0x16B3748)
	b = binary.BigEndian.AppendUint64(b, 849_000_000_000_000)
	return binary.BigEndian.AppendUint32(b, 740)
}

func commitMsg() []byte {
	b := append([]byte{'C'}, 0)
	b = binary.BigEndian.AppendUint64(b, 0x16B3748)
	b = binary.BigEndian.AppendUint64(b, 0x16B3778)
	return binary.BigEndian.AppendUint64(b, 849_000_000_000_000)
}

func logicalMsg(transactional bool, prefix, content string) []byte {
	b := []byte{'M', 0}
	if transactional {
		b[1] = 1
	}
	b = binary.BigEndian.AppendUint64(b, 0x16B3700)
	b = cstring(b, prefix)
	b = binary.BigEndian.AppendUint32(b, uint32(len(content)))
	return append(b, content...)
}

func tupleData(kind byte, cols ...string) []byte {
	b := []byte{kind}
	b = binary.BigEndian.AppendUint16(b, uint16(len(cols)))
	for _, c := range cols {
		b = append(b, 't')
		b = binary.BigEndian.AppendUint32(b, uint32(len(c)))
		b = append(b, c...)
	}
	return b
}

func updateMsg(relID uint32) []byte {
	b := binary.BigEndian.AppendUint32([]byte{'U'}, relID)
	b = append(b, tupleData('O', "1", "old")...)
	return append(b, tupleData('N', "1", "new")...)
}

func deleteMsg(relID uint32) []byte {
	b := binary.BigEndian.AppendUint32([]byte{'D'}, relID)
	return append(b, tupleData('K', "1")...)
}

func truncateMsg(relIDs ...uint32) []byte {
	b := binary.BigEndian.AppendUint32([]byte{'T'}, uint32(len(relIDs)))
	b = append(b, 0)
	for _, id := range relIDs {
		b = binary.BigEndian.AppendUint32(b, id)
	}
	return b
}

func typeMsg() []byte {
	b := binary.BigEndian.AppendUint32([]byte{'Y'}, 16385)
	b = cstring(b, "public")
	return cstring(b, "mood")
}

func originMsg() []byte {
	return cstring(binary.BigEndian.AppendUint64([]byte{'O'}, 0x16B3700), "upstream")
}

var outboxColumns = []string{"id", "conversation_id", "message_id", "status", "attempts", "created_at"}

// validMessages are well-formed messages of every kind decode reads through pglogrepl.
func validMessages() map[string][]byte {
	return map[string][]byte{
		"relation": relationMsg(16384, "public", "agent_outbox", outboxColumns...),
		"begin":    beginMsg(),
		"commit":   commitMsg(),
		"message":  logicalMsg(true, wire.AnswersPrefix, `{"message_id":"r1","outbox_ids":[1,2]}`),
		"update":   updateMsg(16384),
		"delete":   deleteMsg(16384),
		"truncate": truncateMsg(16384, 16390),
		"type":     typeMsg(),
		"origin":   originMsg(),
	}
}

// decodeNoPanic calls d.decode and fails the test, instead of crashing it, on a panic.
func decodeNoPanic(t *testing.T, d *decoder, data []byte) (it item, err error) {
	t.Helper()
	defer func() {
		if r := recover(); r != nil {
			t.Fatalf("decode(%q) panicked: %v", data, r)
		}
	}()
	return d.decode(data)
}

// Empty and truncated messages are decode errors, never panics: a panic would end the
// process, and the relay would meet the same message again after every restart.
func TestDecodeMalformedMessagesAreErrors(t *testing.T) {
	_, err := decodeNoPanic(t, newDecoder("public", "agent", 1<<20), nil)
	require.Error(t, err, "empty message")
	_, err = decodeNoPanic(t, newDecoder("public", "agent", 1<<20), []byte{})
	require.Error(t, err, "empty message")

	for name, msg := range validMessages() {
		t.Run(name, func(t *testing.T) {
			_, err := decodeNoPanic(t, newDecoder("public", "agent", 1<<20), msg)
			require.NoError(t, err, "the whole message decodes")
			for n := 1; n < len(msg); n++ {
				_, err := decodeNoPanic(t, newDecoder("public", "agent", 1<<20), msg[:n])
				require.Error(t, err, "%s truncated to %d of %d bytes", name, n, len(msg))
			}
		})
	}

	// Lengths that point past the end of the message.
	for name, msg := range map[string][]byte{
		"message content longer than the message": func() []byte {
			m := logicalMsg(true, wire.AnswersPrefix, `{}`)
			binary.BigEndian.PutUint32(m[len(m)-6:], 1<<30)
			return m
		}(),
		"relation with more columns than it has": func() []byte {
			m := relationMsg(1, "public", "t", "a")
			binary.BigEndian.PutUint16(m[len(m)-13-2:], 500)
			return m
		}(),
		"update tuple with more columns than it has": func() []byte {
			m := updateMsg(1)
			m[len(m)-len(tupleData('N', "1", "new"))+2] = 9
			return m
		}(),
		"truncate of more relations than it has": func() []byte {
			m := truncateMsg(1)
			binary.BigEndian.PutUint32(m[1:], 1000)
			return m
		}(),
		"prefix without its terminating NUL": {'M', 1, 0, 0, 0, 0, 0, 0, 0, 0, 'b', 'a'},
	} {
		_, err := decodeNoPanic(t, newDecoder("public", "agent", 1<<20), msg)
		require.Error(t, err, name)
	}
}

// FuzzDecode checks that no input makes the decoder panic. Every call first sees the relations
// of the tables the relay publishes, then two messages, so an answers message can reach the
// outcome of an insert into messages after it.
func FuzzDecode(f *testing.F) {
	for _, msg := range validMessages() {
		f.Add(msg, []byte(nil))
		f.Add(msg[:len(msg)/2], []byte(nil))
	}
	f.Add([]byte{}, []byte{})
	f.Add(logicalMsg(true, wire.AnswersPrefix, `{"message_id":"r1","outbox_ids":[1,2]}`),
		append([]byte{'I'}, insertBody(16385, tupleColumn{kind: 't', data: []byte("r1")},
			tupleColumn{kind: 't', data: []byte("c")}, tupleColumn{kind: 't', data: []byte("assistant")},
			tupleColumn{kind: 't', data: []byte("hi")}, tupleColumn{kind: 't', data: []byte("2026-11-30 01:02:03+00")})...))
	f.Add(append([]byte{'I'}, insertBody(16384, tupleColumn{kind: 't', data: []byte("7")},
		tupleColumn{kind: 't', data: []byte("c")}, tupleColumn{kind: 't', data: []byte("m")},
		tupleColumn{kind: 't', data: []byte("pending")}, tupleColumn{kind: 't', data: []byte("0")},
		tupleColumn{kind: 't', data: []byte("2026-11-30 01:02:03.5+00")})...), []byte(nil))
	f.Fuzz(func(t *testing.T, a, b []byte) {
		d := newDecoder("public", "agent", 1<<16)
		for _, rel := range [][]byte{
			relationMsg(16384, "public", "agent_outbox", outboxColumns...),
			relationMsg(16385, "public", "messages", "id", "conversation_id", "role", "content", "created_at"),
		} {
			_, err := d.decode(rel)
			require.NoError(t, err)
		}
		_, _ = decodeNoPanic(t, d, a) // only that it does not panic
		_, _ = decodeNoPanic(t, d, b)
	})
}
