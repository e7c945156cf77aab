package relay

import (
	"encoding/binary"
	"errors"
	"testing"
	"time"

	"github.com/jackc/pglogrepl"
	"github.com/stretchr/testify/require"
)

// keepaliveData builds the body of a primary keepalive CopyData message.
func keepaliveData(walEnd uint64, replyRequested bool) []byte {
	b := binary.BigEndian.AppendUint64([]byte{pglogrepl.PrimaryKeepaliveMessageByteID}, walEnd)
	b = binary.BigEndian.AppendUint64(b, 0) // server time
	if replyRequested {
		return append(b, 1)
	}
	return append(b, 0)
}

// xlogData builds the body of an XLogData CopyData message carrying walData at walStart.
func xlogData(walStart uint64, walData []byte) []byte {
	b := binary.BigEndian.AppendUint64([]byte{pglogrepl.XLogDataByteID}, walStart)
	b = binary.BigEndian.AppendUint64(b, walStart+uint64(len(walData))) // server WAL end
	b = binary.BigEndian.AppendUint64(b, 0)                             // server time
	return append(b, walData...)
}

func TestParseCopyData(t *testing.T) {
	insert := append([]byte{'I'}, insertBody(16384,
		textCols("7", "c1", "m7", "pending", "0", "2026-11-30 01:02:03.123456+00")...)...)
	for name, tc := range map[string]struct {
		data      []byte
		want      copyData // it.msg is checked by subject only
		subject   string
		errPrefix string // "" for no error
		decodeErr bool   // the error wraps errDecode
	}{
		"empty":             {data: nil},
		"unknown type":      {data: []byte{'x', 1, 2, 3}},
		"keepalive":         {data: keepaliveData(0x16B3800, false), want: copyData{it: item{kind: itemKeepalive, lsn: 0x16B3800}}},
		"keepalive, reply":  {data: keepaliveData(0x16B3800, true), want: copyData{it: item{kind: itemKeepalive, lsn: 0x16B3800}, replyRequested: true}},
		"keepalive, short":  {data: keepaliveData(0x16B3800, true)[:17], errPrefix: "parse keepalive"},
		"keepalive, long":   {data: append(keepaliveData(0x16B3800, true), 0), errPrefix: "parse keepalive"},
		"xlogdata, begin":   {data: xlogData(0x16B3700, beginMsg()), want: copyData{it: item{kind: itemBegin, lsn: 0x16B3748, commitTime: time.Unix(946684800+849_000_000, 0).UTC()}, at: 0x16B3700}},
		"xlogdata, insert":  {data: xlogData(0x16B3710, insert), want: copyData{it: item{kind: itemEvent}, at: 0x16B3710}, subject: "agent.turns.c1"},
		"xlogdata, unread":  {data: xlogData(0x16B3720, relationMsg(16390, "public", "other", "id")), want: copyData{at: 0x16B3720}},
		"xlogdata, ignored": {data: xlogData(0x16B3730, deleteMsg(16384)), want: copyData{it: item{kind: itemIgnored}, at: 0x16B3730}},
		"xlogdata, short":   {data: xlogData(0x16B3700, nil)[:24], errPrefix: "parse xlogdata"},
		"xlogdata, empty":   {data: xlogData(0x16B3700, nil), errPrefix: "decode at 0/16B3700", decodeErr: true},
		"truncated insert":  {data: xlogData(0x16B3700, insert[:len(insert)-3]), errPrefix: "decode at 0/16B3700: parse pgoutput insert", decodeErr: true},
		"insert, unknown relation": {data: xlogData(0x16B3700, append([]byte{'I'}, insertBody(99, textCols("7")...)...)),
			errPrefix: "decode at 0/16B3700: insert into relation 99 before its relation message", decodeErr: true},
	} {
		t.Run(name, func(t *testing.T) {
			d := decoderWithRelations(t, 1<<20)
			got, err := d.parseCopyData(tc.data)
			if tc.errPrefix != "" {
				require.ErrorContains(t, err, tc.errPrefix)
				require.Regexp(t, "^"+tc.errPrefix, err.Error())
				require.Equal(t, tc.decodeErr, errors.Is(err, errDecode), "counted as a decode error")
				require.Equal(t, copyData{}, got)
				return
			}
			require.NoError(t, err)
			if tc.subject != "" {
				require.NotNil(t, got.it.msg)
				require.Equal(t, tc.subject, got.it.msg.Subject)
				got.it.msg = nil
			}
			got.it.commitTime = got.it.commitTime.UTC() // compared as an instant
			require.Equal(t, tc.want, got)
		})
	}
}
