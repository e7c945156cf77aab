package wire

import (
	"encoding/base64"
	"errors"
	"fmt"
	"strconv"
	"time"
)

// Headers of turn and outcome events. HeaderConversationID and HeaderMessageID carry HeaderID of the
// id: the id itself when it is printable ASCII without spaces and does not start with "~",
// otherwise "~" followed by the unpadded base64url of its bytes (ParseHeaderID reverses it).
// Distinct ids always get distinct values, which survive nats.go unchanged (it trims header
// values and turns CR and LF into spaces), so a hostile id can neither break the header block
// nor pass for another id. The JSON body always carries the exact ids.
const (
	// HeaderOutboxID is, on a turn event, the outbox row's id in decimal; on an outcome, the
	// outbox rows the reply answers, when the worker announced them: the first
	// MaxHeaderOutboxIDs ids, comma-separated.
	HeaderOutboxID = "Baton-Outbox-Id"
	// HeaderConversationID is HeaderID of the conversation id.
	HeaderConversationID = "Baton-Conversation-Id"
	// HeaderMessageID is HeaderID of the message id: the user's message on a turn event, the
	// reply or error message on an outcome.
	HeaderMessageID = "Baton-Message-Id"
	// HeaderRole is, on an outcome, the message's role: "assistant" (a reply) or "error" (a
	// visible failure).
	HeaderRole = "Baton-Role"
	// HeaderContentOmitted is "true" on an outcome whose content did not fit the server's max
	// payload; read the content from the messages table by id.
	HeaderContentOmitted = "Baton-Content-Omitted"
	// HeaderOutboxIDsOmitted is, on an outcome answering more than MaxHeaderOutboxIDs outbox
	// rows, the count of answered ids left out of HeaderOutboxID (which lists the first ones).
	HeaderOutboxIDsOmitted = "Baton-Outbox-Ids-Omitted"
	// HeaderCommitLSN is, on a turn event, an outcome and a dead-letter record relayed from the
	// replication stream, the commit LSN of the Postgres transaction it comes from, as Postgres
	// prints an LSN ("0/16B3748"). A conversation's events carry non-decreasing values. The
	// relay reads it back after a takeover to learn what an earlier session stored (see the
	// relay package). Events of the first-start backfill, which come from a snapshot, carry none.
	HeaderCommitLSN = "Baton-Commit-Lsn"
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
	// Role is "assistant" (a reply) or "error" (a visible failure).
	Role    string `json:"role"`
	Content string `json:"content,omitempty"`
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
