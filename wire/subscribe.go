package wire

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"strings"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
)

// Defaults of OutcomeSubscriberConfig.
const (
	// DefaultSubscriberAckWait is OutcomeSubscriberConfig.AckWait's default.
	DefaultSubscriberAckWait = 30 * time.Second
	// DefaultSubscriberRetryDelay is OutcomeSubscriberConfig.RetryDelay's default.
	DefaultSubscriberRetryDelay = time.Second
	// DefaultSubscriberMaxRetryDelay is OutcomeSubscriberConfig.MaxRetryDelay's default.
	DefaultSubscriberMaxRetryDelay = time.Minute
	// DefaultSubscriberDedupeWindow is OutcomeSubscriberConfig.DedupeWindow's default.
	DefaultSubscriberDedupeWindow = 10000
)

// OutcomeSubscriberConfig configures an OutcomeSubscriber. Zero values take the defaults named
// on each field.
type OutcomeSubscriberConfig struct {
	// NATS is the connection to the NATS server with the outcomes stream. Required.
	NATS *nats.Conn
	// Durable names the durable JetStream consumer that keeps this subscriber's position:
	// JetStream remembers what it acked, so a restart continues where the last run stopped,
	// and processes running with the same Durable share the outcomes between them. A consumer
	// name: no ".", "*", ">", "/", "\" or whitespace. Required.
	Durable string
	// Handler is called once per outcome (see OutcomeSubscriber for when it is called again).
	// Required.
	Handler OutcomeHandler

	// ConversationID, when set, restricts the subscriber to that conversation's outcomes
	// (the filter OutcomeSubject(SubjectPrefix, ConversationID)). Default: "", every
	// conversation's (StreamFilter(SubjectPrefix, KindOutcomes)).
	ConversationID string
	// SubjectPrefix is the relay's subject prefix. Default: DefaultSubjectPrefix ("agent").
	SubjectPrefix string
	// Stream is the outcomes stream. Default: StreamName(SubjectPrefix, KindOutcomes)
	// ("AGENT_OUTCOMES").
	Stream string

	// StartTime, when set, makes a durable that does not exist yet start with the first
	// outcome stored at or after it. An existing durable keeps its position.
	// Default: the beginning of the stream. Excludes StartSeq.
	StartTime time.Time
	// StartSeq, when set, makes a durable that does not exist yet start at this stream
	// sequence (Outcome.StreamSeq). An existing durable keeps its position.
	// Default: 0, the beginning of the stream. Excludes StartTime.
	StartSeq uint64

	// AckWait is how long JetStream waits for the ack of a delivered outcome before it
	// delivers it again; while Handler runs, the subscriber tells JetStream every AckWait/3
	// that it is still working. Used when the durable is created. Default:
	// DefaultSubscriberAckWait (30s).
	AckWait time.Duration
	// RetryDelay is how long an outcome whose Handler failed waits before it is delivered
	// again, doubled for each further failed delivery, at most MaxRetryDelay. Default:
	// DefaultSubscriberRetryDelay (1s).
	RetryDelay time.Duration
	// MaxRetryDelay caps RetryDelay's doubling. Default: DefaultSubscriberMaxRetryDelay (1m).
	MaxRetryDelay time.Duration
	// DedupeWindow is how many message ids the subscriber remembers to skip duplicates: the
	// ids of the last DedupeWindow outcomes Handler accepted. Choose it above the number of
	// outcomes a redelivery or a relay replay can span. Default:
	// DefaultSubscriberDedupeWindow (10000).
	DedupeWindow int

	// Logger receives the subscriber's logs. Default: nil, discard.
	Logger *slog.Logger
}

// Outcome is an outcome event as a subscriber receives it.
type Outcome struct {
	// Event is the event's body. Its ConversationID is the one its subject names.
	Event OutcomeEvent
	// StreamSeq is the event's sequence in the outcomes stream (what StartSeq takes).
	StreamSeq uint64
	// Stored is when JetStream stored the event.
	Stored time.Time
	// Delivery counts the deliveries of this stream message to the durable: 1 the first
	// time, more after a failed Handler or a lost ack.
	Delivery uint64
	// Traceparent is the event's HeaderTraceparent, the worker's turn span, when it carries a
	// valid one (ValidTraceparent); "" otherwise. Handlers that trace continue the message's
	// trace from it.
	Traceparent string
}

// OutcomeHandler handles one outcome. It returns nil when the outcome's effect is done: only
// then is the message acked. An error has it delivered again later. ctx is the one Run was
// given: it ends when the subscriber is told to stop.
type OutcomeHandler func(ctx context.Context, o Outcome) error

