package relay

import (
	"bytes"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"strconv"
	"strings"
	"time"

	"github.com/jackc/pglogrepl"
	"github.com/nats-io/nats.go"

	"github.com/batonhq/baton/wire"
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
	// traceDropped says the row's trace_context was not a valid traceparent: the event goes
	// without one (counted, never an error).
	traceDropped bool
	// deadLetter is, for the dead-letter record of a change set aside, its kind
	// (wire.DeadLetterAnswers, wire.DeadLetterTurn, wire.DeadLetterOutcome); msg is the record and reason
	// says why, for the log.
	deadLetter string
	reason     string
	// answer says a keepalive answers one of the relay's status updates (each asks for a
	// reply): the walsender sends those at once, caught up or not, so they say nothing about
	// whether the relay is behind (see caughtUp).
	answer bool
}

// decoder turns pgoutput messages (protocol version 1) into items. It is pure: no I/O. No
// input makes it panic: a message it cannot read is an error (FuzzDecode).
//
// No poison loop: a change that is well-formed pgoutput but cannot become an event for a
// reason no retry can fix (a wire.AnswersPrefix message that is not the expected JSON, a row value
// that cannot be parsed, an event that cannot fit the server's max payload) becomes the item
// of its dead-letter record instead (item.deadLetter), published in its place like any event:
// the transaction is confirmed only once the record has its PubAck, and every other change of
// it is published as usual. Errors are left for what is not pgoutput as Postgres writes it
// (truncated messages, an insert before its relation): no role can write those.
//
// Relation messages may repeat within one stream; the cache is keyed by relation OID and
// entries are replaced.
type decoder struct {
	schema     string
	prefix     string
	maxPayload int

	relations map[uint32]*relation
	// answers maps a reply's message id to the outbox ids it answers, for the current
	// transaction (see wire.AnswersPrefix); answersBytes is what they hold (answers.size),
	// at most maxTxAnswersBytes.
	answers      map[string]answers
	answersBytes int
	cols         []tupleColumn // reused by every insert

	at  pglogrepl.LSN // the WAL position of the message being decoded (decodeAt)
	nth int           // which insert or logical message at that position it is, from 0
	raw []byte        // the message being decoded

	shard, shards int // a sharded relay's shard, for dead-letter ids (inShard; shards 0: not sharded)
}

// tupleColumn is one column of a pgoutput tuple: kind 'n' (null), 'u' (unchanged TOAST),
// 't' (text) or 'b' (binary), and for 't' and 'b' the bytes, which point into the message.
type tupleColumn struct {
	kind byte
	data []byte
}

// errTruncated is wrapped by decode errors of a message that ends before its contents do.
var errTruncated = errors.New("pgoutput message ends early")

// decodeInsert decodes the body of a pgoutput insert message (after its 'I'): the relation id
// and the new tuple's columns, appended to cols. The columns' data alias src.
func decodeInsert(src []byte, cols []tupleColumn) (uint32, []tupleColumn, error) {
	if len(src) < 7 {
		return 0, cols, fmt.Errorf("%w: insert message of %d bytes", errTruncated, len(src))
	}
	relID := binary.BigEndian.Uint32(src)
	if src[4] != 'N' {
		return 0, cols, fmt.Errorf("insert tuple type %q, want 'N'", src[4])
	}
	cols, rest, err := decodeTuple(src[5:], cols)
	if err != nil {
		return 0, cols, fmt.Errorf("insert %w", err)
	}
	if len(rest) != 0 {
		return 0, cols, fmt.Errorf("insert message has %d bytes after its tuple", len(rest))
	}
	return relID, cols, nil
}

// decodeTuple decodes pgoutput TupleData (column count, then each column) from src, appends
// the columns to cols and returns the bytes after it. The columns' data alias src. Lengths are
// checked before use, so no input allocates or reads past src.
func decodeTuple(src []byte, cols []tupleColumn) ([]tupleColumn, []byte, error) {
	if len(src) < 2 {
		return cols, nil, fmt.Errorf("%w: tuple column count", errTruncated)
	}
	n := int(binary.BigEndian.Uint16(src))
	src = src[2:]
	for i := range n {
		if len(src) < 1 {
			return cols, nil, fmt.Errorf("%w: column %d of %d", errTruncated, i, n)
		}
		c := tupleColumn{kind: src[0]}
		src = src[1:]
		switch c.kind {
		case 'n', 'u':
		case 't', 'b':
			if len(src) < 4 {
				return cols, nil, fmt.Errorf("%w: column %d's length", errTruncated, i)
			}
			size := binary.BigEndian.Uint32(src)
			if int64(size) > int64(len(src)-4) {
				return cols, nil, fmt.Errorf("%w: column %d of %d bytes, %d left", errTruncated, i, size, len(src)-4)
			}
			c.data, src = src[4:4+size:4+size], src[4+size:]
		default:
			return cols, nil, fmt.Errorf("column %d: unknown kind %q", i, c.kind)
		}
		cols = append(cols, c)
	}
	return cols, src, nil
}

