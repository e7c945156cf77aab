package wire

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"strings"
	"sync/atomic"
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
	// MaxSubscriberDedupeWindow is the largest OutcomeSubscriberConfig.DedupeWindow: a million
	// ids. Run allocates the whole window when it starts, about 100 bytes an entry (some 100 MB
	// for a million) before the ids themselves fill it; that is a hundred times the default and
	// far more than a redelivery (at most 500 outcomes a pull request) or a relay replay spans.
	// A larger window would cost gigabytes when Run starts, or panic there, rather than fail at
	// the configuration check.
	MaxSubscriberDedupeWindow = 1_000_000
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
	// (or a third of an existing durable's own AckWait, when that is shorter) that it is
	// still working. Used when the durable is created. Default: DefaultSubscriberAckWait (30s).
	AckWait time.Duration
	// RetryDelay is how long an outcome whose Handler failed waits before it is delivered
	// again, doubled for each further failed delivery, at most MaxRetryDelay. Default:
	// DefaultSubscriberRetryDelay (1s).
	RetryDelay time.Duration
	// MaxRetryDelay caps RetryDelay's doubling. Default: DefaultSubscriberMaxRetryDelay (1m).
	MaxRetryDelay time.Duration
	// DedupeWindow is how many message ids the subscriber remembers to skip duplicates: the
	// ids of the last DedupeWindow outcomes Handler accepted. Choose it above the number of
	// outcomes a redelivery or a relay replay can span. At most MaxSubscriberDedupeWindow
	// (1,000,000). Default: DefaultSubscriberDedupeWindow (10000).
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
//     delivered meanwhile. Deliveries lost in transit do not get overtaken: with a dropped
//     connection, or in a JetStream cluster when the consumer's leader changes or falls
//     silent, the subscriber notices the gap in the consumer's delivery numbers and rewinds
//     the durable to its oldest unacknowledged outcome (JetStream's consumer reset,
//     nats-server 2.14 and later), which JetStream then delivers again first, in stream
//     order. Where the reset is refused (an older server, a user without permission for
//     $JS.API.CONSUMER.RESET), it pulls nothing for AckWait instead, so that the lost ones
//     time out and come first; a new outcome may then still overtake one. This holds for one
//     process per Durable; processes sharing one split the outcomes and their order between
//     them, and a rewind by one has the others' unacknowledged outcomes delivered again.
//
// Delivered messages wait in a client-side buffer (up to 500 per pull request) before Handler
// sees them, and their AckWait runs there: with a slow Handler some are delivered again and
// skipped as duplicates.
//
// An existing durable is used with its own settings, which an operator may change while Run
// runs: while Handler runs, InProgress goes out every third of the durable's AckWait (or of
// AckWait when that is shorter), and pull requests stay within its MaxRequestBatch and
// MaxRequestExpires; the subscriber reads them again every 30s and after the server refused a
// request for exceeding them.
type OutcomeSubscriber struct {
	cfg    OutcomeSubscriberConfig
	filter string
	log    *slog.Logger
	// running is set while a Run runs: a second one at the same time would split the
	// outcomes, and the order of each conversation's, between two pullers, and call Handler
	// for two outcomes at once.
	running atomic.Bool
}