// OutcomeSubscriber reads outcome events through a durable JetStream pull consumer and hands
// each one to a handler. Its delivery rules:
//
//   - An outcome is acked only after Handler returned nil for it. If Handler returns an
//     error, the message is negatively acked with a delay (RetryDelay, doubling up to
//     MaxRetryDelay) and delivered again, to this process or another with the same Durable.
//     The consumer has no delivery limit: an outcome is never dropped because Handler failed.
//   - Duplicates are skipped by message id (OutcomeEvent.MessageID, the id OutcomeMsgID turns
//     into the Nats-Msg-Id): an outcome whose id is among the last DedupeWindow ids Handler
//     accepted is acked without calling Handler. That covers a redelivery after a lost ack
//     and a relay replay that JetStream stored again because it came after the stream's
//     duplicate window. The window lives in memory, per Run: across restarts, and between
//     processes sharing a Durable, JetStream's acks are what prevent repeats. For effects that
//     must happen once even then, record the message id in your own store in the same
//     transaction as the effect and skip ids already there.
//   - A message that is not an outcome event (its body is not an OutcomeEvent with a message
//     id and a conversation id, or its subject does not name the body's conversation, or,
//     with ConversationID set, another conversation's) can never be handled: it is logged at
//     error level and terminated, so it is not delivered again.
//   - Handler is called for one outcome at a time, in the order JetStream delivers them:
//     stream order, except that an outcome whose Handler failed comes again after those
//     delivered meanwhile. Deliveries lost with a dropped connection do not get overtaken:
//     the subscriber notices the gap in the consumer's delivery numbers, pulls nothing for
//     AckWait, and JetStream then delivers the lost ones first (one process per Durable;
//     processes sharing one split the outcomes and their order between them). Not noticed:
//     deliveries lost in a JetStream cluster when the consumer's leader changes while this
//     connection stays up; they come after AckWait, after those delivered meanwhile.
//
// Delivered messages wait in a client-side buffer (nats.go's default size) before Handler
// sees them, and their AckWait runs there: with a slow Handler some are delivered again and
// skipped as duplicates.
type OutcomeSubscriber struct {
	cfg    OutcomeSubscriberConfig
	filter string
	log    *slog.Logger
}

// NewOutcomeSubscriber fills cfg's defaults and validates it.
func NewOutcomeSubscriber(cfg OutcomeSubscriberConfig) (*OutcomeSubscriber, error) {
	if cfg.NATS == nil {
		return nil, errors.New("outcome subscriber: NATS is required")
	}
	if cfg.Handler == nil {
		return nil, errors.New("outcome subscriber: Handler is required")
	}
	if cfg.Durable == "" || strings.ContainsAny(cfg.Durable, ">*. /\\\t\r\n") {
		return nil, fmt.Errorf("outcome subscriber: Durable %q is not a consumer name (non-empty, no '.', '*', '>', '/', '\\' or whitespace)", cfg.Durable)
	}
	if cfg.SubjectPrefix == "" {
		cfg.SubjectPrefix = DefaultSubjectPrefix
	}
	if err := ValidatePrefix(cfg.SubjectPrefix); err != nil {
		return nil, fmt.Errorf("outcome subscriber: %w", err)
	}
	filter := StreamFilter(cfg.SubjectPrefix, KindOutcomes)
	if cfg.ConversationID != "" {
		var err error
		if filter, err = OutcomeSubject(cfg.SubjectPrefix, cfg.ConversationID); err != nil {
			return nil, fmt.Errorf("outcome subscriber: %w", err)
		}
	}
	if cfg.Stream == "" {
		cfg.Stream = StreamName(cfg.SubjectPrefix, KindOutcomes)
	}
	if !cfg.StartTime.IsZero() && cfg.StartSeq != 0 {
		return nil, errors.New("outcome subscriber: StartTime and StartSeq exclude each other")
	}
	if cfg.AckWait == 0 {
		cfg.AckWait = DefaultSubscriberAckWait
	}
	if cfg.RetryDelay == 0 {
		cfg.RetryDelay = DefaultSubscriberRetryDelay
	}
	if cfg.MaxRetryDelay == 0 {
		cfg.MaxRetryDelay = DefaultSubscriberMaxRetryDelay
	}
	if cfg.DedupeWindow == 0 {
		cfg.DedupeWindow = DefaultSubscriberDedupeWindow
	}
	if cfg.AckWait < 0 || cfg.RetryDelay < 0 || cfg.MaxRetryDelay < 0 || cfg.DedupeWindow < 0 {
		return nil, errors.New("outcome subscriber: AckWait, RetryDelay, MaxRetryDelay and DedupeWindow must not be negative")
	}
	log := cfg.Logger
	if log == nil {
		log = slog.New(slog.NewTextHandler(io.Discard, nil))
	}
	log = log.With("stream", cfg.Stream, "durable", cfg.Durable)
	return &OutcomeSubscriber{cfg: cfg, filter: filter, log: log}, nil
}