// checkIgnored checks the structure of a pgoutput update ('U'), delete ('D') or truncate ('T')
// message, which the relay counts and does not publish, without pglogrepl: its decoders
// allocate what the message declares (a truncate of 2^32 relations, a column of 4 GiB) before
// finding out that the bytes are not there.
func checkIgnored(walData []byte, cols []tupleColumn) ([]tupleColumn, error) {
	kind, src := walData[0], walData[1:]
	switch kind {
	case 'T':
		if len(src) < 5 {
			return cols, fmt.Errorf("%w: truncate message of %d bytes", errTruncated, len(src))
		}
		n := int64(binary.BigEndian.Uint32(src))
		if rest := int64(len(src) - 5); rest != 4*n {
			return cols, fmt.Errorf("%w: truncate of %d relations has %d bytes of ids", errTruncated, n, rest)
		}
		return cols, nil
	case 'U', 'D':
	default:
		return cols, fmt.Errorf("message type %q is not an update, delete or truncate", kind)
	}
	if len(src) < 5 {
		return cols, fmt.Errorf("%w: %q message of %d bytes", errTruncated, kind, len(src))
	}
	src = src[4:] // relation id
	var err error
	if src[0] == 'K' || src[0] == 'O' { // the old key or row; an update may leave it out
		if cols, src, err = decodeTuple(src[1:], cols[:0]); err != nil {
			return cols, fmt.Errorf("%q message old tuple: %w", kind, err)
		}
	} else if kind == 'D' {
		return cols, fmt.Errorf("delete tuple type %q, want 'K' or 'O'", src[0])
	}
	if kind == 'U' {
		if len(src) < 1 || src[0] != 'N' {
			return cols, fmt.Errorf("%w: update message without its new tuple", errTruncated)
		}
		if cols, src, err = decodeTuple(src[1:], cols[:0]); err != nil {
			return cols, fmt.Errorf("update message new tuple: %w", err)
		}
	}
	if len(src) != 0 {
		return cols, fmt.Errorf("%q message has %d bytes after its tuples", kind, len(src))
	}
	return cols, nil
}

// parseMessage is pglogrepl.Parse, with its panics turned into errors: its decoders index the
// message without checking its length, so an empty or truncated message would end the process,
// and the relay would meet the same message again after every restart. Inputs are the message
// kinds whose decoders allocate nothing the message declares (not 'U', 'D', 'T').
func parseMessage(walData []byte) (msg pglogrepl.Message, err error) {
	if len(walData) == 0 {
		return nil, fmt.Errorf("%w: empty message", errTruncated)
	}
	defer func() {
		if r := recover(); r != nil {
			msg, err = nil, fmt.Errorf("%w: %q message of %d bytes: %v", errTruncated, walData[0], len(walData), r)
		}
	}()
	// Capped: a length past the end must fail, not read the bytes after the message that
	// happen to lie in the same buffer (pglogrepl slices message content by its declared length).
	return pglogrepl.Parse(walData[:len(walData):len(walData)])
}

func newDecoder(schema, prefix string, maxPayload int) *decoder {
	return &decoder{
		schema:     schema,
		prefix:     prefix,
		maxPayload: maxPayload,
		relations:  map[uint32]*relation{},
	}
}

// decodeAt decodes walData, the pgoutput message at WAL position at (its XLogData's
// WALStart), which names the dead-letter record of a change set aside.
func (d *decoder) decodeAt(at pglogrepl.LSN, walData []byte) (item, error) {
	d.position(at, walData)
	return d.decode(walData)
}

// position records that walData is the next message at WAL position at, for the ids of
// dead-letter records. The rows of one COPY share a position: number the changes there,
// inserts and logical messages only (the ones that can be set aside). Relation messages are
// not counted: a session sends one before a relation's first change, so a replay may send one
// where the first session did not.
func (d *decoder) position(at pglogrepl.LSN, walData []byte) {
	if at != d.at {
		d.at, d.nth = at, -1
	}
	if len(walData) > 0 && (walData[0] == 'I' || walData[0] == 'M') {
		d.nth++
	}
}

