package relay

import (
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

// turnMsg builds the turn event of an outbox row. The body is what json.Marshal(row) gives,
// written by hand: this runs once per row on the relay's hot path. traceparent, when not
// empty, is a valid one (checkTraceparent) and goes in wire.HeaderTraceparent.
func turnMsg(prefix string, row wire.TurnEvent, traceparent string) (*nats.Msg, error) {
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
	m := &nats.Msg{Subject: subj, Data: b, Header: nats.Header{
		nats.MsgIdHdr:             {"turn:" + id},
		wire.HeaderOutboxID:       {id},
		wire.HeaderConversationID: {wire.HeaderID(row.ConversationID)},
		wire.HeaderMessageID:      {wire.HeaderID(row.MessageID)},
	}}
	if traceparent != "" {
		m.Header[wire.HeaderTraceparent] = []string{traceparent}
	}
	return m, nil
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

// outcomeMsg builds the outcome event of a reply, with traceparent (valid, or "" for none) in
// wire.HeaderTraceparent, never larger than maxPayload bytes as the
// server measures it (header block plus body; 0 means unknown, no limit). It carries at most
// the first wire.MaxHeaderOutboxIDs answered ids in wire.HeaderOutboxID and the first wire.MaxBodyOutboxIDs in
// the body, with the count of the rest (wire.HeaderOutboxIDsOmitted, outbox_ids_omitted), which
// includes ev.OutboxIDsOmitted: answered ids the caller already left out of ev.OutboxIDs. When that
// is still too large it is built without content and flagged, never dropped; if even that does
// not fit, it carries fewer ids (halving) down to none. An event that does not fit without
// content and ids (an absurdly small max payload) is an error wrapping errOutcomeTooLarge:
// publishing it could only fail with ErrMaxPayload on every retry.
func outcomeMsg(prefix string, ev wire.OutcomeEvent, traceparent string, maxPayload int) (*nats.Msg, error) {
	subj, err := wire.OutcomeSubject(prefix, ev.ConversationID)
	if err != nil {
		return nil, fmt.Errorf("outcome event for message %q: %w", ev.MessageID, err)
	}
	ev.ContentBytes = len(ev.Content)
	m := nats.NewMsg(subj)
	m.Header.Set(nats.MsgIdHdr, wire.OutcomeMsgID(ev.MessageID))
	m.Header.Set(wire.HeaderConversationID, wire.HeaderID(ev.ConversationID))
	m.Header.Set(wire.HeaderMessageID, wire.HeaderID(ev.MessageID))
	m.Header.Set(wire.HeaderRole, ev.Role)
	if traceparent != "" {
		m.Header[wire.HeaderTraceparent] = []string{traceparent}
	}
	all, left := ev.OutboxIDs, max(ev.OutboxIDsOmitted, 0)
	inHeader, inBody := min(len(all), wire.MaxHeaderOutboxIDs), min(len(all), wire.MaxBodyOutboxIDs)
	setIDs := func() {
		delete(m.Header, wire.HeaderOutboxID)
		delete(m.Header, wire.HeaderOutboxIDsOmitted)
		if inHeader > 0 {
			m.Header.Set(wire.HeaderOutboxID, joinIDs(all[:inHeader]))
		}
		if rest := len(all) - inHeader + left; rest > 0 {
			m.Header.Set(wire.HeaderOutboxIDsOmitted, strconv.Itoa(rest))
		}
		ev.OutboxIDs, ev.OutboxIDsOmitted = all[:inBody:inBody], len(all)-inBody+left
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
	m.Header.Set(wire.HeaderContentOmitted, "true")
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
