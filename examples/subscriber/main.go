// Command subscriber prints every Baton outcome once: each assistant reply and each visible
// error the relay publishes to <prefix>.outcomes.<conv> (stream AGENT_OUTCOMES for the default
// prefix). Copy it as the start of any service that reacts to replies: push notifications,
// search indexing, analytics. Replace printer.handle's Fprintf with your side effect.
//
//	export BATON_NATS_URL=nats://localhost:4222   # BATON_SUBJECT_PREFIX too, if not "agent"
//	go run ./examples/subscriber                                             # all, then new ones
//	go run ./examples/subscriber --durable replay --since 2026-11-30T00:00:00Z
//	go run ./examples/subscriber --durable from-42 --from-seq 42
//
// It prints one line per outcome:
//
//	seq=7 conversation=conv-42 role=assistant message=baton:reply:0c5e… answers=17,18 content="The Q3 numbers…"
//
// seq is the stream sequence (what --from-seq takes); answers are the outbox ids the reply
// answers ("-" when the worker did not say, as for a message inserted by hand).
//
// # Position
//
// The subscriber reads through a durable consumer of its own (--durable, default
// "outcome-printer"): JetStream remembers what it acked, so a restart continues where the last
// run stopped, and several processes with the same --durable share the work. --since (an
// RFC 3339 time) and --from-seq choose where a NEW durable starts; without them it starts at
// the beginning of the stream. An existing durable keeps its position and ignores both: to
// start over, pick a new --durable or delete the old one (nats consumer rm AGENT_OUTCOMES <name>).
//
// # Duplicates
//
// JetStream delivers at least once: a message not acked within AckWait (a crash between
// printing and acking, a lost ack) is delivered again. And the relay, replaying after a crash,
// may publish an outcome again; JetStream drops the repeat by Nats-Msg-Id only within the
// stream's duplicate window (default 2 minutes), so a replay later than that stores the outcome
// twice. The Baton message id is the idempotency key: the same reply always has the same id.
// This subscriber remembers the last --remember ids it printed and skips those. That covers
// redeliveries and replays while it runs; for effects that must happen once across restarts,
// record the message id in your own store in the same transaction as the effect (for example a
// table with the message id as primary key) and skip ids already there.
package main

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"os"
	"os/signal"
	"strconv"
	"strings"
	"syscall"
	"time"
	"unicode"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/batonhq/baton/internal/config"
	"github.com/batonhq/baton/wire"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	err := run(ctx)
	stop()
	if err != nil {
		fmt.Fprintln(os.Stderr, "subscriber:", err)
		os.Exit(1)
	}
}

func run(ctx context.Context) error {
	cfg, err := config.FromEnv()
	if err != nil {
		return err
	}
	cfg.BindFlags(flag.CommandLine, config.EnvNATSURL, config.EnvSubjectPrefix, config.EnvLogLevel, config.EnvLogFormat)
	durable := flag.String("durable", "outcome-printer", "durable consumer `name`: keeps this subscriber's position across restarts")
	since := flag.String("since", "", "a new durable starts at this RFC 3339 `time` (e.g. 2026-11-30T00:00:00Z)")
	fromSeq := flag.Uint64("from-seq", 0, "a new durable starts at this stream `sequence`")
	maxContent := flag.Int("max-content", 80, "print at most this many characters of content")
	remember := flag.Int("remember", 10000, "how many message ids to remember for skipping duplicates")
	flag.Parse()
	if flag.NArg() > 0 {
		return fmt.Errorf("unexpected argument %q", flag.Arg(0))
	}
	if err := cfg.Validate(); err != nil {
		return err
	}
	if err := cfg.Require(config.EnvNATSURL); err != nil {
		return err
	}
	start, err := startPosition(*since, *fromSeq)
	if err != nil {
		return err
	}
	if *remember < 1 || *maxContent < 1 {
		return errors.New("--remember and --max-content must be at least 1")
	}
	log := cfg.Logger(os.Stderr)

	nc, err := nats.Connect(cfg.NATSURL, nats.Name("outcome-subscriber"), nats.MaxReconnects(-1))
	if err != nil {
		return fmt.Errorf("connect to NATS at %s: %w", config.Redact(cfg.NATSURL), err)
	}
	defer nc.Close()
	js, err := jetstream.New(nc)
	if err != nil {
		return err
	}

	stream := wire.StreamName(cfg.SubjectPrefix, "outcomes") // AGENT_OUTCOMES
	cons, err := durableConsumer(ctx, js, log, stream, cfg.SubjectPrefix+".outcomes.>", *durable, start)
	if err != nil || cons == nil {
		return err // nil, nil: stopped while waiting for the stream
	}

	p := &printer{out: os.Stdout, log: log, maxContent: *maxContent, seen: newRecent(*remember)}
	cc, err := cons.Consume(p.handle, jetstream.ConsumeErrHandler(func(_ jetstream.ConsumeContext, err error) {
		log.Warn("consume", "error", err) // the client retries by itself
	}))
	if err != nil {
		return fmt.Errorf("consume %s: %w", *durable, err)
	}
	log.Info("subscribed", "stream", stream, "durable", *durable)
	<-ctx.Done()
	// Messages received but not yet handled are not acked: JetStream redelivers them to the
	// next run after AckWait.
	cc.Stop()
	<-cc.Closed()
	return nil
}

