package relay

import (
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"net/textproto"
	"strconv"
	"time"
	"unicode/utf8"

	"github.com/nats-io/nats.go"

	"github.com/batonhq/baton/wire"
)

// Headers every event carries. HeaderConversationID and HeaderMessageID carry HeaderID of the
// id: the id itself when it is printable ASCII without spaces and does not start with "~",
// otherwise "~" followed by the unpadded base64url of its bytes (ParseHeaderID reverses it).
// Distinct ids always get distinct values, which survive nats.go unchanged (it trims header
// values and turns CR and LF into spaces), so a hostile id can neither break the header block
// nor pass for another id. The JSON body always carries the exact ids.
const (
	HeaderOutboxID       = "Baton-Outbox-Id"
	HeaderConversationID = "Baton-Conversation-Id"
	HeaderMessageID      = "Baton-Message-Id"
	HeaderRole           = "Baton-Role"
	// HeaderContentOmitted is "true" on an outcome whose content did not fit the server's max
	// payload; read the content from the messages table by id.
	HeaderContentOmitted = "Baton-Content-Omitted"
	// HeaderOutboxIDsOmitted is, on an outcome answering more than MaxHeaderOutboxIDs outbox
	// rows, the count of answered ids left out of HeaderOutboxID (which lists the first ones).
	HeaderOutboxIDsOmitted = "Baton-Outbox-Ids-Omitted"
)

// Caps on the answered outbox ids an outcome carries, so that an outcome answering any number
// of rows fits the server's max payload. The first ids are kept, the rest counted.
const (
	// MaxHeaderOutboxIDs is the most ids HeaderOutboxID lists (comma-separated).
	MaxHeaderOutboxIDs = 100
	// MaxBodyOutboxIDs is the most ids OutcomeEvent.OutboxIDs holds.
	MaxBodyOutboxIDs = 1000
)

// AnswersPrefix is the prefix of the transactional logical decoding message a worker emits,
// before inserting a reply, to tell the relay which outbox rows the reply answers:
//
//	SELECT pg_logical_emit_message(true, 'baton.answers', '{"message_id":"r1","outbox_ids":[1,2]}')
//
// The relay attaches the ids to the outcome event of that message in the same transaction.
const AnswersPrefix = "baton.answers"

// TurnEvent is the JSON body of a turn event: the outbox row as it was inserted. It carries no
// message content: the outbox is a trigger, the content stays in messages.
type TurnEvent struct {
	OutboxID       int64     `json:"outbox_id"`
	ConversationID string    `json:"conversation_id"`
	MessageID      string    `json:"message_id"`
	Status         string    `json:"status"`
	Attempts       int       `json:"attempts"`
	CreatedAt      time.Time `json:"created_at"`
}

// OutcomeEvent is the JSON body of an outcome event: an assistant reply or a visible error.
type OutcomeEvent struct {
	MessageID      string `json:"message_id"`
	ConversationID string `json:"conversation_id"`
	Role           string `json:"role"`
	Content        string `json:"content,omitempty"`
	// ContentOmitted is true when the content did not fit the server's max payload; ContentBytes
	// still gives its size.
	ContentOmitted bool      `json:"content_omitted,omitempty"`
	ContentBytes   int       `json:"content_bytes"`
	CreatedAt      time.Time `json:"created_at"`
	// OutboxIDs are the outbox rows this message answers, when the worker announced them: the
	// first MaxBodyOutboxIDs of them (fewer if even the event without content would not fit
	// the max payload).
	OutboxIDs []int64 `json:"outbox_ids,omitempty"`
	// OutboxIDsOmitted counts the answered ids left out of OutboxIDs; read the rest from
	// agent_outbox (reply_id) when you need them.
	OutboxIDsOmitted int `json:"outbox_ids_omitted,omitempty"`
}

// TurnMsgID is the Nats-Msg-Id of the turn event of an outbox row.
func TurnMsgID(outboxID int64) string { return "turn:" + strconv.FormatInt(outboxID, 10) }

// OutcomeMsgID is the Nats-Msg-Id of the outcome event of a message: "outcome:" and
// HeaderID(messageID), so distinct message ids never share one, and JetStream never drops an
// outcome as the duplicate of another message's.
func OutcomeMsgID(messageID string) string { return "outcome:" + HeaderID(messageID) }

// headerEncodedMark starts every encoded HeaderID; plain ids never start with it.
const headerEncodedMark = '~'

// isPlainHeaderID reports whether id is its own header value: non-empty, printable ASCII
// without space ('!' to '~'), not starting with headerEncodedMark. Such a value is never
// changed by nats.go and never mistaken for an encoded one.
func isPlainHeaderID(id string) bool {
	if id == "" || id[0] == headerEncodedMark {
		return false
	}
	for i := 0; i < len(id); i++ {
		if id[i] < '!' || id[i] > '~' {
			return false
		}
	}
	return true
}

