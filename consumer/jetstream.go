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

	"github.com/nats-io/nats.go"
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
// ends. It waits for the stream, which the relay creates. When consuming ends on its own (an
// operator deleted the durable consumer, or the turns stream, which the relay creates again at
// its next publish), it creates the consumer again: without it only the sweep would find new
// rows, one claim per conversation every SweepInterval. Events deleted with a stream are gone;
// their rows stay pending in Postgres, where the sweep and the conversation's next claim find
// them.
func (s *jetStreamSource) consume(ctx context.Context) error {
	w := s.w
	js, err := jetstream.New(w.cfg.NATS)
	if err != nil {
		return fmt.Errorf("jetstream: %w", err)
	}
	for {
		if err := s.consumeOnce(ctx, js); err != nil || ctx.Err() != nil {
			return err
		}
		if err := closedForGood(w); err != nil {
			return err
		}
		w.cfg.Logger.Warn("turn events stopped: the durable consumer or its stream was deleted; creating the consumer again",
			"stream", w.cfg.Stream, "durable", w.cfg.Durable)
		if !sleep(ctx, w.clock, 100*time.Millisecond) {
			return nil
		}
	}
}

// consumeOnce creates the durable consumer, once the stream exists, and feeds its events to
// the conversation loops until ctx ends or consuming stops on its own (the consumer was
// deleted).
func (s *jetStreamSource) consumeOnce(ctx context.Context, js jetstream.JetStream) error {
	w := s.w
	var cons jetstream.Consumer
	for wait := 100 * time.Millisecond; ; wait = min(2*wait, 5*time.Second) {
		stream, err := js.Stream(ctx, w.cfg.Stream)
		if err == nil {
			cons, err = stream.CreateOrUpdateConsumer(ctx, jetstream.ConsumerConfig{
				Durable:       w.cfg.Durable,
				Description:   "Baton workers",
				FilterSubject: wire.StreamFilter(w.cfg.SubjectPrefix, wire.KindTurns),
				AckPolicy:     jetstream.AckExplicitPolicy,
				AckWait:       w.cfg.AckWait,
				MaxDeliver:    -1, // attempts are capped in Postgres, not by redeliveries
				MaxAckPending: w.cfg.MaxAckPending,
				DeliverPolicy: jetstream.DeliverAllPolicy,
			})
			if err == nil {
				break
			}
			if !errors.Is(err, jetstream.ErrStreamNotFound) {
				return fmt.Errorf("create consumer %s: %w", w.cfg.Durable, err)
			}
		}
		if ctx.Err() != nil {
			return nil
		}
		if err := closedForGood(w); err != nil {
			return err
		}
		w.cfg.Logger.Info("waiting for the turns stream (the relay creates it)", "stream", w.cfg.Stream, "error", err)
		if !sleep(ctx, w.clock, wait) {
			return nil
		}
	}
	// Consuming reports errors it goes on after: a pull request that found no consumer ("no
	// responders", when the server's "consumer deleted" notice was lost with a connection or
	// never sent, as for a client holding no pull request), missed heartbeats. After each, the
	// consumer is looked up, and created again if gone. Heartbeats every consumeHeartbeat
	// bound how long a consumer deleted unnoticed goes unnoticed: two of them missed.
	check := make(chan struct{}, 1)
	cc, err := cons.Consume(func(msg jetstream.Msg) { s.onEvent(ctx, msg) },
		jetstream.PullHeartbeat(consumeHeartbeat),
		jetstream.ConsumeErrHandler(func(_ jetstream.ConsumeContext, err error) {
			if !errors.Is(err, jetstream.ErrNoHeartbeat) || ctx.Err() == nil {
				w.cfg.Logger.Warn("consume", "error", err)
			}
			select {
			case check <- struct{}{}:
			default:
			}
		}))
	if err != nil {
		return fmt.Errorf("consume %s: %w", w.cfg.Durable, err)
	}
	for gone := false; !gone; {
		select {
		case <-ctx.Done():
			gone = true
		case <-cc.Closed():
			gone = true
		case <-check:
			gone = consumerGone(ctx, cons)
		}
	}
	cc.Stop()
	<-cc.Closed()
	return nil
}

