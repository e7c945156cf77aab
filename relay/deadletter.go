package relay

import (
	"encoding/json"
	"fmt"
	"log/slog"

	"github.com/jackc/pglogrepl"
	"github.com/nats-io/nats.go"

	"github.com/batonhq/baton/wire"
)

// maxDeadLetterReason caps the reason text: it may quote a value of the change.
const maxDeadLetterReason = 1024

// deadLetterMsg builds the dead-letter record of the nth change at lsn (wire.DeadLetterNthMsgID).
func deadLetterMsg(prefix, kind, table, reason string, lsn pglogrepl.LSN, nth int, raw []byte, maxPayload int) *nats.Msg {
	return deadLetterMsgWithID(prefix, wire.DeadLetterNthMsgID(lsn.String(), nth), kind, table, reason, lsn, raw, maxPayload)
}

// inShard makes d the decoder of shard of shards sharded relays (Config.Shard, Config.Shards;
// shards 0: not sharded), for the ids of its dead-letter records (deadLetterID), and returns d.
func (d *decoder) inShard(shard, shards int) *decoder {
	d.shard, d.shards = shard, shards
	return d
}

// deadLetterID is the Nats-Msg-Id of the dead-letter record of the change being decoded, the
// nth at its position: wire.DeadLetterNthMsgID, or for a sharded relay
// wire.DeadLetterShardMsgID. A shard numbers only the changes its publication sends it, so the
// shard's nth change at a position may be another row than another shard's nth there: the
// shard in the id keeps their records apart. A logical decoding message, which every shard
// receives, gets one record per shard.
func (d *decoder) deadLetterID() string {
	if d.shards == 0 {
		return wire.DeadLetterNthMsgID(d.at.String(), d.nth)
	}
	return wire.DeadLetterShardMsgID(d.shard, d.shards, d.at.String(), d.nth)
}

// deadLetterMsgWithID builds a dead-letter record with Nats-Msg-Id msgID, on
// <prefix>.deadletter.<kind>, no larger than maxPayload (0: no limit): Raw is cut to
// wire.MaxDeadLetterRaw bytes, and further until the record fits; under an absurdly small max
// payload the reason is cut too.
func deadLetterMsgWithID(prefix, msgID, kind, table, reason string, lsn pglogrepl.LSN, raw []byte, maxPayload int) *nats.Msg {
	return deadLetterMsgSized(prefix, msgID, kind, table, reason, lsn, raw, len(raw), maxPayload)
}

// deadLetterMsgSized is deadLetterMsgWithID for a change of rawBytes bytes of which raw is the
// start.
func deadLetterMsgSized(prefix, msgID, kind, table, reason string, lsn pglogrepl.LSN, raw []byte, rawBytes, maxPayload int) *nats.Msg {
	if len(reason) > maxDeadLetterReason {
		reason = reason[:maxDeadLetterReason] + "…"
	}
	rec := wire.DeadLetter{LSN: lsn.String(), Kind: kind, Table: table, Reason: reason, RawBytes: rawBytes}
	rec.Raw = raw[:min(len(raw), wire.MaxDeadLetterRaw)]
	m := nats.NewMsg(wire.DeadLetterSubject(prefix, kind))
	m.Header.Set(nats.MsgIdHdr, msgID)
	for {
		body, err := json.Marshal(rec)
		if err != nil { // a struct of strings, ints and bytes: cannot happen
			panic(fmt.Sprintf("marshal dead-letter record: %v", err))
		}
		size := msgSize(m.Header, body)
		if maxPayload <= 0 || size <= maxPayload || len(rec.Raw) == 0 && rec.Reason == "" {
			m.Data = body
			return m
		}
		if len(rec.Raw) > 0 {
			// base64 takes 4 bytes per 3: cut what is over, with some slack.
			rec.Raw = rec.Raw[:max(0, len(rec.Raw)-((size-maxPayload)*3/4+3))]
		} else { // a max payload of a few hundred bytes: the reason goes too (it is logged)
			rec.Reason = rec.Reason[:max(0, len(rec.Reason)-(size-maxPayload))]
		}
	}
}

// logSetAside logs at ERROR the change of it, a dead-letter record, set aside; at names where
// the change was (its "lsn", or the "outbox_id" of a backfilled row).
func logSetAside(log *slog.Logger, it item, at ...any) {
	log.Error("change cannot be published; setting it aside in the dead-letter stream",
		append(at, "kind", it.deadLetter, "subject", it.msg.Subject, "reason", it.reason)...)
}