// HeaderID returns the header value that carries id (a conversation or message id): the id
// itself when it is non-empty printable ASCII without spaces and does not start with "~";
// otherwise "~" followed by the unpadded base64url encoding of its bytes ("~" alone for the
// empty id). The mapping is injective for every string, any length or bytes: plain values
// never start with "~", encoded ones always do, and base64 is injective. ParseHeaderID
// reverses it.
func HeaderID(id string) string {
	if isPlainHeaderID(id) {
		return id
	}
	buf := make([]byte, 1+base64.RawURLEncoding.EncodedLen(len(id)))
	buf[0] = headerEncodedMark
	base64.RawURLEncoding.Encode(buf[1:], []byte(id))
	return string(buf)
}

// ErrInvalidHeaderID is wrapped by ParseHeaderID's errors.
var ErrInvalidHeaderID = errors.New("not a Baton header id")

// ParseHeaderID returns the id whose HeaderID is v. It accepts exactly the values HeaderID
// produces (HeaderID(id) == v whenever it succeeds), and returns an error wrapping
// ErrInvalidHeaderID otherwise.
func ParseHeaderID(v string) (string, error) {
	if v == "" {
		return "", fmt.Errorf("%w: empty", ErrInvalidHeaderID)
	}
	if v[0] != headerEncodedMark {
		if !isPlainHeaderID(v) {
			return "", fmt.Errorf("%w: %q has a byte outside '!'..'~'", ErrInvalidHeaderID, v)
		}
		return v, nil
	}
	payload := v[1:]
	// The alphabet check comes first: the base64 decoder skips '\r' and '\n' even in strict
	// mode. Strict rejects non-zero trailing bits, which would give one id several values.
	for i := 0; i < len(payload); i++ {
		if c := payload[i]; !('a' <= c && c <= 'z' || 'A' <= c && c <= 'Z' || '0' <= c && c <= '9' || c == '_' || c == '-') {
			return "", fmt.Errorf("%w: %q has a byte outside the base64url alphabet", ErrInvalidHeaderID, v)
		}
	}
	id, err := base64.RawURLEncoding.Strict().DecodeString(payload)
	if err != nil {
		return "", fmt.Errorf("%w: %q: %w", ErrInvalidHeaderID, v, err)
	}
	if isPlainHeaderID(string(id)) {
		return "", fmt.Errorf("%w: %q encodes %q, whose header value is the id itself", ErrInvalidHeaderID, v, id)
	}
	return string(id), nil
}

// turnMsg builds the turn event of an outbox row. The body is what json.Marshal(row) gives,
// written by hand: this runs once per row on the relay's hot path.
func turnMsg(prefix string, row TurnEvent) (*nats.Msg, error) {
	subj, err := wire.TurnSubject(prefix, row.ConversationID)
	if err != nil {
		return nil, fmt.Errorf("turn event for outbox %d: %w", row.OutboxID, err)
	}
	b := make([]byte, 0, 160+len(row.ConversationID)+len(row.MessageID))
	b = append(b, `{"outbox_id":`...)
	b = strconv.AppendInt(b, row.OutboxID, 10)
	b = append(b, `,"conversation_id":`...)
	b = appendJSONString(b, row.ConversationID)
	b = append(b, `,"message_id":`...)
	b = appendJSONString(b, row.MessageID)
	b = append(b, `,"status":`...)
	b = appendJSONString(b, row.Status)
	b = append(b, `,"attempts":`...)
	b = strconv.AppendInt(b, int64(row.Attempts), 10)
	b = append(b, `,"created_at":"`...)
	b = row.CreatedAt.AppendFormat(b, time.RFC3339Nano)
	b = append(b, `"}`...)
	id := strconv.FormatInt(row.OutboxID, 10)
	return &nats.Msg{Subject: subj, Data: b, Header: nats.Header{
		nats.MsgIdHdr:        {"turn:" + id},
		HeaderOutboxID:       {id},
		HeaderConversationID: {HeaderID(row.ConversationID)},
		HeaderMessageID:      {HeaderID(row.MessageID)},
	}}, nil
}

// appendJSONString appends s as a JSON string, escaped as encoding/json does (HTML-safe).
func appendJSONString(b []byte, s string) []byte {
	const hex = "0123456789abcdef"
	b = append(b, '"')
	start := 0
	for i := 0; i < len(s); {
		c := s[i]
		if c < utf8.RuneSelf {
			if c >= 0x20 && c != '"' && c != '\\' && c != '<' && c != '>' && c != '&' {
				i++
				continue
			}
			b = append(b, s[start:i]...)
			switch c {
			case '"', '\\':
				b = append(b, '\\', c)
			case '\n':
				b = append(b, '\\', 'n')
			case '\r':
				b = append(b, '\\', 'r')
			case '\t':
				b = append(b, '\\', 't')
			case '\b':
				b = append(b, '\\', 'b')
			case '\f':
				b = append(b, '\\', 'f')
			default:
				b = append(b, '\\', 'u', '0', '0', hex[c>>4], hex[c&0xf])
			}
			i++
			start = i
			continue
		}
		r, size := utf8.DecodeRuneInString(s[i:])
		if r == utf8.RuneError && size == 1 {
			b = append(b, s[start:i]...)
			b = append(b, `\ufffd`...)
			i += size
			start = i
			continue
		}
		if r == '\u2028' || r == '\u2029' {
			b = append(b, s[start:i]...)
			b = append(b, '\\', 'u', '2', '0', '2', hex[r&0xf])
			i += size
			start = i
			continue
		}
		i += size
	}
	b = append(b, s[start:]...)
	return append(b, '"')
}

