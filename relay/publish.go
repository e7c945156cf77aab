package relay

import (
	"errors"
	"fmt"
	"slices"
	"strconv"
	"strings"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
)

// sendFunc publishes msg with the reply subject <inbox>.<token>, where token is
// eventToken(id) for an event published on its own and a batchToken for a message of a
// fast-ingest batch. Its reply reaches the deliver function given to the openSender that
// returned it, as an ackResult.
type sendFunc func(msg *nats.Msg, token string) error

// openSender starts publishing for one pipeline: it routes the reply to every event the
// returned send publishes to deliver, and returns send with a function that stops the routing.
// The pipeline calls it once, on its sender goroutine (see sendLoop). natsSender is the one
// that publishes to JetStream.
type openSender func(deliver func(ackResult)) (send sendFunc, stop func(), err error)

// natsSender returns the openSender of a publisher on nc.
func natsSender(nc *nats.Conn) openSender {
	return func(deliver func(ackResult)) (sendFunc, func(), error) {
		pub, err := newPublisher(nc, deliver)
		if err != nil {
			return nil, nil, err
		}
		return pub.publish, pub.close, nil
	}
}

// publisher publishes events to JetStream over core NATS and hands each PubAck, decoded, to
// deliver. It does the job of jetstream's PublishMsgAsync without what makes that the largest
// share of a relay's CPU per event on a catch-up: a future, a reply subject and a map entry
// per publish, and encoding/json for every PubAck.
//
// Every publish carries the reply subject <inbox>.<token>: the pipeline's number for the
// event, or the reply subject of a fast-ingest batch message (see batchToken), which the
// server needs in that form; one wildcard subscription on <inbox>.> receives all replies.
// The subscription belongs to one pipeline (one session): close unsubscribes it, and replies
// arriving after that are dropped. A reply the pipeline does not expect is ignored there.
type publisher struct {
	nc     *nats.Conn
	prefix string // "<inbox>."
	sub    *nats.Subscription
}

// Headers nats.go fills from a status line ("NATS/1.0 503"); it does not export their names.
const (
	statusHeader      = "Status"
	descriptionHeader = "Description"
)

// errNoResponders is the error of a publish no stream listens to (NATS status 503).
var errNoResponders = errors.New("no responders: no stream stores the subject")

func newPublisher(nc *nats.Conn, deliver func(ackResult)) (*publisher, error) {
	p := &publisher{nc: nc, prefix: nc.NewInbox() + "."}
	sub, err := nc.Subscribe(p.prefix+">", func(m *nats.Msg) {
		tok, ok := strings.CutPrefix(m.Subject, p.prefix)
		if !ok {
			return
		}
		if batch, ok := parseBatchToken(tok); ok {
			deliver(batchResult(batch, m))
			return
		}
		if id, ok := parseAtomicToken(tok); ok {
			deliver(atomicResult(id, m))
			return
		}
		id, err := strconv.ParseUint(tok, 10, 64)
		if err != nil {
			return // not a subject we published with
		}
		seq, dup, err := replyAck(m)
		deliver(ackResult{id: id, err: err, seq: seq, dup: dup})
	})
	if err != nil {
		return nil, fmt.Errorf("subscribe to PubAcks: %w", err)
	}
	// The pipeline bounds what is in flight (MaxInFlight); nats.go's own pending limits must
	// never drop a PubAck (that would only surface as an ack timeout).
	if err := sub.SetPendingLimits(-1, -1); err != nil {
		_ = sub.Unsubscribe()
		return nil, fmt.Errorf("PubAck subscription limits: %w", err)
	}
	p.sub = sub
	return p, nil
}

// publish sends msg with the reply subject <inbox>.<token>. Publishes go out in order on the
// connection, after the subscription that receives their replies.
func (p *publisher) publish(msg *nats.Msg, token string) error {
	msg.Reply = ""
	if token != "" { // "": no answer wanted (an atomic batch's messages before its commit)
		msg.Reply = p.prefix + token
	}
	return p.nc.PublishMsg(msg)
}

