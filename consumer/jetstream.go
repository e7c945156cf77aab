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

	"github.com/batonhq/baton/wire"
)

// consumeJetStream feeds turn events from the durable consumer to the conversation loops
// until ctx ends. It waits for the stream, which the relay creates.
func (w *Worker) consumeJetStream(ctx context.Context) error {
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
		if !sleep(ctx, wait) {
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
	cc, err := cons.Consume(func(msg jetstream.Msg) { w.onEvent(ctx, msg) },
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

func (w *Worker) onEvent(ctx context.Context, msg jetstream.Msg) {
	id, err := strconv.ParseInt(msg.Headers().Get(wire.HeaderOutboxID), 10, 64)
	var ev wire.TurnEvent
	if err == nil {
		err = json.Unmarshal(msg.Data(), &ev)
	}
	if err == nil && !validID(ev.ConversationID) {
		err = errors.New("conversation id is not 1-200 bytes of text without NUL")
	}
	if err != nil || ev.OutboxID != id {
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
	w.schedule(ctx, ev.ConversationID, &event{outboxID: id, seq: seq, msg: msg}, ev.CreatedAt)
}

// validID reports whether id can be a conversation id: 1 to 200 bytes of valid UTF-8 with no
// NUL (what Postgres text and the schema's check accept). An event naming anything else was
// not written by the relay, and would fail every claim it joined.
func validID(id string) bool {
	return id != "" && len(id) <= 200 && utf8.ValidString(id) && !strings.ContainsRune(id, 0)
}