// ErrAlreadyRunning is Run's error when another Run of the same subscriber has not returned.
var ErrAlreadyRunning = errors.New("outcome subscriber: Run is already running (one Run at a time keeps each conversation's order)")

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
	if cfg.DedupeWindow > MaxSubscriberDedupeWindow {
		return nil, fmt.Errorf("outcome subscriber: DedupeWindow %d is above the maximum %d (MaxSubscriberDedupeWindow: Run allocates the whole window when it starts)",
			cfg.DedupeWindow, MaxSubscriberDedupeWindow)
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
// gone) is logged and ridden through. Run may be called again once it returned, never twice at
// the same time: the second returns ErrAlreadyRunning at once.
func (s *OutcomeSubscriber) Run(ctx context.Context) error {
	if !s.running.CompareAndSwap(false, true) {
		return ErrAlreadyRunning
	}
	defer s.running.Store(false)
	js, err := jetstream.New(s.cfg.NATS)
	if err != nil {
		return fmt.Errorf("outcome subscriber: jetstream: %w", err)
	}
	cons, err := s.durable(ctx, js)
	if err != nil || cons == nil {
		return err // nil, nil: ctx ended while waiting
	}
	// A connection closed for good ends Run.
	status := s.cfg.NATS.StatusChanged(nats.CLOSED)
	defer s.cfg.NATS.RemoveStatusListener(status)
	s.log.Info("subscribed to outcomes", "filter", s.filter)
	p := newPuller(s, js, cons, status)
	for ctx.Err() == nil {
		if err := p.pull(ctx); err != nil {
			return err
		}
	}
	return nil
}

// Pull requests: each asks for up to pullBatch outcomes and lasts up to pullExpiry; the
// consumer's leader sends a heartbeat every pullHeartbeat while it has nothing to deliver, and
// two missed ones end the request (a leader gone without a word).
const (
	pullBatch     = 500
	pullExpiry    = 30 * time.Second
	pullHeartbeat = 5 * time.Second
	// pullRetryMax bounds the pause before pulling again after a pull failed for a reason
	// other than the ones ridden through at once (a leader change, missed heartbeats).
	pullRetryMax = 5 * time.Second
	// pullLimitsEvery is how often, at most, the puller reads the durable's settings again
	// (see limits): an operator may change them while Run runs.
	pullLimitsEvery = 30 * time.Second
)

// puller runs Run's pull requests one after the other and hands what they deliver to handle.
//
// It pulls with one request at a time, and watches what happens to it, so that it knows when
// deliveries may have been lost in transit: the connection reconnected (what was on its way
// died with the old one), the consumer's leader changed (in a JetStream
// cluster: the new leader ends the requests it inherited with a "409 Leadership Change", and
// counts as delivered what the old one sent into a link that then broke), or the leader fell
// silent (missed heartbeats). Those are the interruptions; see deliveryGaps for what a gap
// after one means.
type puller struct {
	s      *OutcomeSubscriber
	js     jetstream.JetStream
	cons   jetstream.Consumer
	seen   *recent
	status <-chan nats.Status // the connection closed for good
	gaps   deliveryGaps
	// interruptions counts the leader changes and silences the requests ended with; the
	// connection's reconnects count too (see interrupted).
	interruptions uint64
	failures      int // consecutive pulls that failed otherwise: the retry pause grows with them
	rewinds       int // consecutive rewinds, without a delivery handled between them
	// acks holds the last deliveries this Run acked, by consumer sequence: what a rewind may
	// deliver again without a second Handler call, as long as their outcome is still in seen.
	acks    []ackedDelivery
	nextAck int
	// failing holds the outcomes whose Handler failed and that were not handled since: each
	// waits out its retry delay, which a rewind would cut short.
	failing map[string]struct{}
	// noResetUntil: a reset was refused; until then rewinds wait instead of asking again.
	noResetUntil time.Time
	// batch and expiry of each pull request: pullBatch and pullExpiry, or less where the
	// durable's MaxRequestBatch or MaxRequestExpires say so; ackWait, the durable's AckWait
	// or the configuration's when shorter, paces the InProgress of a Handler call. All three
	// as of limitsAt (see limits).
	batch    int
	expiry   time.Duration
	ackWait  time.Duration
	limitsAt time.Time
}

// newPuller returns the puller of one Run. Its count of the consumer's deliveries starts at
// the durable's, so that even the first delivery to this Run is checked for a gap.
func newPuller(s *OutcomeSubscriber, js jetstream.JetStream, cons jetstream.Consumer, status <-chan nats.Status) *puller {
	p := &puller{s: s, js: js, cons: cons, seen: newRecent(s.cfg.DedupeWindow), status: status,
		acks: make([]ackedDelivery, s.cfg.DedupeWindow), failing: map[string]struct{}{}}
	info := cons.CachedInfo()
	p.limits(info)
	p.gaps = deliveryGaps{next: info.Delivered.Consumer + 1, interruptions: p.interrupted()}
	return p
}

// limits takes the durable's settings that bound the puller: a pull request asking for more
// than MaxRequestBatch outcomes, or lasting longer than MaxRequestExpires, is refused ("409
// Exceeded MaxRequest..."); an outcome whose Handler runs longer than the durable's AckWait
// without an InProgress is delivered again meanwhile, here or to another process, and
// handled twice. The durable may be one created by someone else, or changed by an operator
// while Run runs: pull reads them again every pullLimitsEvery, and after the server refused a
// pull request for exceeding them.
func (p *puller) limits(info *jetstream.ConsumerInfo) {
	p.batch, p.expiry, p.ackWait, p.limitsAt = pullBatch, pullExpiry, p.s.cfg.AckWait, time.Now()
	if info == nil {
		return
	}
	if n := info.Config.MaxRequestBatch; n > 0 && n < p.batch {
		p.batch = n
	}
	if d := info.Config.MaxRequestExpires; d > 0 && d < p.expiry {
		p.expiry = d
	}
	if d := info.Config.AckWait; d > 0 && d < p.ackWait {
		p.ackWait = d
	}
}

// maxRewinds bounds the consecutive rewinds after which the first delivery is still checked
// (see rewind).
const maxRewinds = 3

// interrupted is the number of interruptions so far: a gap in the consumer's delivery numbers
// that comes with a change of it is deliveries lost.
func (p *puller) interrupted() uint64 {
	return p.interruptions + p.s.cfg.NATS.Stats().Reconnects
}

// pull runs one pull request to its end and handles what it delivers. It returns an error
// only when the subscriber cannot go on (the connection closed, the consumer deleted).
func (p *puller) pull(ctx context.Context) error {
	if time.Since(p.limitsAt) >= pullLimitsEvery && p.s.cfg.NATS.IsConnected() {
		info, err := p.info(ctx)
		if err != nil {
			info = p.cons.CachedInfo() // as before; asked again in pullLimitsEvery
		}
		p.limits(info)
	}
	// The server ends the request after expiry less a tenth, at most 1s (what FetchContext
	// makes of the deadline), with a "408 Request Timeout"; the client gives up at the deadline.
	sent := time.Now()
	rctx, cancel := context.WithTimeout(ctx, p.expiry)
	defer cancel()
	batch, err := p.cons.Fetch(p.batch, jetstream.FetchContext(rctx), jetstream.FetchHeartbeat(min(pullHeartbeat, p.expiry/4)))
	if err != nil {
		if ctx.Err() != nil {
			return nil
		}
		if p.s.cfg.NATS.IsClosed() {
			return p.closed()
		}
		return p.retry(ctx, err)
	}
	msgs, got := batch.Messages(), 0
	for msgs != nil {
		select {
		case <-p.status:
			// Closed for good. (After a reconnect the request goes on: nats.go subscribes its
			// inbox again, and the server still holds it, or its heartbeats stop coming.
			// Ending it here would lose what the server delivers to it meanwhile.)
			return p.closed()
		case msg, ok := <-msgs:
			if !ok {
				msgs = nil
				break
			}
			if p.gaps.lost(msg, p.interrupted()) {
				// Deliveries were lost in transit; the outcomes stored after them, this one
				// included, must not overtake them. Leave this one and the rest of the request
				// unacked, end the request, and rewind.
				cancel()
				for range msgs {
					// Delivered to the ended request: left unacked, delivered again after the rewind.
				}
				return p.rewind(ctx)
			}
			got++
			p.rewinds = 0
			h, id := p.s.handle(ctx, msg, p.seen, p.ackWait)
			p.note(msg, h, id)
		}
	}
	err = batch.Error()
	switch {
	case ctx.Err() != nil:
		return nil // stopping
	case err == nil && (got == p.batch || time.Since(sent) < p.expiry-min(p.expiry/10, time.Second)/2),
		errors.Is(err, context.DeadlineExceeded) && got == p.batch:
		// Filled, or ended by the server's 408.
		p.failures = 0
		return nil
	case err == nil, errors.Is(err, context.DeadlineExceeded):
		// The client gave up before the server's 408 came: the request reached the server late
		// (a link that stalled a while) and may still be served there, into an inbox that is
		// gone. Deliveries may be lost with it.
		p.interruptions++
		p.failures = 0
		return nil
	case p.s.cfg.NATS.IsClosed():
		return p.closed()
	case errors.Is(err, jetstream.ErrConsumerDeleted):
		return fmt.Errorf("outcome subscriber: consume %s: %w", p.s.cfg.Durable, err)
	}
	p.interruptions++ // whatever ended it, deliveries may have been lost with it
	if !errors.Is(err, jetstream.ErrNoHeartbeat) && !errors.Is(err, jetstream.ErrConsumerLeadershipChanged) {
		return p.retry(ctx, err)
	}
	// A JetStream leader election, or the consumer's server went away: pull again at once;
	// outcomes resume once the consumer has a leader. Silence is also what a consumer
	// deleted between two requests leaves: that ends Run.
	p.failures = 0
	p.s.log.Warn("the outcomes consumer's leader changed or went quiet; pulling again", "error", err)
	if errors.Is(err, jetstream.ErrNoHeartbeat) {
		if _, ierr := p.info(ctx); errors.Is(ierr, jetstream.ErrConsumerNotFound) {
			return fmt.Errorf("outcome subscriber: consume %s: %w", p.s.cfg.Durable, ierr)
		}
	}
	return nil
}

// rewind has JetStream deliver again, in stream order, every outcome from the oldest one not
// acknowledged: the lost deliveries come first, then those left unacked after them. It resets
// the durable to its ack floor (the consumer reset API of nats-server 2.14 and later).
//
// A reset also forgets the acks above the floor, and the redelivery counts: an outcome acked
// after an older one that is still unacknowledged (another process holds it, or it was lost
// before an earlier run stopped) is delivered again, and a failed outcome's retry delay is cut
// short. So the reset is used only when this Run has no failed outcome waiting for its retry,
// and every delivery it would repeat was acked by this Run with its outcome still in the dedupe
// window: counted from the durable's state, the deliveries after the ack floor's less those of
// outcomes unacknowledged. A reset whose answer is lost is recognised by the durable's delivery
// count starting again. Otherwise, or where the reset is refused (an older server, a user not
// allowed to), rewind waits until every delivery to this process timed out:
// JetStream then redelivers timed-out messages before new ones, in stream order, once its
// redelivery timer noticed them; a new outcome may still overtake a lost one there. It returns
// an error only when the connection closed for good meanwhile.
func (p *puller) rewind(ctx context.Context) error {
	why, err := p.reset(ctx)
	if err == nil || ctx.Err() != nil {
		return nil
	}
	wait := p.cons.CachedInfo().Config.AckWait
	wait += max(wait/10, 200*time.Millisecond)
	p.s.log.Warn("deliveries lost in transit, and the consumer is not reset ("+why+"); waiting for their redelivery",
		"error", err, "wait", wait.String())
	return p.pause(ctx, wait)
}

// resetRefusedPause is how long rewinds wait without asking for a reset after one was refused.
const resetRefusedPause = 10 * time.Minute

// ackedDelivery is a delivery this Run acked: its consumer sequence and its outcome's message
// id ("" for a message terminated as not an outcome, which a repeat terminates again).
type ackedDelivery struct {
	seq uint64
	id  string
}

// note records what handle did with msg, for reset's check.
func (p *puller) note(msg jetstream.Msg, h handled, id string) {
	switch h {
	case acked, terminated:
		delete(p.failing, id)
		md, err := msg.Metadata()
		if err != nil {
			return
		}
		p.acks[p.nextAck] = ackedDelivery{md.Sequence.Consumer, id}
		p.nextAck = (p.nextAck + 1) % len(p.acks)
	case failed:
		p.failing[id] = struct{}{}
	}
}

// reset resets the durable to its ack floor when that delivers again nothing this Run could
// not skip and cuts no retry delay short (see rewind); otherwise it returns why not.
func (p *puller) reset(ctx context.Context) (string, error) {
	if time.Now().Before(p.noResetUntil) {
		return "refused before", errors.New("reset refused within the last " + resetRefusedPause.String())
	}
	if len(p.failing) > 0 {
		return "an outcome whose Handler failed waits for its retry", fmt.Errorf("%d outcomes failing", len(p.failing))
	}
	info, err := p.info(ctx)
	if err != nil {
		return "its state is unknown", err
	}
	// Deliveries after the ack floor's, by consumer sequence (which, unlike the stream's, skips
	// nothing the durable's filter leaves out): those of outcomes still unacknowledged, at least
	// one each, and the acked ones. Those must all be this Run's, with their outcome still in
	// seen.
	floor, top := info.AckFloor.Consumer, info.Delivered.Consumer
	above := top - min(floor, top)
	ackedAbove := above - min(uint64(max(info.NumAckPending, 0)), above) // at most
	var ours uint64
	for _, a := range p.acks {
		if a.seq > floor && a.seq <= top && (a.id == "" || p.seen.contains(a.id)) {
			ours++
		}
	}
	if ackedAbove > ours {
		return "it would deliver again outcomes acked before this run or out of its dedupe window",
			fmt.Errorf("%d deliveries acked after the ack floor's, %d of them by this run", ackedAbove, ours)
	}
	rctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	res, err := p.js.ResetConsumer(rctx, p.s.cfg.Stream, p.s.cfg.Durable)
	cancel()
	var seq uint64
	switch {
	case err == nil:
		seq = res.ResetSeq
	case ctx.Err() != nil:
		return "stopping", err
	default:
		// Refused, or its answer lost on a slow link: the durable's delivery count tells
		// whether it was reset (it starts again from 0).
		after, ierr := p.info(ctx)
		if ierr != nil {
			return "the reset went unanswered", err
		}
		if after.Delivered.Consumer >= top {
			var apiErr *jetstream.APIError
			if errors.As(err, &apiErr) || errors.Is(err, context.DeadlineExceeded) || errors.Is(err, nats.ErrTimeout) {
				p.noResetUntil = time.Now().Add(resetRefusedPause) // refused (a denied request goes unanswered)
			}
			return "the reset was refused", err
		}
		seq = after.AckFloor.Stream + 1
	}
	// The reset numbers deliveries from 1 again. The request just ended may still be on the
	// server for a moment (its inbox goes right after msgs closed): if it took the first
	// deliveries, the next one here is not number 1, and they are lost again. So that delivery
	// is checked whatever happened meanwhile, and a gap rewinds once more; a few times at most
	// in a row, since processes sharing the durable take deliveries too.
	p.rewinds++
	p.gaps = deliveryGaps{next: 1, interruptions: p.interrupted(), strict: p.rewinds < maxRewinds}
	clear(p.acks) // their consumer sequences are from before the reset
	p.s.log.Warn("deliveries lost in transit; the consumer was reset to its oldest unacknowledged outcome so that none is overtaken",
		"stream_seq", seq)
	return "", nil
}

// info returns the durable's state from the server, within 5s.
func (p *puller) info(ctx context.Context) (*jetstream.ConsumerInfo, error) {
	ctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	return p.cons.Info(ctx)
}

// pause waits d, or less when ctx ends or the connection closes for good (then the error).
func (p *puller) pause(ctx context.Context, d time.Duration) error {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
		return nil
	case <-t.C:
		return nil
	case <-p.status:
		return p.closed()
	}
}