// atomicResult reads the answer m to the commit of atomic batch id.
func atomicResult(id string, m *nats.Msg) ackResult {
	a, err := readAck(m)
	return ackResult{atomicID: id, err: err, seq: a.seq, count: a.count}
}

// eventToken is the reply token of event id published on its own.
func eventToken(id uint64) string { return strconv.FormatUint(id, 10) }

// close unsubscribes; replies still on their way are dropped.
func (p *publisher) close() {
	_ = p.sub.Unsubscribe()
}

// replyError returns nil for a PubAck, and the error a reply reports otherwise: a NATS status
// without body (503: no stream listens on the subject), a JetStream API error, or a reply that
// is not a PubAck.
func replyError(m *nats.Msg) error {
	_, _, err := replyAck(m)
	return err
}

// replyAck is replyError, and for a PubAck the stream sequence it reports and whether it says
// "duplicate": the stream had the message's Nats-Msg-Id already.
func replyAck(m *nats.Msg) (seq uint64, dup bool, err error) {
	a, err := readAck(m)
	return a.seq, a.duplicate, err
}

// readAck returns the PubAck m carries, or the error it reports: a NATS status without body
// (503: no stream listens on the subject), a JetStream API error, or a reply that is not a
// PubAck.
func readAck(m *nats.Msg) (pubAck, error) {
	if len(m.Data) == 0 {
		if status := m.Header.Get(statusHeader); status != "" {
			if status == "503" {
				return pubAck{}, errNoResponders
			}
			return pubAck{}, fmt.Errorf("NATS status %s %s", status, m.Header.Get(descriptionHeader))
		}
	}
	ack, err := parsePubAck(m.Data)
	switch {
	case err != nil:
		return pubAck{}, err
	case ack.apiErr != nil:
		return pubAck{}, ack.apiErr
	case ack.stream == "":
		return pubAck{}, fmt.Errorf("%w: no stream in %q", errInvalidPubAck, m.Data)
	}
	return ack, nil
}

// streamFullCodes are the JetStream error codes with which the server refuses to store a
// message for lack of room, in a reply to a publish or to a message of a fast-ingest batch:
// 10077, storing failed (a stream with discard new at its max_msgs or max_bytes: "maximum
// messages exceeded", "maximum bytes exceeded"), 10023, the server's JetStream storage is
// full ("insufficient resources"), and 10002, the account's is. Only the turns stream
// discards new messages; the others make room by dropping their oldest.
var streamFullCodes = []jetstream.ErrorCode{10077, 10023, 10002}

// streamFullError is the error of a publish the stream refused for lack of room. The session
// ends like on any failed publish, with the confirmed LSN held at the refused event's
// transaction; Run retries it after a short wait (see streamFullMaxBackoff) instead of the
// growing backoff of other errors, since room frees as the workers acknowledge turn events.
type streamFullError struct {
	lane    int // the stream's lane (see laneOf)
	stream  string
	subject string
	msgID   string // the refused event's Nats-Msg-Id
	err     *jetstream.APIError
}

func (e *streamFullError) Error() string {
	return fmt.Sprintf("stream %s refused %s for lack of room (error %d: %s)", e.stream, e.subject, e.err.ErrorCode, e.err.Description)
}

func (e *streamFullError) Unwrap() error { return e.err }

// asStreamFull returns err as a *streamFullError when it is the server's refusal to store a
// message msg for lack of room in stream (of lane), and err otherwise.
func asStreamFull(err error, lane int, stream string, msg *nats.Msg) error {
	var api *jetstream.APIError
	if !errors.As(err, &api) || !slices.Contains(streamFullCodes, api.ErrorCode) {
		return err
	}
	// 10077 is any failure to store: also a message too large, or a store closed while its
	// stream stops (a leader change). Only the limits mean "full".
	if api.ErrorCode == 10077 && !strings.Contains(api.Description, "maximum messages exceeded") &&
		!strings.Contains(api.Description, "maximum bytes exceeded") {
		return err
	}
	return &streamFullError{lane: lane, stream: stream, subject: msg.Subject, msgID: msg.Header.Get(nats.MsgIdHdr), err: api}
}
