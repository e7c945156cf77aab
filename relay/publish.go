package relay

import (
	"errors"
	"fmt"
	"strconv"
	"strings"

	"github.com/nats-io/nats.go"
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
		id, err := strconv.ParseUint(tok, 10, 64)
		if err != nil {
			return // not a subject we published with
		}
		deliver(ackResult{id: id, err: replyError(m)})
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
	msg.Reply = p.prefix + token
	return p.nc.PublishMsg(msg)
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
	if len(m.Data) == 0 {
		if status := m.Header.Get(statusHeader); status != "" {
			if status == "503" {
				return errNoResponders
			}
			return fmt.Errorf("NATS status %s %s", status, m.Header.Get(descriptionHeader))
		}
	}
	ack, err := parsePubAck(m.Data)
	switch {
	case err != nil:
		return err
	case ack.apiErr != nil:
		return ack.apiErr
	case ack.stream == "":
		return fmt.Errorf("%w: no stream in %q", errInvalidPubAck, m.Data)
	}
	return nil
}