// Run consumes outcomes until ctx ends, then returns nil once the Handler call in progress
// returned: its outcome is acked if Handler returned nil. An outcome whose Handler failed as
// ctx ended, and outcomes delivered but not yet handled, are left unacked and delivered again
// after AckWait, to the next run or another process with the same Durable. It waits for the
// outcomes stream, which the relay creates, and creates the durable when it does not exist:
// with the filter, AckWait and start position of the configuration. An existing durable is
// used as it is and keeps its position; Run fails if its filter is not this subscriber's.
// Run returns an error when it cannot set up the consumer or the consumer ends (deleted, the
// connection closed). A missed heartbeat (a leader election in a JetStream cluster, a server
// gone) is logged and ridden through.
func (s *OutcomeSubscriber) Run(ctx context.Context) error {
	js, err := jetstream.New(s.cfg.NATS)
	if err != nil {
		return fmt.Errorf("outcome subscriber: jetstream: %w", err)
	}
	cons, err := s.durable(ctx, js)
	if err != nil || cons == nil {
		return err // nil, nil: ctx ended while waiting
	}
	it, err := cons.Messages()
	if err != nil {
		return fmt.Errorf("outcome subscriber: consume %s: %w", s.cfg.Durable, err)
	}
	defer func() { it.Stop() }()
	s.log.Info("subscribed to outcomes", "filter", s.filter)
	seen := newRecent(s.cfg.DedupeWindow)
	var gaps deliveryGaps
	for {
		msg, err := it.Next(jetstream.NextContext(ctx))
		if err == nil && gaps.lost(msg, s.cfg.NATS.Stats().Reconnects) {
			// Deliveries were lost with a dropped connection. JetStream delivers them again
			// only once their AckWait ran out; the outcomes stored after them, this one
			// included, must not overtake them. Leave this one and those buffered unacked,
			// pull nothing until every delivery to this process timed out, then pull again:
			// JetStream redelivers timed-out messages before new ones, in stream order.
			it.Stop()
			wait := cons.CachedInfo().Config.AckWait
			wait += max(wait/10, 200*time.Millisecond)
			s.log.Warn("deliveries lost with the connection; waiting for their redelivery so that no outcome overtakes them",
				"wait", wait.String())
			select {
			case <-ctx.Done():
				return nil
			case <-time.After(wait):
			}
			if it, err = cons.Messages(); err != nil {
				return fmt.Errorf("outcome subscriber: consume %s: %w", s.cfg.Durable, err)
			}
			continue
		}
		if err != nil {
			if ctx.Err() != nil {
				return nil
			}
			if errors.Is(err, jetstream.ErrNoHeartbeat) {
				// The consumer's server went quiet: a JetStream leader election, or the server
				// this connection was on went away. The iterator stays usable and pulls again;
				// outcomes resume once the consumer has a leader.
				s.log.Warn("no heartbeat from the outcomes consumer; pulling again", "error", err)
				continue
			}
			return fmt.Errorf("outcome subscriber: consume %s: %w", s.cfg.Durable, err)
		}
		s.handle(ctx, msg, seen)
	}
}

// deliveryGaps notices deliveries lost in transit. The consumer numbers its deliveries (the
// consumer sequence, redeliveries included), so one process holding the durable receives them
// without gaps unless some were lost with a dropped connection: JetStream counts them as made.
// Processes sharing the durable see gaps as they share the deliveries; only a gap across a
// reconnect of this process's connection counts.
type deliveryGaps struct {
	next       uint64 // the consumer sequence expected next; 0: unknown
	reconnects uint64 // the connection's reconnects when the last delivery arrived
}

// lost reports whether deliveries were lost before msg, which arrived when the connection had
// reconnected reconnects times. After true the count starts again with the next delivery.
func (g *deliveryGaps) lost(msg jetstream.Msg, reconnects uint64) bool {
	md, err := msg.Metadata()
	if err != nil {
		return false // handle says what is wrong with it
	}
	gap := g.next != 0 && md.Sequence.Consumer > g.next && reconnects != g.reconnects
	g.next, g.reconnects = md.Sequence.Consumer+1, reconnects
	if gap {
		g.next = 0
	}
	return gap
}