// deadLetter returns the item of the dead-letter record of the message being decoded.
func (d *decoder) deadLetter(kind, table, reason string, raw []byte) item {
	return d.deadLetterSized(kind, table, reason, raw, len(raw))
}

// deadLetterSized is deadLetter for a change of size bytes of which raw is the start.
func (d *decoder) deadLetterSized(kind, table, reason string, raw []byte, size int) item {
	return item{
		kind:       itemEvent,
		msg:        deadLetterMsgSized(d.prefix, d.deadLetterID(), kind, table, reason, d.at, raw, size, d.maxPayload),
		deadLetter: kind,
		reason:     reason,
	}
}

func (d *decoder) decode(walData []byte) (item, error) {
	d.raw = walData
	if len(walData) > 0 && walData[0] == 'I' {
		// Inserts are most of the stream: decoded in place, without pglogrepl's allocation
		// and copy per column.
		relID, cols, err := decodeInsert(walData[1:], d.cols[:0])
		if err != nil {
			return item{}, fmt.Errorf("parse pgoutput insert: %w", err)
		}
		d.cols = cols
		return d.insert(relID, cols)
	}
	if len(walData) > 0 && (walData[0] == 'U' || walData[0] == 'D' || walData[0] == 'T') {
		// The publication publishes inserts only; another publication setting sends these.
		cols, err := checkIgnored(walData, d.cols[:0])
		d.cols = cols
		if err != nil {
			return item{}, fmt.Errorf("parse pgoutput message: %w", err)
		}
		return item{kind: itemIgnored}, nil
	}
	msg, err := parseMessage(walData)
	if err != nil {
		return item{}, fmt.Errorf("parse pgoutput message: %w", err)
	}
	switch m := msg.(type) {
	case *pglogrepl.RelationMessage:
		d.relations[m.RelationID] = newRelation(m, d.schema)
	case *pglogrepl.BeginMessage:
		d.answers, d.answersBytes = nil, 0
		return item{kind: itemBegin, lsn: m.FinalLSN, commitTime: m.CommitTime}, nil
	case *pglogrepl.CommitMessage:
		d.answers, d.answersBytes = nil, 0
		return item{kind: itemCommit, lsn: m.TransactionEndLSN, commitTime: m.CommitTime}, nil
	case *pglogrepl.LogicalDecodingMessage:
		if m.Transactional && m.Prefix == wire.AnswersPrefix {
			return d.answer(m.Content), nil
		}
	}
	return item{}, nil
}

// maxTxAnswersBytes bounds what the decoder holds of one transaction's wire.AnswersPrefix
// messages (answers.size of each held message): 16 MiB. A worker's transaction holds one
// message per reply it commits, of a few hundred bytes to 8 KiB of ids each (a thousand
// ids at most are held per message); the bound only stops what another role may emit,
// which no retry makes fit.
const maxTxAnswersBytes = 16 << 20

// answer holds the content of a transactional wire.AnswersPrefix message for the outcome
// of its reply, later in the transaction. Any role can emit this message, in any number and
// of any size up to MaxChangeBytes: it only adds optional ids to an outcome, so one that is not
// the expected JSON, or would take the transaction's held answers past maxTxAnswersBytes,
// loses just those ids and returns the item of its dead-letter record (logged, counted and
// set aside like every other).
func (d *decoder) answer(content []byte) item {
	a, err := parseAnswers(content)
	if err != nil {
		return d.deadLetter(wire.DeadLetterAnswers, "", err.Error(), content)
	}
	held := d.answersBytes
	if old, ok := d.answers[a.messageID]; ok { // the last message for a reply wins
		held -= old.size()
	}
	if held+a.size() > maxTxAnswersBytes {
		reason := fmt.Sprintf("%s messages of this transaction would hold %d bytes, more than the relay's bound of %d; "+
			"this one's %d outbox ids are left off its reply's outcome", wire.AnswersPrefix, held+a.size(), maxTxAnswersBytes, a.total)
		return d.deadLetter(wire.DeadLetterAnswers, "", reason, content)
	}
	if d.answers == nil {
		d.answers = map[string]answers{}
	}
	d.answers[a.messageID] = a
	d.answersBytes = held + a.size()
	return item{}
}

// answers is what the decoder keeps of a wire.AnswersPrefix message: its reply's message id,
// the first wire.MaxBodyOutboxIDs outbox ids (all an outcome event carries), and the count of
// every id it listed.
type answers struct {
	messageID string
	ids       []int64
	total     int
}