// startPosition turns --since / --from-seq into the consumer's deliver policy.
func startPosition(since string, fromSeq uint64) (jetstream.ConsumerConfig, error) {
	var c jetstream.ConsumerConfig
	switch {
	case since != "" && fromSeq != 0:
		return c, errors.New("--since and --from-seq exclude each other")
	case since != "":
		t, err := time.Parse(time.RFC3339, since)
		if err != nil {
			return c, fmt.Errorf("--since: want an RFC 3339 time like 2026-11-30T00:00:00Z: %w", err)
		}
		c.DeliverPolicy, c.OptStartTime = jetstream.DeliverByStartTimePolicy, &t
	case fromSeq != 0:
		c.DeliverPolicy, c.OptStartSeq = jetstream.DeliverByStartSequencePolicy, fromSeq
	default:
		c.DeliverPolicy = jetstream.DeliverAllPolicy
	}
	return c, nil
}

// durableConsumer returns the durable consumer, creating it at start when it does not exist.
// An existing durable is used as it is, so it keeps its position. (CreateOrUpdateConsumer
// would instead fail on an existing durable whose start differs.) The relay creates the
// stream: until it exists, this waits.
func durableConsumer(ctx context.Context, js jetstream.JetStream, log *slog.Logger, stream, filter, durable string,
	start jetstream.ConsumerConfig) (jetstream.Consumer, error) {
	for {
		s, err := js.Stream(ctx, stream)
		if errors.Is(err, jetstream.ErrStreamNotFound) {
			log.Info("waiting for the outcomes stream (the relay creates it)", "stream", stream)
			select {
			case <-ctx.Done():
				return nil, nil
			case <-time.After(time.Second):
				continue
			}
		}
		if err != nil {
			return nil, fmt.Errorf("stream %s: %w", stream, err)
		}
		cons, err := s.Consumer(ctx, durable)
		if err == nil {
			if start.DeliverPolicy != jetstream.DeliverAllPolicy {
				log.Warn("durable exists and keeps its position: --since / --from-seq ignored", "durable", durable)
			}
			return cons, nil
		}
		if !errors.Is(err, jetstream.ErrConsumerNotFound) {
			return nil, fmt.Errorf("consumer %s: %w", durable, err)
		}
		start.Durable = durable
		start.Description = "Baton outcome subscriber"
		start.FilterSubject = filter
		start.AckPolicy = jetstream.AckExplicitPolicy // nothing counts as done until we ack it
		start.AckWait = 30 * time.Second              // unacked this long: delivered again
		cons, err = s.CreateConsumer(ctx, start)
		if err != nil {
			return nil, fmt.Errorf("create consumer %s: %w", durable, err)
		}
		return cons, nil
	}
}