// closedForGood returns an error wrapping nats.ErrConnectionClosed when the worker's NATS
// connection is closed: nats.go closes it for good when the server refuses the login again on
// a reconnect (a rotated password, a revoked user), and its owner may close it. No event can
// come any more; Run ends with the error so the program exits and its supervisor restarts it,
// rather than a worker that looks alive and answers only what its sweep finds.
func closedForGood(w *Worker) error {
	if !w.cfg.NATS.IsClosed() {
		return nil
	}
	err := nats.ErrConnectionClosed
	if last := w.cfg.NATS.LastError(); last != nil {
		err = fmt.Errorf("%w (last error: %w)", err, last)
	}
	return fmt.Errorf("turn events: %w", err)
}

// consumeHeartbeat is how often the server sends the workers' pull requests a heartbeat while
// it has no event for them (nats.go's default is 15s).
const consumeHeartbeat = 5 * time.Second

// consumerGone reports whether the server says cons, or its stream, does not exist. Any other
// answer (the server is unreachable, the request timed out) is no reason to create it again.
func consumerGone(ctx context.Context, cons jetstream.Consumer) bool {
	ctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	_, err := cons.Info(ctx)
	return errors.Is(err, jetstream.ErrConsumerNotFound) || errors.Is(err, jetstream.ErrStreamNotFound)
}

// TurnEventReceivedLog is the message of the debug log line a worker writes for each turn
// event it receives and can read, with its outbox_id, stream_seq and delivered count (in that
// order) and its conversation_id.
const TurnEventReceivedLog = "turn event received"

// onEvent hands a turn event to its conversation's loop. A malformed event is terminated:
// no redelivery can make it readable. So is an event whose subject is not the turn subject of
// the conversation its body names (counted as misaddressed, logged at error level): the
// relay never writes one, and whoever may publish on the turns subjects could otherwise put
// conversation B's events on conversation A's subject. It is never scheduled, so never
// claimed; B's own event, on B's subject, and the sweep still find B's row.
func (s *jetStreamSource) onEvent(ctx context.Context, msg jetstream.Msg) {
	w := s.w
	ev, err := decodeTurnEvent(msg.Headers().Get(wire.HeaderOutboxID), msg.Data())
	if err != nil {
		w.cfg.Logger.Error("malformed turn event; terminating it", "subject", msg.Subject(), "error", err)
		_ = msg.Term()
		w.m.events.WithLabelValues("terminated").Inc()
		return
	}
	var seq, delivered uint64
	if md, err := msg.Metadata(); err == nil {
		seq, delivered = md.Sequence.Stream, md.NumDelivered
	}
	// Which stored copy of which row reached this worker: the chaos run reads these lines
	// to check that the stream held each row once, in order (e2e/checks_test.go). The ids
	// come first, before the conversation id that an attacker may choose.
	w.cfg.Logger.Debug(TurnEventReceivedLog, "outbox_id", ev.OutboxID, "stream_seq", seq, "delivered", delivered,
		"conversation_id", ev.ConversationID)
	if err := checkTurnSubject(w.cfg.SubjectPrefix, msg.Subject(), ev.ConversationID); err != nil {
		w.cfg.Logger.Error("turn event on another conversation's subject; terminating it", "subject", msg.Subject(),
			"conversation_id", ev.ConversationID, "outbox_id", ev.OutboxID, "stream_seq", seq, "error", err)
		_ = msg.TermWithReason("subject names another conversation than the body")
		w.m.events.WithLabelValues("misaddressed").Inc()
		return
	}
	if ctx.Err() != nil {
		_ = msg.Nak()
		return
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

// checkTurnSubject returns an error unless subject is the turn subject, under prefix, of
// conversationID: wire.ParseSubject reads the subject as the relay writes it (plain or "~"
// base64url token, canonical only), so exactly one subject passes for each conversation.
func checkTurnSubject(prefix, subject, conversationID string) error {
	kind, conv, err := wire.ParseSubject(prefix, subject)
	if err != nil {
		return err
	}
	if kind != wire.KindTurns {
		return fmt.Errorf("subject %q is not a turn subject", subject)
	}
	if conv != conversationID {
		return fmt.Errorf("subject %q names conversation %q, the body names %q", subject, conv, conversationID)
	}
	return nil
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
