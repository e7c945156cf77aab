package demo

import (
	"context"
	"encoding/json"
	"fmt"
	"log/slog"
	"strings"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/batonhq/baton/wire"
)

// subscribe reads stream from its current end with an ordered consumer, which delivers each
// stored message once, in order, without acks: an id seen twice is a duplicate stored in the
// stream, not a redelivery.
func (d *Demo) subscribe(ctx context.Context, js jetstream.JetStream, stream, filter string,
	handle func(jetstream.Msg)) (jetstream.ConsumeContext, error) {
	st, err := js.Stream(ctx, stream)
	if err != nil {
		return nil, fmt.Errorf("look up stream %s: %w", stream, err)
	}
	cons, err := js.OrderedConsumer(ctx, stream, jetstream.OrderedConsumerConfig{
		FilterSubjects: []string{filter},
		DeliverPolicy:  jetstream.DeliverByStartSequencePolicy,
		OptStartSeq:    st.CachedInfo().State.LastSeq + 1,
	})
	if err != nil {
		return nil, fmt.Errorf("subscribe to stream %s: %w", stream, err)
	}
	cc, err := cons.Consume(handle, jetstream.ConsumeErrHandler(func(_ jetstream.ConsumeContext, err error) {
		d.cfg.Logger.Debug("subscriber", "stream", stream, "error", err)
	}))
	if err != nil {
		return nil, fmt.Errorf("consume stream %s: %w", stream, err)
	}
	return cc, nil
}

// stopConsume stops a subscription and waits for it to end, a few seconds at most.
func stopConsume(cc jetstream.ConsumeContext, stream string, log *slog.Logger) {
	cc.Stop()
	select {
	case <-cc.Closed():
	case <-time.After(5 * time.Second):
		log.Warn("subscriber did not stop within 5s", "stream", stream)
	}
}

// storedAt is when JetStream stored m, or now when its metadata cannot be read.
func storedAt(m jetstream.Msg) time.Time {
	if md, err := m.Metadata(); err == nil {
		return md.Timestamp
	}
	return time.Now()
}

// watchTurns follows the turn events the relay publishes on filter with a core NATS
// subscription. The turns stream is a work queue: its one consumer is the workers', no other
// may read the same subjects (and an ordered consumer, ack none, is refused there). So the
// demo sees each publish on its way to the stream, at about the time it is stored; a replay
// of the relay, which the stream's duplicate window drops, is seen again and not counted.
func (d *Demo) watchTurns(nc *nats.Conn, filter string) (*nats.Subscription, error) {
	sub, err := nc.Subscribe(filter, func(m *nats.Msg) { d.onTurn(m.Subject, m.Data, time.Now()) })
	if err != nil {
		return nil, fmt.Errorf("subscribe to %s: %w", filter, err)
	}
	if err := sub.SetPendingLimits(-1, -1); err != nil { // never drop one: the demo counts them
		_ = sub.Unsubscribe()
		return nil, fmt.Errorf("subscribe to %s: %w", filter, err)
	}
	return sub, nil
}

// onTurn counts a turn event of this run, published at at.
func (d *Demo) onTurn(subject string, data []byte, at time.Time) {
	var ev wire.TurnEvent
	if err := json.Unmarshal(data, &ev); err != nil {
		d.cfg.Logger.Warn("undecodable turn event", "subject", subject, "error", err)
		return
	}
	if !strings.HasPrefix(ev.MessageID, d.msgPrefix()) {
		return // not this run's: another demo, or real traffic on a shared stream
	}
	d.ledger.published(ev.OutboxID, at)
}

// onOutcome is the outcome subscriber: like examples/subscriber it dedupes by message id, and
// it maps each outcome to the sent messages it answers by the outbox ids it names.
func (d *Demo) onOutcome(m jetstream.Msg) {
	var ev wire.OutcomeEvent
	if err := json.Unmarshal(m.Data(), &ev); err != nil || ev.MessageID == "" {
		d.cfg.Logger.Warn("undecodable outcome event", "subject", m.Subject(), "error", err)
		return
	}
	if !strings.HasPrefix(ev.ConversationID, d.convPrefix()) {
		return // not this run's conversations
	}
	if ev.Role != "assistant" && ev.Role != "error" {
		d.cfg.Logger.Warn("outcome with an unexpected role", "message_id", ev.MessageID, "role", ev.Role)
		return
	}
	if len(ev.OutboxIDs) == 0 {
		d.cfg.Logger.Warn("outcome names no outbox ids", "message_id", ev.MessageID)
	}
	d.ledger.outcome(ev.MessageID, ev.Role == "error", ev.OutboxIDs, storedAt(m))
}