// outcomeMsg builds the outcome event of a reply, never larger than maxPayload bytes as the
// server measures it (header block plus body; 0 means unknown, no limit). It carries at most
// the first MaxHeaderOutboxIDs answered ids in HeaderOutboxID and the first MaxBodyOutboxIDs in
// the body, with the count of the rest (HeaderOutboxIDsOmitted, outbox_ids_omitted). When that
// is still too large it is built without content and flagged, never dropped; if even that does
// not fit, it carries fewer ids (halving) down to none. An event that does not fit without
// content and ids (an absurdly small max payload) is an error wrapping errOutcomeTooLarge:
// publishing it could only fail with ErrMaxPayload on every retry.
func outcomeMsg(prefix string, ev OutcomeEvent, maxPayload int) (*nats.Msg, error) {
	subj, err := wire.OutcomeSubject(prefix, ev.ConversationID)
	if err != nil {
		return nil, fmt.Errorf("outcome event for message %q: %w", ev.MessageID, err)
	}
	ev.ContentBytes = len(ev.Content)
	m := nats.NewMsg(subj)
	m.Header.Set(nats.MsgIdHdr, OutcomeMsgID(ev.MessageID))
	m.Header.Set(HeaderConversationID, HeaderID(ev.ConversationID))
	m.Header.Set(HeaderMessageID, HeaderID(ev.MessageID))
	m.Header.Set(HeaderRole, ev.Role)
	all := ev.OutboxIDs
	inHeader, inBody := min(len(all), MaxHeaderOutboxIDs), min(len(all), MaxBodyOutboxIDs)
	setIDs := func() {
		delete(m.Header, HeaderOutboxID)
		delete(m.Header, HeaderOutboxIDsOmitted)
		if inHeader > 0 {
			m.Header.Set(HeaderOutboxID, joinIDs(all[:inHeader]))
		}
		if rest := len(all) - inHeader; rest > 0 {
			m.Header.Set(HeaderOutboxIDsOmitted, strconv.Itoa(rest))
		}
		ev.OutboxIDs, ev.OutboxIDsOmitted = all[:inBody:inBody], len(all)-inBody
		if inBody == 0 {
			ev.OutboxIDs = nil
		}
	}
	setIDs()
	body, err := json.Marshal(ev)
	if err != nil {
		return nil, fmt.Errorf("outcome event for message %q: %w", ev.MessageID, err)
	}
	if maxPayload <= 0 || msgSize(m.Header, body) <= maxPayload {
		m.Data = body
		return m, nil
	}
	ev.Content, ev.ContentOmitted = "", true
	m.Header.Set(HeaderContentOmitted, "true")
	for {
		if body, err = json.Marshal(ev); err != nil {
			return nil, fmt.Errorf("outcome event for message %q: %w", ev.MessageID, err)
		}
		size := msgSize(m.Header, body)
		if size <= maxPayload {
			m.Data = body
			return m, nil
		}
		if inHeader == 0 && inBody == 0 {
			return nil, fmt.Errorf("outcome event for message %q: %w: %d bytes without content or ids, max payload %d",
				ev.MessageID, errOutcomeTooLarge, size, maxPayload)
		}
		inHeader, inBody = inHeader/2, inBody/2
		setIDs()
	}
}

// errOutcomeTooLarge is wrapped by the error of an outcome that cannot fit the server's max
// payload even without its content and answered ids. No retry can fix it.
var errOutcomeTooLarge = errors.New("outcome does not fit the max payload")

// msgSize returns the size of a message as NATS measures it against the server's max payload,
// the way nats.go writes it: "NATS/1.0\r\n", "Key: value\r\n" per value (values trimmed),
// "\r\n", then the body. The reply subject does not count.
func msgSize(h nats.Header, body []byte) int {
	if len(h) == 0 {
		return len(body)
	}
	n := len("NATS/1.0\r\n") + len("\r\n")
	for k, vs := range h {
		for _, v := range vs {
			n += len(k) + len(": ") + len(textproto.TrimString(v)) + len("\r\n")
		}
	}
	return n + len(body)
}

func joinIDs(ids []int64) string {
	b := make([]byte, 0, len(ids)*8)
	for i, id := range ids {
		if i > 0 {
			b = append(b, ',')
		}
		b = strconv.AppendInt(b, id, 10)
	}
	return string(b)
}
