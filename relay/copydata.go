package relay

import (
	"errors"
	"fmt"

	"github.com/jackc/pglogrepl"
)

// copyData is what one CopyData message of the replication stream holds.
type copyData struct {
	// it is the item for the pipeline: itemKeepalive with the server's WAL end, or what the
	// decoder made of an XLogData's pgoutput message. itemNone when there is nothing to add.
	it item
	// at is an XLogData's WALStart, the WAL position of its pgoutput message.
	at pglogrepl.LSN
	// replyRequested is set for a keepalive that asks for a standby status update now.
	replyRequested bool
}

// errDecode is wrapped by the errors of parseCopyData that the decoder reported: a pgoutput
// message it could not read, as opposed to a CopyData frame that is not what its type byte says.
var errDecode = errors.New("decode")

// parseCopyData parses data, the body of one CopyData message of the replication stream: a
// primary keepalive, or an XLogData whose pgoutput message it decodes with d (which keeps the
// relation cache and the position of changes; see decoder). Empty messages and message types
// the relay does not read return itemNone. It does no I/O.
func (d *decoder) parseCopyData(data []byte) (copyData, error) {
	if len(data) == 0 {
		return copyData{}, nil
	}
	switch data[0] {
	case pglogrepl.PrimaryKeepaliveMessageByteID:
		ka, err := pglogrepl.ParsePrimaryKeepaliveMessage(data[1:])
		if err != nil {
			return copyData{}, fmt.Errorf("parse keepalive: %w", err)
		}
		return copyData{it: item{kind: itemKeepalive, lsn: ka.ServerWALEnd}, replyRequested: ka.ReplyRequested}, nil
	case pglogrepl.XLogDataByteID:
		xld, err := pglogrepl.ParseXLogData(data[1:])
		if err != nil {
			return copyData{}, fmt.Errorf("parse xlogdata: %w", err)
		}
		it, err := d.decodeAt(xld.WALStart, xld.WALData)
		if err != nil {
			return copyData{}, fmt.Errorf("%w at %s: %w", errDecode, xld.WALStart, err)
		}
		return copyData{it: it, at: xld.WALStart}, nil
	}
	return copyData{}, nil
}

// parseCutCopyData is parseCopyData for the start of an XLogData message of size bytes that
// cutFrames cut at limit (see decodeCutAt).
func (d *decoder) parseCutCopyData(data []byte, size, limit int) (copyData, error) {
	if len(data) == 0 || data[0] != pglogrepl.XLogDataByteID {
		return copyData{}, nil
	}
	xld, err := pglogrepl.ParseXLogData(data[1:])
	if err != nil {
		return copyData{}, fmt.Errorf("parse xlogdata: %w", err)
	}
	return copyData{it: d.decodeCutAt(xld.WALStart, xld.WALData, size, limit), at: xld.WALStart}, nil
}