// size is what a held answers message costs: its message id, its ids and the map entry.
func (a answers) size() int { return len(a.messageID) + 8*cap(a.ids) + 64 }

// parseAnswers parses the content of a wire.AnswersPrefix message: a JSON object with a non-empty
// message_id and an array of outbox ids (integers), as encoding/json reads it into
// {MessageID string; OutboxIDs []int64} (unknown fields ignored, keys matched without case, the
// last of a repeated key wins), without ever holding more than wire.MaxBodyOutboxIDs ids: the
// rest are checked and counted, not stored (a message of up to MaxChangeBytes lists millions).
func parseAnswers(content []byte) (answers, error) {
	var a struct {
		MessageID string     `json:"message_id"`
		OutboxIDs answersIDs `json:"outbox_ids"`
	}
	if err := json.Unmarshal(content, &a); err != nil {
		return answers{}, fmt.Errorf("%s message is not the expected JSON object: %w", wire.AnswersPrefix, err)
	}
	if a.MessageID == "" {
		return answers{}, fmt.Errorf("%s message has no message_id", wire.AnswersPrefix)
	}
	return answers{messageID: a.MessageID, ids: a.OutboxIDs.ids, total: a.OutboxIDs.total}, nil
}

// answersIDs is the outbox_ids array of an answers message: its first wire.MaxBodyOutboxIDs
// ids and the count of all.
type answersIDs struct {
	ids   []int64
	total int
}

// UnmarshalJSON reads b, the outbox_ids value: null, or an array of integers that fit an
// int64. encoding/json calls it with a value it has checked to be valid JSON, a slice of the
// message's bytes: so every element that is not a number (a string, which may hold commas, an
// array, an object, a literal) starts a comma-separated piece that is not a number, and fails.
func (a *answersIDs) UnmarshalJSON(b []byte) error {
	*a = answersIDs{}
	b = trimJSONSpace(b)
	if string(b) == "null" {
		return nil
	}
	if len(b) < 2 || b[0] != '[' || b[len(b)-1] != ']' {
		return errors.New("outbox_ids is not an array")
	}
	elems := trimJSONSpace(b[1 : len(b)-1])
	if len(elems) == 0 {
		return nil
	}
	a.ids = make([]int64, 0, min(wire.MaxBodyOutboxIDs, bytes.Count(elems, []byte{','})+1))
	for len(elems) > 0 {
		elem := elems
		if i := bytes.IndexByte(elems, ','); i >= 0 {
			elem, elems = elems[:i], elems[i+1:]
		} else {
			elems = nil
		}
		id, ok := parseOutboxID(trimJSONSpace(elem))
		if !ok {
			return fmt.Errorf("outbox_ids[%d] is not an integer id", a.total)
		}
		if len(a.ids) < wire.MaxBodyOutboxIDs {
			a.ids = append(a.ids, id)
		}
		a.total++
	}
	return nil
}

// parseOutboxID parses b, a JSON number, as an int64: false for a fraction, an exponent, a
// value out of range, or anything that is not a number.
func parseOutboxID(b []byte) (int64, bool) {
	neg := len(b) > 0 && b[0] == '-'
	if neg {
		b = b[1:]
	}
	if len(b) == 0 {
		return 0, false
	}
	var n int64
	for _, c := range b {
		if c < '0' || c > '9' {
			return 0, false
		}
		digit := int64(c - '0')
		if neg {
			if n < (math.MinInt64+digit)/10 {
				return 0, false
			}
			n = n*10 - digit
		} else {
			if n > (math.MaxInt64-digit)/10 {
				return 0, false
			}
			n = n*10 + digit
		}
	}
	return n, true
}