// closed is Run's error when the connection closed for good.
func (p *puller) closed() error {
	return fmt.Errorf("outcome subscriber: consume %s: %w", p.s.cfg.Durable, nats.ErrConnectionClosed)
}

// retry logs a failed pull and pauses before the next, longer the more fail in a row.
func (p *puller) retry(ctx context.Context, err error) error {
	p.failures++
	if strings.Contains(strings.ToLower(err.Error()), "exceeded maxrequest") {
		// "409 Exceeded MaxRequestBatch" (or Expires): an operator lowered the durable's
		// limits; read them again before the next pull, which would be refused the same way.
		p.limitsAt = time.Time{}
	}
	wait := min(100*time.Millisecond<<min(p.failures-1, 6), pullRetryMax)
	p.s.log.Warn("pulling outcomes failed; pulling again", "error", err, "retry_in", wait.String())
	return p.pause(ctx, wait)
}

// deliveryGaps notices deliveries lost in transit. The consumer numbers its deliveries (the
// consumer sequence, redeliveries included), so one process holding the durable receives them
// without gaps unless some were lost on the way: JetStream counts them as made. Processes
// sharing the durable see gaps as they share the deliveries; only a gap across an interruption
// of this process's pulls (see puller) counts.
type deliveryGaps struct {
	next          uint64 // the consumer sequence expected next; 0: unknown
	interruptions uint64 // the puller's interruptions when the last delivery arrived
	strict        bool   // a gap before the next delivery counts without an interruption
}

