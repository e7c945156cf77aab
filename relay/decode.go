package relay

import (
	"encoding/json"
	"fmt"
	"strconv"
	"time"

	"github.com/jackc/pglogrepl"
	"github.com/nats-io/nats.go"
)

// Tables the relay publishes from.
const (
	tableOutbox   = "agent_outbox"
	tableMessages = "messages"
)

type itemKind uint8

const (
	itemNone      itemKind = iota
	itemBegin              // a transaction starts; lsn is its commit LSN
	itemCommit             // a transaction ends; lsn is its end LSN
	itemEvent              // one event to publish
	itemIgnored            // a change of a table we do not publish (counted, not published)
	itemKeepalive          // the server's WAL end, from a keepalive; lsn is that end
)

// item is what the decoder makes of one pgoutput message.
type item struct {
	kind       itemKind
	lsn        pglogrepl.LSN
	commitTime time.Time
	msg        *nats.Msg
	outcome    bool // the event is an outcome, not a turn
}

// decoder turns pgoutput messages (protocol version 1) into items. It is pure: no I/O.
//
// Relation messages may repeat within one stream; the cache is keyed by relation OID and
// entries are replaced.
type decoder struct {
	schema     string
	prefix     string
	maxPayload int

	relations map[uint32]*pglogrepl.RelationMessage
	// answers maps a reply's message id to the outbox ids it answers, for the current
	// transaction (see AnswersPrefix).
	answers map[string][]int64
}

func newDecoder(schema, prefix string, maxPayload int) *decoder {
	return &decoder{
		schema:     schema,
		prefix:     prefix,
		maxPayload: maxPayload,
		relations:  map[uint32]*pglogrepl.RelationMessage{},
	}
}

func (d *decoder) decode(walData []byte) (item, error) {
	msg, err := pglogrepl.Parse(walData)
	if err != nil {
		return item{}, fmt.Errorf("parse pgoutput message: %w", err)
	}
	switch m := msg.(type) {
	case *pglogrepl.RelationMessage:
		d.relations[m.RelationID] = m
	case *pglogrepl.BeginMessage:
		d.answers = nil
		return item{kind: itemBegin, lsn: m.FinalLSN, commitTime: m.CommitTime}, nil
	case *pglogrepl.CommitMessage:
		d.answers = nil
		return item{kind: itemCommit, lsn: m.TransactionEndLSN, commitTime: m.CommitTime}, nil
	case *pglogrepl.LogicalDecodingMessage:
		if m.Transactional && m.Prefix == AnswersPrefix {
			var a struct {
				MessageID string  `json:"message_id"`
				OutboxIDs []int64 `json:"outbox_ids"`
			}
			if err := json.Unmarshal(m.Content, &a); err != nil {
				return item{}, fmt.Errorf("decode %s message at %s: %w", AnswersPrefix, m.LSN, err)
			}
			if d.answers == nil {
				d.answers = map[string][]int64{}
			}
			d.answers[a.MessageID] = a.OutboxIDs
		}
	case *pglogrepl.InsertMessage:
		return d.insert(m)
	case *pglogrepl.UpdateMessage, *pglogrepl.DeleteMessage, *pglogrepl.TruncateMessage:
		// The publication publishes inserts only; another publication setting sends these.
		return item{kind: itemIgnored}, nil
	}
	return item{}, nil
}

func (d *decoder) insert(m *pglogrepl.InsertMessage) (item, error) {
	rel, ok := d.relations[m.RelationID]
	if !ok {
		return item{}, fmt.Errorf("insert into relation %d before its relation message", m.RelationID)
	}
	if rel.Namespace != d.schema {
		return item{kind: itemIgnored}, nil
	}
	cols, err := columns(rel, m.Tuple)
	if err != nil {
		return item{}, err
	}
	switch rel.RelationName {
	case tableOutbox:
		row, err := outboxRow(cols)
		if err != nil {
			return item{}, err
		}
		msg, err := turnMsg(d.prefix, row)
		if err != nil {
			return item{}, err
		}
		return item{kind: itemEvent, msg: msg}, nil
	case tableMessages:
		ev, err := messageRow(cols)
		if err != nil {
			return item{}, err
		}
		if ev.Role == "user" {
			// The publication's row filter keeps these out; a publication without it must not
			// turn user messages into outcomes.
			return item{kind: itemIgnored}, nil
		}
		ev.OutboxIDs = d.answers[ev.MessageID]
		msg, err := outcomeMsg(d.prefix, ev, d.maxPayload)
		if err != nil {
			return item{}, err
		}
		return item{kind: itemEvent, msg: msg, outcome: true}, nil
	}
	return item{kind: itemIgnored}, nil
}

// columns maps column names to text values; NULL is absent.
func columns(rel *pglogrepl.RelationMessage, tuple *pglogrepl.TupleData) (map[string]string, error) {
	if tuple == nil || len(tuple.Columns) != len(rel.Columns) {
		return nil, fmt.Errorf("%s.%s: tuple has %d columns, relation %d",
			rel.Namespace, rel.RelationName, tupleLen(tuple), len(rel.Columns))
	}
	out := make(map[string]string, len(rel.Columns))
	for i, c := range tuple.Columns {
		switch c.DataType {
		case 't':
			out[rel.Columns[i].Name] = string(c.Data)
		case 'n':
		default:
			return nil, fmt.Errorf("%s.%s column %s: unexpected tuple data type %q",
				rel.Namespace, rel.RelationName, rel.Columns[i].Name, c.DataType)
		}
	}
	return out, nil
}

func tupleLen(t *pglogrepl.TupleData) int {
	if t == nil {
		return 0
	}
	return len(t.Columns)
}

func outboxRow(c map[string]string) (TurnEvent, error) {
	var row TurnEvent
	var err error
	if row.OutboxID, err = strconv.ParseInt(c["id"], 10, 64); err != nil {
		return row, fmt.Errorf("agent_outbox.id %q: %w", c["id"], err)
	}
	row.ConversationID, row.MessageID, row.Status = c["conversation_id"], c["message_id"], c["status"]
	if row.Attempts, err = strconv.Atoi(c["attempts"]); err != nil {
		return row, fmt.Errorf("agent_outbox %d attempts %q: %w", row.OutboxID, c["attempts"], err)
	}
	if row.CreatedAt, err = parseTimestamptz(c["created_at"]); err != nil {
		return row, fmt.Errorf("agent_outbox %d created_at: %w", row.OutboxID, err)
	}
	return row, nil
}

func messageRow(c map[string]string) (OutcomeEvent, error) {
	ev := OutcomeEvent{MessageID: c["id"], ConversationID: c["conversation_id"], Role: c["role"], Content: c["content"]}
	var err error
	if ev.CreatedAt, err = parseTimestamptz(c["created_at"]); err != nil {
		return ev, fmt.Errorf("message %q created_at: %w", ev.MessageID, err)
	}
	return ev, nil
}

// parseTimestamptz parses timestamptz in Postgres' text output (DateStyle ISO), whatever the
// session time zone's offset form (+00, +05:30, -03:30:12).
func parseTimestamptz(s string) (time.Time, error) {
	for _, layout := range []string{
		"2006-01-02 15:04:05.999999999-07",
		"2006-01-02 15:04:05.999999999-07:00",
		"2006-01-02 15:04:05.999999999-07:00:00",
	} {
		if t, err := time.Parse(layout, s); err == nil {
			return t.UTC(), nil
		}
	}
	return time.Time{}, fmt.Errorf("parse timestamptz %q", s)
}