// durable returns the durable consumer, creating it when it does not exist. It waits for the
// stream; it returns nil, nil when ctx ends first.
func (s *OutcomeSubscriber) durable(ctx context.Context, js jetstream.JetStream) (jetstream.Consumer, error) {
	wait := 100 * time.Millisecond
	for {
		stream, err := js.Stream(ctx, s.cfg.Stream)
		if errors.Is(err, jetstream.ErrStreamNotFound) {
			s.log.Info("waiting for the outcomes stream (the relay creates it)")
			select {
			case <-ctx.Done():
				return nil, nil
			case <-time.After(wait):
				wait = min(2*wait, 5*time.Second)
				continue
			}
		}
		if err != nil {
			if ctx.Err() != nil {
				return nil, nil
			}
			return nil, fmt.Errorf("outcome subscriber: stream %s: %w", s.cfg.Stream, err)
		}
		cons, err := stream.Consumer(ctx, s.cfg.Durable)
		if err == nil {
			if err := s.checkExisting(cons.CachedInfo().Config); err != nil {
				return nil, err
			}
			return cons, nil
		}
		if !errors.Is(err, jetstream.ErrConsumerNotFound) {
			if ctx.Err() != nil {
				return nil, nil
			}
			return nil, fmt.Errorf("outcome subscriber: consumer %s: %w", s.cfg.Durable, err)
		}
		cc := jetstream.ConsumerConfig{
			Durable:       s.cfg.Durable,
			Description:   "Baton outcome subscriber",
			FilterSubject: s.filter,
			AckPolicy:     jetstream.AckExplicitPolicy, // nothing is done until acked
			AckWait:       s.cfg.AckWait,
			MaxDeliver:    -1, // a failing handler delays an outcome, never drops it
			DeliverPolicy: jetstream.DeliverAllPolicy,
		}
		switch {
		case !s.cfg.StartTime.IsZero():
			t := s.cfg.StartTime
			cc.DeliverPolicy, cc.OptStartTime = jetstream.DeliverByStartTimePolicy, &t
		case s.cfg.StartSeq != 0:
			cc.DeliverPolicy, cc.OptStartSeq = jetstream.DeliverByStartSequencePolicy, s.cfg.StartSeq
		}
		cons, err = stream.CreateConsumer(ctx, cc)
		if errors.Is(err, jetstream.ErrConsumerExists) {
			continue // created meanwhile by another process with the same Durable
		}
		if err != nil {
			return nil, fmt.Errorf("outcome subscriber: create consumer %s: %w", s.cfg.Durable, err)
		}
		s.log.Info("created durable consumer", "filter", s.filter)
		return cons, nil
	}
}

// checkExisting accepts an existing durable whose filter is this subscriber's: it would
// otherwise deliver other outcomes than asked for.
func (s *OutcomeSubscriber) checkExisting(c jetstream.ConsumerConfig) error {
	filters := c.FilterSubjects
	if c.FilterSubject != "" {
		filters = append(filters, c.FilterSubject)
	}
	if len(filters) != 1 || filters[0] != s.filter {
		return fmt.Errorf("outcome subscriber: durable %s exists with filter %q, not %q: choose another Durable or delete it",
			s.cfg.Durable, strings.Join(filters, ","), s.filter)
	}
	if !s.cfg.StartTime.IsZero() || s.cfg.StartSeq != 0 {
		s.log.Warn("durable exists and keeps its position: the start position is ignored")
	}
	return nil
}

// handle applies the delivery rules to one message.
func (s *OutcomeSubscriber) handle(ctx context.Context, msg jetstream.Msg, seen *recent) {
	if ctx.Err() != nil {
		return // stopping: not handled, so not acked; delivered again after AckWait
	}
	ev, err := decodeOutcome(s.cfg.SubjectPrefix, s.cfg.ConversationID, msg.Subject(), msg.Data())
	if err != nil {
		s.log.Error("not an outcome event; terminating it", "subject", msg.Subject(), "error", err)
		if err := msg.TermWithReason("not a Baton outcome event"); err != nil {
			s.log.Warn("terminate", "subject", msg.Subject(), "error", err)
		}
		return
	}
	if seen.contains(ev.MessageID) {
		s.log.Debug("duplicate outcome skipped", "message_id", ev.MessageID)
		if err := msg.Ack(); err != nil {
			s.log.Warn("ack", "message_id", ev.MessageID, "error", err)
		}
		return
	}
	o := Outcome{Event: ev}
	if tp := msg.Headers().Get(HeaderTraceparent); ValidTraceparent(tp) {
		o.Traceparent = tp
	}
	if md, err := msg.Metadata(); err == nil {
		o.StreamSeq, o.Stored, o.Delivery = md.Sequence.Stream, md.Timestamp, md.NumDelivered
	}

	stop := s.keepAlive(msg)
	err = s.cfg.Handler(ctx, o)
	stop()

	if err != nil && ctx.Err() != nil {
		// Stopping. A nak now could have the outcome delivered again to this consumer's pull
		// request before it is cancelled, where it would wait out AckWait anyway.
		s.log.Info("stopped while handling an outcome; it is delivered again after the ack wait",
			"message_id", ev.MessageID, "stream_seq", o.StreamSeq, "error", err)
		return
	}
	if err != nil {
		delay := retryDelay(s.cfg.RetryDelay, s.cfg.MaxRetryDelay, o.Delivery)
		s.log.Warn("outcome handler failed; delivering it again", "message_id", ev.MessageID,
			"stream_seq", o.StreamSeq, "delivery", o.Delivery, "retry_in", delay, "error", err)
		if err := msg.NakWithDelay(delay); err != nil {
			s.log.Warn("nak", "message_id", ev.MessageID, "error", err)
		}
		return
	}
	seen.add(ev.MessageID)
	// Acked only now that the effect is done. If this ack is lost, the outcome comes back and
	// seen skips it.
	if err := msg.Ack(); err != nil {
		s.log.Warn("ack", "message_id", ev.MessageID, "error", err)
	}
}