// trimJSONSpace returns b without the JSON whitespace (space, tab, CR, LF) around it.
func trimJSONSpace(b []byte) []byte {
	isSpace := func(c byte) bool { return c == ' ' || c == '\t' || c == '\r' || c == '\n' }
	for len(b) > 0 && isSpace(b[0]) {
		b = b[1:]
	}
	for len(b) > 0 && isSpace(b[len(b)-1]) {
		b = b[:len(b)-1]
	}
	return b
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

// value returns the text of column name in tuple; NULL is "", a missing column an error.
func (r *relation) value(t []tupleColumn, name string) (string, error) {
	i, ok := r.pos[name]
	if !ok || i >= len(t) {
		return "", fmt.Errorf("%s.%s has no column %s", r.msg.Namespace, r.msg.RelationName, name)
	}
	switch c := t[i]; c.kind {
	case 't':
		return string(c.data), nil
	case 'n':
		return "", nil
	default:
		return "", fmt.Errorf("%s.%s column %s: unexpected tuple data type %q", r.msg.Namespace, r.msg.RelationName, name, c.kind)
	}
}

func (d *decoder) insert(relID uint32, tuple []tupleColumn) (item, error) {
	rel, ok := d.relations[relID]
	if !ok {
		return item{}, fmt.Errorf("insert into relation %d before its relation message", relID)
	}
	if rel.kind == "" {
		return item{kind: itemIgnored}, nil
	}
	it, err := d.event(rel, tuple)
	if err != nil {
		// Everything event reports is a property of the change itself, which a replay
		// delivers unchanged: set it aside.
		kind := wire.DeadLetterTurn
		if rel.kind == tableMessages {
			kind = wire.DeadLetterOutcome
		}
		return d.deadLetter(kind, rel.msg.Namespace+"."+rel.msg.RelationName, err.Error(), d.raw), nil
	}
	return it, nil
}

// optional returns the text of column name in tuple, or "" when it is NULL, of another
// kind, or missing: a column the relay can do without (trace_context) never sets a row aside.
func (r *relation) optional(t []tupleColumn, name string) string {
	i, ok := r.pos[name]
	if !ok || i >= len(t) || t[i].kind != 't' {
		return ""
	}
	return string(t[i].data)
}

// event makes the event of an insert into agent_outbox or messages. Its errors are the
// change's: a missing column, a value that cannot be parsed, a conversation id no subject can
// carry, an event that cannot fit the max payload.
func (d *decoder) event(rel *relation, tuple []tupleColumn) (item, error) {
	if len(tuple) != len(rel.msg.Columns) {
		return item{}, fmt.Errorf("%s.%s: tuple has %d columns, relation %d",
			rel.msg.Namespace, rel.msg.RelationName, len(tuple), len(rel.msg.Columns))
	}
	col := func(name string, dst *string, err *error) {
		if *err == nil {
			*dst, *err = rel.value(tuple, name)
		}
	}
	var err error
	var created string
	switch rel.kind {
	case tableOutbox:
		var row outboxText
		col("id", &row.ID, &err)
		col("conversation_id", &row.ConversationID, &err)
		col("message_id", &row.MessageID, &err)
		col("status", &row.Status, &err)
		col("attempts", &row.Attempts, &err)
		col("created_at", &row.CreatedAt, &err)
		if err != nil {
			return item{}, err
		}
		var dropped bool
		row.TraceContext, dropped = checkTraceparent(rel.optional(tuple, "trace_context"))
		msg, err := row.turn(d.prefix, d.maxPayload)
		if err != nil {
			return item{}, err
		}
		return item{kind: itemEvent, msg: msg, traceDropped: dropped}, nil
	default: // tableMessages
		var ev wire.OutcomeEvent
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
		if a, ok := d.answers[ev.MessageID]; ok {
			// The ids the decoder did not keep are counted as left out, like those the event
			// has no room for (see outcomeMsg).
			ev.OutboxIDs, ev.OutboxIDsOmitted = a.ids, a.total-len(a.ids)
		}
		tp, dropped := checkTraceparent(rel.optional(tuple, "trace_context"))
		msg, err := outcomeMsg(d.prefix, ev, tp, d.maxPayload)
		if err != nil {
			return item{}, err
		}
		return item{kind: itemEvent, msg: msg, outcome: true, omitted: msg.Header.Get(wire.HeaderContentOmitted) != "",
			traceDropped: dropped}, nil
	}
}

// outboxText is an agent_outbox row as text, in the forms the relay's sessions print (see
// sessionParams), NULL as "": what pgoutput sends, and what the first-start backfill selects.
type outboxText struct {
	ID             string `json:"id"`
	ConversationID string `json:"conversation_id"`
	MessageID      string `json:"message_id"`
	Status         string `json:"status"`
	Attempts       string `json:"attempts"`
	CreatedAt      string `json:"created_at"`
	// TraceContext is the sender's traceparent, valid (checkTraceparent) or "" for none (the
	// backfill does not read it).
	TraceContext string `json:"trace_context,omitempty"`
}

// checkTraceparent returns a stored trace context when it is a valid traceparent
// (wire.ValidTraceparent), else "", and whether one was set but dropped. A stored trace context
// is whatever a role wrote: a malformed one, however long or with whatever bytes, is dropped
// here, so it never reaches a header and never costs an event.
func checkTraceparent(tc string) (traceparent string, dropped bool) {
	if wire.ValidTraceparent(tc) {
		return tc, false
	}
	return "", tc != ""
}

// turn parses the row and builds its turn event. The stream and the backfill both use it, so
// they agree on which rows can be published and how. Its errors are the row's: a value that
// cannot be parsed (a created_at that is not finite, or past the year 9999, or BC), a
// conversation id no subject can carry, an event that cannot fit maxPayload.
func (c *outboxText) turn(prefix string, maxPayload int) (*nats.Msg, error) {
	row := wire.TurnEvent{ConversationID: c.ConversationID, MessageID: c.MessageID, Status: c.Status}
	var err error
	if row.OutboxID, err = strconv.ParseInt(c.ID, 10, 64); err != nil {
		return nil, fmt.Errorf("agent_outbox.id %q: %w", c.ID, err)
	}
	if row.Attempts, err = strconv.Atoi(c.Attempts); err != nil {
		return nil, fmt.Errorf("agent_outbox %d attempts %q: %w", row.OutboxID, c.Attempts, err)
	}
	if row.CreatedAt, err = parseTimestamptz(c.CreatedAt); err != nil {
		return nil, fmt.Errorf("agent_outbox %d created_at: %w", row.OutboxID, err)
	}
	msg, err := turnMsg(prefix, row, c.TraceContext)
	if err != nil {
		return nil, err
	}
	if err := checkTurnSize(msg, row, maxPayload); err != nil {
		return nil, err
	}
	return msg, nil
}

// checkTurnSize returns an error when the turn event msg of row does not fit maxPayload (0:
// no limit). Ids are unbounded text: a message id of a megabyte would be refused by the server
// on every retry. Measured only when the ids are long enough to matter (this runs per row).
func checkTurnSize(msg *nats.Msg, row wire.TurnEvent, maxPayload int) error {
	// Escaped JSON takes at most 6 bytes per byte of an id, a header value 4/3 of it.
	if maxPayload <= 0 || 1024+8*(len(row.ConversationID)+len(row.MessageID)) <= maxPayload {
		return nil
	}
	if size := msgSize(msg.Header, msg.Data); size > maxPayload {
		return fmt.Errorf("turn event for outbox %d is %d bytes, max payload %d", row.OutboxID, size, maxPayload)
	}
	return nil
}

// parseTimestamptz parses timestamptz in Postgres' text output (DateStyle ISO), whatever the
// session time zone's offset form (+00, +05:30, -03:30:12). The relay's sessions use UTC.
func parseTimestamptz(s string) (time.Time, error) {
	if t, ok := parseUTCTimestamptz(s); ok {
		return t, nil
	}
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

// parseUTCTimestamptz parses the form the relay's UTC sessions print, "2006-01-02
// 15:04:05[.fraction]+00", without time.Parse's layout walk; ok is false for any other form.
func parseUTCTimestamptz(s string) (t time.Time, ok bool) {
	if len(s) < 22 || s[len(s)-3:] != "+00" || s[4] != '-' || s[7] != '-' || s[10] != ' ' || s[13] != ':' || s[16] != ':' {
		return time.Time{}, false
	}
	num := func(from, to int) int {
		v := 0
		for i := from; i < to; i++ {
			c := s[i]
			if c < '0' || c > '9' {
				ok = false
				return 0
			}
			v = v*10 + int(c-'0')
		}
		return v
	}
	ok = true
	year, month, day := num(0, 4), num(5, 7), num(8, 10)
	hour, minute, sec := num(11, 13), num(14, 16), num(17, 19)
	nsec := 0
	if frac := s[19 : len(s)-3]; frac != "" {
		if frac[0] != '.' || len(frac) < 2 || len(frac) > 10 {
			return time.Time{}, false
		}
		nsec = num(20, len(s)-3)
		for range 10 - len(frac) {
			nsec *= 10
		}
	}
	// time.Date normalises out-of-range fields; time.Parse rejects them, so leave those to it.
	if !ok || month < 1 || month > 12 || day < 1 || day > 31 || hour > 23 || minute > 59 || sec > 59 {
		return time.Time{}, false
	}
	t = time.Date(year, time.Month(month), day, hour, minute, sec, nsec, time.UTC)
	if t.Day() != day {
		return time.Time{}, false // 31 of a 30-day month and the like
	}
	return t, true
}
