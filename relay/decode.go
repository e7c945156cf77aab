package relay

import (
	"encoding/json"
	"fmt"
	"strconv"
	"strings"
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
	omitted    bool // an outcome published without its content
}

// decoder turns pgoutput messages (protocol version 1) into items. It is pure: no I/O.
//
// Relation messages may repeat within one stream; the cache is keyed by relation OID and
// entries are replaced.
type decoder struct {
	schema     string
	prefix     string
	maxPayload int

	relations map[uint32]*relation
	// answers maps a reply's message id to the outbox ids it answers, for the current
	// transaction (see AnswersPrefix).
	answers map[string][]int64
}

func newDecoder(schema, prefix string, maxPayload int) *decoder {
	return &decoder{
		schema:     schema,
		prefix:     prefix,
		maxPayload: maxPayload,
		relations:  map[uint32]*relation{},
	}
}

func (d *decoder) decode(walData []byte) (item, error) {
	msg, err := pglogrepl.Parse(walData)
	if err != nil {
		return item{}, fmt.Errorf("parse pgoutput message: %w", err)
	}
	switch m := msg.(type) {
	case *pglogrepl.RelationMessage:
		d.relations[m.RelationID] = newRelation(m, d.schema)
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

// relation is a cached relation message with the positions of the columns the relay reads,
// resolved once per relation message instead of once per row.
type relation struct {
	msg  *pglogrepl.RelationMessage
	kind string         // tableOutbox, tableMessages, or "" for a table we do not publish
	pos  map[string]int // column name → position, for the columns of kind
}

func newRelation(m *pglogrepl.RelationMessage, schema string) *relation {
	r := &relation{msg: m, pos: map[string]int{}}
	if m.Namespace != schema || (m.RelationName != tableOutbox && m.RelationName != tableMessages) {
		return r
	}
	r.kind = m.RelationName
	for i, c := range m.Columns {
		r.pos[c.Name] = i
	}
	return r
}

// value returns the text of column name in tuple; NULL and a missing column are "".
func (r *relation) value(t *pglogrepl.TupleData, name string) (string, error) {
	i, ok := r.pos[name]
	if !ok || i >= len(t.Columns) {
		return "", fmt.Errorf("%s.%s has no column %s", r.msg.Namespace, r.msg.RelationName, name)
	}
	switch c := t.Columns[i]; c.DataType {
	case 't':
		return string(c.Data), nil
	case 'n':
		return "", nil
	default:
		return "", fmt.Errorf("%s.%s column %s: unexpected tuple data type %q", r.msg.Namespace, r.msg.RelationName, name, c.DataType)
	}
}

func (d *decoder) insert(m *pglogrepl.InsertMessage) (item, error) {
	rel, ok := d.relations[m.RelationID]
	if !ok {
		return item{}, fmt.Errorf("insert into relation %d before its relation message", m.RelationID)
	}
	if rel.kind == "" {
		return item{kind: itemIgnored}, nil
	}
	if m.Tuple == nil || len(m.Tuple.Columns) != len(rel.msg.Columns) {
		return item{}, fmt.Errorf("%s.%s: tuple has %d columns, relation %d",
			rel.msg.Namespace, rel.msg.RelationName, tupleLen(m.Tuple), len(rel.msg.Columns))
	}
	col := func(name string, dst *string, err *error) {
		if *err == nil {
			*dst, *err = rel.value(m.Tuple, name)
		}
	}
	var err error
	var created string
	switch rel.kind {
	case tableOutbox:
		var row TurnEvent
		var id, attempts string
		col("id", &id, &err)
		col("conversation_id", &row.ConversationID, &err)
		col("message_id", &row.MessageID, &err)
		col("status", &row.Status, &err)
		col("attempts", &attempts, &err)
		col("created_at", &created, &err)
		if err != nil {
			return item{}, err
		}
		if row.OutboxID, err = strconv.ParseInt(id, 10, 64); err != nil {
			return item{}, fmt.Errorf("agent_outbox.id %q: %w", id, err)
		}
		if row.Attempts, err = strconv.Atoi(attempts); err != nil {
			return item{}, fmt.Errorf("agent_outbox %d attempts %q: %w", row.OutboxID, attempts, err)
		}
		if row.CreatedAt, err = parseTimestamptz(created); err != nil {
			return item{}, fmt.Errorf("agent_outbox %d created_at: %w", row.OutboxID, err)
		}
		msg, err := turnMsg(d.prefix, row)
		if err != nil {
			return item{}, err
		}
		return item{kind: itemEvent, msg: msg}, nil
	default: // tableMessages
		var ev OutcomeEvent
		col("role", &ev.Role, &err)
		if err == nil && ev.Role == "user" {
			// The publication's row filter keeps these out; a publication without it must not
			// turn user messages into outcomes.
			return item{kind: itemIgnored}, nil
		}
		col("id", &ev.MessageID, &err)
		col("conversation_id", &ev.ConversationID, &err)
		col("content", &ev.Content, &err)
		col("created_at", &created, &err)
		if err != nil {
			return item{}, err
		}
		if ev.CreatedAt, err = parseTimestamptz(created); err != nil {
			return item{}, fmt.Errorf("message %q created_at: %w", ev.MessageID, err)
		}
		ev.OutboxIDs = d.answers[ev.MessageID]
		msg, err := outcomeMsg(d.prefix, ev, d.maxPayload)
		if err != nil {
			return item{}, err
		}
		return item{kind: itemEvent, msg: msg, outcome: true, omitted: msg.Header.Get(HeaderContentOmitted) != ""}, nil
	}
}

func tupleLen(t *pglogrepl.TupleData) int {
	if t == nil {
		return 0
	}
	return len(t.Columns)
}

// parseTimestamptz parses timestamptz in Postgres' text output (DateStyle ISO), whatever the
// session time zone's offset form (+00, +05:30, -03:30:12). The relay's sessions use UTC.
func parseTimestamptz(s string) (time.Time, error) {
	layout := "2006-01-02 15:04:05.999999999-07"
	if i := strings.LastIndexAny(s, "+-"); i > 10 {
		switch len(s) - i {
		case 6:
			layout = "2006-01-02 15:04:05.999999999-07:00"
		case 9:
			layout = "2006-01-02 15:04:05.999999999-07:00:00"
		}
	}
	t, err := time.Parse(layout, s)
	if err != nil {
		return time.Time{}, fmt.Errorf("parse timestamptz %q: %w", s, err)
	}
	return t.UTC(), nil
}
