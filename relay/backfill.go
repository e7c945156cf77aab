package relay

import (
	"encoding/json"
	"fmt"
	"strconv"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgtype"

	"github.com/batonhq/baton/wire"
)

// scanOutboxText scans a row of the backfill's query (id, then conversation_id, message_id,
// status, attempts and created_at as text). NULL is "", as the stream decoder reads it.
func scanOutboxText(rows pgx.Rows) (int64, *outboxText, error) {
	var id int64
	var conv, msgID, status, attempts, created pgtype.Text
	if err := rows.Scan(&id, &conv, &msgID, &status, &attempts, &created); err != nil {
		return 0, nil, err
	}
	return id, &outboxText{ID: strconv.FormatInt(id, 10), ConversationID: conv.String, MessageID: msgID.String,
		Status: status.String, Attempts: attempts.String, CreatedAt: created.String}, nil
}

// backfillItem returns the item of an unfinished outbox row that the first-start backfill read
// from table (schema.agent_outbox), given in the text the relay's sessions print, as the stream
// sends it: its turn event or, when the row cannot become one, the dead-letter record of the
// row, published in its place.
//
// No poison loop in the backfill either: a row no retry can publish (see outboxText.turn) is
// set aside as the stream sets aside the same row, and the backfill carries on. Failing on it
// instead would end every session at the same row and the relay would never stream. The record
// has no WAL position (LSN 0/0), carries the row's columns as JSON in Raw, and its Nats-Msg-Id
// is wire.DeadLetterBackfillMsgID of the row: one per row, deduplicated when a backfill runs again.
// The row stays in Postgres with its status, for the workers' sweep.
func backfillItem(prefix, table string, maxPayload int, id int64, row *outboxText) item {
	msg, err := row.turn(prefix, maxPayload)
	if err == nil {
		return item{kind: itemEvent, msg: msg}
	}
	raw, merr := json.Marshal(row)
	if merr != nil { // a struct of strings: cannot happen
		panic(fmt.Sprintf("marshal outbox row: %v", merr))
	}
	reason := err.Error()
	return item{
		kind:       itemEvent,
		msg:        deadLetterMsgWithID(prefix, wire.DeadLetterBackfillMsgID(id), wire.DeadLetterTurn, table, reason, 0, raw, maxPayload),
		deadLetter: wire.DeadLetterTurn,
		reason:     reason,
	}
}