// keepAlive tells JetStream every AckWait/3 that msg is still being handled, until the
// returned function is called; that function returns once the goroutine it started ended.
func (s *OutcomeSubscriber) keepAlive(msg jetstream.Msg) (stop func()) {
	done, exited := make(chan struct{}), make(chan struct{})
	go func() {
		defer close(exited)
		tick := time.NewTicker(max(s.cfg.AckWait/3, time.Millisecond))
		defer tick.Stop()
		for {
			select {
			case <-done:
				return
			case <-tick.C:
				_ = msg.InProgress() // a lost one costs at most a redelivery, skipped as a duplicate
			}
		}
	}()
	return func() {
		close(done)
		<-exited
	}
}

// errNotOutcome is wrapped by decodeOutcome's errors.
var errNotOutcome = errors.New("not an outcome event")

// decodeOutcome decodes the body of a message received on subject and checks that it is an
// outcome event the subscriber may hand on: a JSON OutcomeEvent with a message id and a
// conversation id, on the outcome subject of that conversation under prefix, and, when conv
// is set, of conversation conv.
func decodeOutcome(prefix, conv, subject string, data []byte) (OutcomeEvent, error) {
	var ev OutcomeEvent
	if err := json.Unmarshal(data, &ev); err != nil {
		return OutcomeEvent{}, fmt.Errorf("%w: %w", errNotOutcome, err)
	}
	if ev.MessageID == "" || ev.ConversationID == "" {
		return OutcomeEvent{}, fmt.Errorf("%w: no message id or conversation id", errNotOutcome)
	}
	kind, subjConv, err := ParseSubject(prefix, subject)
	if err != nil {
		return OutcomeEvent{}, fmt.Errorf("%w: %w", errNotOutcome, err)
	}
	if kind != KindOutcomes {
		return OutcomeEvent{}, fmt.Errorf("%w: subject %q is not an outcome subject", errNotOutcome, subject)
	}
	if subjConv != ev.ConversationID {
		return OutcomeEvent{}, fmt.Errorf("%w: subject %q names another conversation than the body's %q",
			errNotOutcome, subject, ev.ConversationID)
	}
	if conv != "" && ev.ConversationID != conv {
		return OutcomeEvent{}, fmt.Errorf("%w: conversation %q, not the subscribed %q", errNotOutcome, ev.ConversationID, conv)
	}
	return ev, nil
}

// retryDelay is the delay before an outcome whose handler failed on its delivery-th delivery
// (from 1) is delivered again: base doubled for each earlier delivery, at most maxDelay.
func retryDelay(base, maxDelay time.Duration, delivery uint64) time.Duration {
	d := base
	for i := uint64(1); i < delivery && d < maxDelay; i++ {
		d *= 2
	}
	return min(d, maxDelay)
}

// recent is a bounded set of the last n keys added: memory stays flat however long the
// subscriber runs. Duplicates arrive close to the original (a redelivery after AckWait, a
// relay replay after a crash), so remembering the last n ids is enough. Used by one goroutine.
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

// add remembers key, forgetting the oldest key when full. key must be non-empty and not
// present already.
func (r *recent) add(key string) {
	if old := r.ring[r.next]; old != "" {
		delete(r.set, old)
	}
	r.ring[r.next] = key
	r.set[key] = struct{}{}
	r.next = (r.next + 1) % len(r.ring)
}