// printer handles outcome messages. Consume calls handle for one message at a time, so it
// needs no lock.
type printer struct {
	out        io.Writer
	log        *slog.Logger
	maxContent int
	seen       *recent
}

func (p *printer) handle(msg jetstream.Msg) {
	var ev wire.OutcomeEvent
	if err := json.Unmarshal(msg.Data(), &ev); err != nil || ev.MessageID == "" {
		// Redelivering a message we cannot read would not help: stop its delivery for good.
		p.log.Error("not an outcome event; terminating it", "subject", msg.Subject(), "error", err)
		_ = msg.Term()
		return
	}
	// The message id is the idempotency key. A redelivery, or a relay replay stored twice,
	// has the same message id (though maybe another Nats-Msg-Id): ack it, print nothing.
	if p.seen.contains(ev.MessageID) {
		p.log.Debug("duplicate outcome skipped", "message_id", ev.MessageID)
		_ = msg.Ack()
		return
	}
	var seq uint64
	if md, err := msg.Metadata(); err == nil {
		seq = md.Sequence.Stream
	}
	content := strconv.Quote(truncate(ev.Content, p.maxContent))
	if ev.ContentOmitted { // too large for NATS: read it from the messages table by id
		content = fmt.Sprintf("(omitted: %d bytes)", ev.ContentBytes)
	}
	if _, err := fmt.Fprintf(p.out, "seq=%d conversation=%s role=%s message=%s answers=%s content=%s\n",
		seq, word(ev.ConversationID), word(ev.Role), word(ev.MessageID), joinIDs(ev.OutboxIDs), content); err != nil {
		// Not printed, so not done: have it delivered again.
		p.log.Error("print outcome", "message_id", ev.MessageID, "error", err)
		_ = msg.Nak()
		return
	}
	p.seen.add(ev.MessageID)
	// Ack only after the effect (here: printing). If this ack is lost, the message comes back
	// and p.seen skips it.
	if err := msg.Ack(); err != nil {
		p.log.Warn("ack", "message_id", ev.MessageID, "error", err)
	}
}

// recent is a bounded set of the last n keys added: memory stays flat however long the
// subscriber runs. Duplicates arrive close to the original (a redelivery after AckWait, a relay
// replay after a crash), so remembering the last n ids is enough; choose n above the number
// of outcomes a replay can span.
type recent struct {
	ring []string // the last n keys, oldest at next
	next int
	set  map[string]struct{}
}

func newRecent(n int) *recent {
	return &recent{ring: make([]string, n), set: make(map[string]struct{}, n)}
}

func (r *recent) contains(key string) bool {
	_, ok := r.set[key]
	return ok
}

// add remembers key, forgetting the oldest key when full. key must not be present already.
func (r *recent) add(key string) {
	if old := r.ring[r.next]; old != "" {
		delete(r.set, old)
	}
	r.ring[r.next] = key
	r.set[key] = struct{}{}
	r.next = (r.next + 1) % len(r.ring)
}

// truncate shortens s to n characters, marking the cut with "…".
func truncate(s string, n int) string {
	if len(s) <= n { // fewer bytes than n means fewer characters too
		return s
	}
	runes := []rune(s)
	if len(runes) <= n {
		return s
	}
	return string(runes[:n]) + "…"
}

// word prints an id as it is when it is one printable word, quoted otherwise, so that every
// outcome stays one line whatever its ids hold.
func word(s string) string {
	if s != "" && strings.IndexFunc(s, func(r rune) bool { return r == '"' || unicode.IsSpace(r) || !unicode.IsPrint(r) }) < 0 {
		return s
	}
	return strconv.Quote(s)
}

func joinIDs(ids []int64) string {
	if len(ids) == 0 {
		return "-"
	}
	parts := make([]string, len(ids))
	for i, id := range ids {
		parts[i] = strconv.FormatInt(id, 10)
	}
	return strings.Join(parts, ",")
}
