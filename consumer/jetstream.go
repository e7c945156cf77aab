package consumer

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"time"
	"unicode/utf8"

	"github.com/nats-io/nats.go/jetstream"
	"golang.org/x/sync/errgroup"

	"github.com/batonhq/baton/wire"
)

// jetStreamSource feeds the relay's turn events from the workers' durable consumer to the
// conversation loops, and sweeps Postgres every SweepInterval for pending rows that no event
// woke (older than the interval).
type jetStreamSource struct{ w *Worker }

func (s *jetStreamSource) announcesRows() bool { return true }

func (s *jetStreamSource) run(ctx context.Context) error {
	w := s.w
	g, gctx := errgroup.WithContext(ctx)
	g.Go(func() error { return s.consume(gctx) })
	sweep := w.sweep(w.cfg.SweepInterval)
	g.Go(func() error {
		return w.every(gctx, w.cfg.SweepInterval, func(ctx context.Context) { sweep(ctx) })
	})
	return g.Wait()
}

// consume feeds turn events from the durable consumer to the conversation loops until ctx
// ends. It waits for the stream, which the relay creates.
func (s *jetStreamSource) consume(ctx context.Context) error {
	w := s.w
	js, err := jetstream.New(w.cfg.NATS)
	if err != nil {
		return fmt.Errorf("jetstream: %w", err)
	}
	var stream jetstream.Stream
	for wait := 100 * time.Millisecond; ; wait = min(2*wait, 5*time.Second) {
		stream, err = js.Stream(ctx, w.cfg.Stream)
		if err == nil {
			break
		}
		if ctx.Err() != nil {
			return nil
		}
		w.cfg.Logger.Info("waiting for the turns stream (the relay creates it)", "stream", w.cfg.Stream, "error", err)
		if !sleep(ctx, w.clock, wait) {
			return nil
		}
	}
	cons, err := stream.CreateOrUpdateConsumer(ctx, jetstream.ConsumerConfig{
		Durable:       w.cfg.Durable,
		Description:   "Baton workers",
		FilterSubject: wire.StreamFilter(w.cfg.SubjectPrefix, wire.KindTurns),
		AckPolicy:     jetstream.AckExplicitPolicy,
		AckWait:       w.cfg.AckWait,
		MaxDeliver:    -1, // attempts are capped in Postgres, not by redeliveries
		MaxAckPending: w.cfg.MaxAckPending,
		DeliverPolicy: jetstream.DeliverAllPolicy,
	})
	if err != nil {
		return fmt.Errorf("create consumer %s: %w", w.cfg.Durable, err)
	}
	cc, err := cons.Consume(func(msg jetstream.Msg) { s.onEvent(ctx, msg) },
		jetstream.ConsumeErrHandler(func(_ jetstream.ConsumeContext, err error) {
			if !errors.Is(err, jetstream.ErrNoHeartbeat) || ctx.Err() == nil {
				w.cfg.Logger.Warn("consume", "error", err)
			}
		}))
	if err != nil {
		return fmt.Errorf("consume %s: %w", w.cfg.Durable, err)
	}
	<-ctx.Done()
	cc.Stop()
	<-cc.Closed()
	return nil
}

// onEvent hands a turn event to its conversation's loop. A malformed event is terminated:
// no redelivery can make it readable.
func (s *jetStreamSource) onEvent(ctx context.Context, msg jetstream.Msg) {
	w := s.w
	ev, err := decodeTurnEvent(msg.Headers().Get(wire.HeaderOutboxID), msg.Data())
	if err != nil {
		w.cfg.Logger.Error("malformed turn event; terminating it", "subject", msg.Subject(), "error", err)
		_ = msg.Term()
		w.m.events.WithLabelValues("terminated").Inc()
		return
	}
	if ctx.Err() != nil {
		_ = msg.Nak()
		return
	}
	var seq uint64
	if md, err := msg.Metadata(); err == nil {
		seq = md.Sequence.Stream
	}
	w.schedule(ctx, ev.ConversationID, &event{outboxID: ev.OutboxID, seq: seq, d: jsDelivery{msg: msg, m: w.m}}, ev.CreatedAt)
}

// decodeTurnEvent decodes a turn event from its outbox id header and its body, which must
// agree, and checks its conversation id. Anyone allowed to publish on the turns subjects can
// send anything; only what the relay could have written gets through.
func decodeTurnEvent(outboxHeader string, data []byte) (wire.TurnEvent, error) {
	id, err := strconv.ParseInt(outboxHeader, 10, 64)
	if err != nil {
		return wire.TurnEvent{}, fmt.Errorf("header %s: %w", wire.HeaderOutboxID, err)
	}
	var ev wire.TurnEvent
	if err := json.Unmarshal(data, &ev); err != nil {
		return wire.TurnEvent{}, fmt.Errorf("body: %w", err)
	}
	if ev.OutboxID != id {
		return wire.TurnEvent{}, fmt.Errorf("body names outbox row %d, header %d", ev.OutboxID, id)
	}
	if !validID(ev.ConversationID) {
		return wire.TurnEvent{}, errors.New("conversation id is not 1-200 bytes of text without NUL")
	}
	return ev, nil
}

// validID reports whether id can be a conversation id: 1 to 200 bytes of valid UTF-8 with no
// NUL (what Postgres text and the schema's check accept). An event naming anything else was
// not written by the relay, and would fail every claim it joined.
func validID(id string) bool {
	return id != "" && len(id) <= 200 && utf8.ValidString(id) && !strings.ContainsRune(id, 0)
}

// jsDelivery settles a turn event with JetStream, and counts what it settled.
type jsDelivery struct {
	msg jetstream.Msg
	m   *metrics
}

// ack acknowledges the message: JetStream forgets it.
func (d jsDelivery) ack() error {
	if err := d.msg.Ack(); err != nil {
		return err
	}
	d.m.events.WithLabelValues("acked").Inc()
	return nil
}

// nak negatively acknowledges the message: JetStream redelivers it after delay (at once when 0).
func (d jsDelivery) nak(delay time.Duration) error {
	var err error
	if delay > 0 {
		err = d.msg.NakWithDelay(delay)
	} else {
		err = d.msg.Nak()
	}
	if err != nil {
		return err
	}
	d.m.events.WithLabelValues("nacked").Inc()
	return nil
}

// inProgress resets the message's ack wait: JetStream does not redeliver it for another AckWait.
func (d jsDelivery) inProgress() error { return d.msg.InProgress() }

// storedAt is when the stream stored the message; zero when its metadata cannot be read.
func (d jsDelivery) storedAt() time.Time {
	md, err := d.msg.Metadata()
	if err != nil {
		return time.Time{}
	}
	return md.Timestamp
}