// lost reports whether deliveries were lost before msg, which arrived when the puller had seen
// interruptions interruptions. After true the count starts again with the next delivery.
func (g *deliveryGaps) lost(msg jetstream.Msg, interruptions uint64) bool {
	md, err := msg.Metadata()
	if err != nil {
		return false // handle says what is wrong with it
	}
	gap := g.next != 0 && md.Sequence.Consumer > g.next && (g.strict || interruptions != g.interruptions)
	g.next, g.interruptions, g.strict = md.Sequence.Consumer+1, interruptions, false
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

// handled is what handle did with a message.
type handled int

const (
	notAcked   handled = iota // left for JetStream to deliver again after AckWait (stopping)
	acked                     // handled, or skipped as a duplicate, and acked
	terminated                // not an outcome: terminated
	failed                    // Handler failed: negatively acked with a delay
)

// handle applies the delivery rules to one message, and says what it did and with which
// outcome (message id; "" when terminated or not decoded).
// ackWait paces the InProgress sent while Handler runs (see keepAlive).
func (s *OutcomeSubscriber) handle(ctx context.Context, msg jetstream.Msg, seen *recent, ackWait time.Duration) (handled, string) {
	if ctx.Err() != nil {
		return notAcked, "" // stopping: not handled, so not acked; delivered again after AckWait
	}
	ev, err := decodeOutcome(s.cfg.SubjectPrefix, s.cfg.ConversationID, msg.Subject(), msg.Data())
	if err != nil {
		s.log.Error("not an outcome event; terminating it", "subject", msg.Subject(), "error", err)
		if err := msg.TermWithReason("not a Baton outcome event"); err != nil {
			s.log.Warn("terminate", "subject", msg.Subject(), "error", err)
		}
		return terminated, ""
	}
	if seen.contains(ev.MessageID) {
		s.log.Debug("duplicate outcome skipped", "message_id", ev.MessageID)
		if err := msg.Ack(); err != nil {
			s.log.Warn("ack", "message_id", ev.MessageID, "error", err)
		}
		return acked, ev.MessageID
	}
	o := Outcome{Event: ev}
	if tp := msg.Headers().Get(HeaderTraceparent); ValidTraceparent(tp) {
		o.Traceparent = tp
	}
	if md, err := msg.Metadata(); err == nil {
		o.StreamSeq, o.Stored, o.Delivery = md.Sequence.Stream, md.Timestamp, md.NumDelivered
	}

	stop := s.keepAlive(msg, ackWait)
	err = s.cfg.Handler(ctx, o)
	stop()

	if err != nil && ctx.Err() != nil {
		// Stopping. A nak now could have the outcome delivered again to this consumer's pull
		// request before it is cancelled, where it would wait out AckWait anyway.
		s.log.Info("stopped while handling an outcome; it is delivered again after the ack wait",
			"message_id", ev.MessageID, "stream_seq", o.StreamSeq, "error", err)
		return notAcked, ""
	}
	if err != nil {
		delay := retryDelay(s.cfg.RetryDelay, s.cfg.MaxRetryDelay, o.Delivery)
		s.log.Warn("outcome handler failed; delivering it again", "message_id", ev.MessageID,
			"stream_seq", o.StreamSeq, "delivery", o.Delivery, "retry_in", delay, "error", err)
		if err := msg.NakWithDelay(delay); err != nil {
			s.log.Warn("nak", "message_id", ev.MessageID, "error", err)
		}
		return failed, ev.MessageID
	}
	seen.add(ev.MessageID)
	// Acked only now that the effect is done. If this ack is lost, the outcome comes back and
	// seen skips it.
	if err := msg.Ack(); err != nil {
		s.log.Warn("ack", "message_id", ev.MessageID, "error", err)
	}
	return acked, ev.MessageID
}

// keepAlive tells JetStream every ackWait/3 that msg is still being handled, until the
// returned function is called; that function returns once the goroutine it started ended.
func (s *OutcomeSubscriber) keepAlive(msg jetstream.Msg, ackWait time.Duration) (stop func()) {
	done, exited := make(chan struct{}), make(chan struct{})
	go func() {
		defer close(exited)
		tick := time.NewTicker(max(ackWait/3, time.Millisecond))
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
