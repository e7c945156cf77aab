package wire_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/stretchr/testify/require"

	"github.com/batonhq/baton/internal/testsvc"
	"github.com/batonhq/baton/wire"
)

func TestMain(m *testing.M) { os.Exit(testsvc.MainNoLeaks(m)) }

// subBundle is a NATS server with an outcomes stream of the test's own prefix, as the relay
// creates it.
type subBundle struct {
	t      *testing.T
	nc     *nats.Conn
	js     jetstream.JetStream
	prefix string
	stream string
	logs   testsvc.Buffer // what the subscribers log
}

var prefixSeq atomic.Int64

// setupSub starts a NATS server (or uses BATON_TEST_NATS_URL's) and, unless noStream, creates
// the outcomes stream. Each test has its own prefix, so tests sharing a server do not meet.
func setupSub(t *testing.T, noStream bool) *subBundle {
	t.Helper()
	b := newSubBundle(t, testsvc.StartNATS(t).URL())
	if !noStream {
		b.createStream()
	}
	return b
}

// newSubBundle connects to the NATS server at url and returns a bundle of a prefix of its
// own there, without its stream.
func newSubBundle(t *testing.T, url string) *subBundle {
	t.Helper()
	nc, err := nats.Connect(url)
	require.NoError(t, err)
	t.Cleanup(nc.Close)
	js, err := jetstream.New(nc)
	require.NoError(t, err)
	prefix := fmt.Sprintf("t%d_%d", time.Now().UnixNano(), prefixSeq.Add(1))
	return &subBundle{t: t, nc: nc, js: js, prefix: prefix, stream: wire.StreamName(prefix, wire.KindOutcomes)}
}

func (b *subBundle) ctx() context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	b.t.Cleanup(cancel)
	return ctx
}

func (b *subBundle) createStream() {
	_, err := b.js.CreateStream(b.ctx(), jetstream.StreamConfig{
		Name:     b.stream,
		Subjects: []string{wire.StreamFilter(b.prefix, wire.KindOutcomes)},
		Storage:  jetstream.MemoryStorage,
	})
	require.NoError(b.t, err)
	b.t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		_ = b.js.DeleteStream(ctx, b.stream)
	})
}

// publish stores an outcome event of conversation conv as the relay does, with Nats-Msg-Id
// msgID (OutcomeMsgID when empty), and returns its stream sequence.
func (b *subBundle) publish(conv, messageID, msgID string) uint64 {
	b.t.Helper()
	subj, err := wire.OutcomeSubject(b.prefix, conv)
	require.NoError(b.t, err)
	body, err := json.Marshal(wire.OutcomeEvent{MessageID: messageID, ConversationID: conv, Role: "assistant",
		Content: "reply " + messageID, ContentBytes: len("reply " + messageID)})
	require.NoError(b.t, err)
	return b.publishRaw(subj, messageID, msgID, body)
}

// publishRaw stores data on subject.
func (b *subBundle) publishRaw(subject, messageID, msgID string, data []byte) uint64 {
	b.t.Helper()
	if msgID == "" {
		msgID = wire.OutcomeMsgID(messageID)
	}
	msg := nats.NewMsg(subject)
	msg.Header.Set(nats.MsgIdHdr, msgID)
	msg.Header.Set(wire.HeaderMessageID, wire.HeaderID(messageID))
	msg.Header.Set(wire.HeaderRole, "assistant")
	msg.Data = data
	ack, err := b.js.PublishMsg(b.ctx(), msg)
	require.NoError(b.t, err)
	require.False(b.t, ack.Duplicate, "%s was dropped as a duplicate", msgID)
	return ack.Sequence
}

// recorder is a handler that records every call, in order, and answers with the outcome of
// respond (nil: succeed at once).
type recorder struct {
	mu      sync.Mutex
	calls   []wire.Outcome
	called  chan wire.Outcome
	respond func(ctx context.Context, o wire.Outcome) error
}

func newRecorder(respond func(ctx context.Context, o wire.Outcome) error) *recorder {
	return &recorder{called: make(chan wire.Outcome, 1000), respond: respond}
}

func (r *recorder) handle(ctx context.Context, o wire.Outcome) error {
	r.mu.Lock()
	r.calls = append(r.calls, o)
	r.mu.Unlock()
	r.called <- o
	if r.respond != nil {
		return r.respond(ctx, o)
	}
	return nil
}

// ids returns the message ids of the calls so far, in order.
func (r *recorder) ids() []string {
	r.mu.Lock()
	defer r.mu.Unlock()
	ids := make([]string, len(r.calls))
	for i, c := range r.calls {
		ids[i] = c.Event.MessageID
	}
	return ids
}

// next waits for the next call.
func (r *recorder) next(t *testing.T) wire.Outcome {
	t.Helper()
	select {
	case o := <-r.called:
		return o
	case <-time.After(30 * time.Second):
		t.Fatal("the handler was not called within 30s")
		return wire.Outcome{}
	}
}

// config is a subscriber configuration on the bundle's stream, logging to b.logs.
func (b *subBundle) config(durable string, r *recorder) wire.OutcomeSubscriberConfig {
	return wire.OutcomeSubscriberConfig{NATS: b.nc, SubjectPrefix: b.prefix, Durable: durable, Handler: r.handle,
		Logger: slog.New(slog.NewTextHandler(&b.logs, &slog.HandlerOptions{Level: slog.LevelDebug}))}
}

// run runs a subscriber until the returned stop is called (or the test ends); stop requires
// Run to return nil within 30s.
func (b *subBundle) run(cfg wire.OutcomeSubscriberConfig) (stop func()) {
	b.t.Helper()
	sub, err := wire.NewOutcomeSubscriber(cfg)
	require.NoError(b.t, err)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- sub.Run(ctx) }()
	var once sync.Once
	stop = func() {
		once.Do(func() {
			cancel()
			select {
			case err := <-done:
				require.NoError(b.t, err)
			case <-time.After(30 * time.Second):
				b.t.Errorf("Run did not return within 30s of its context ending")
			}
		})
	}
	b.t.Cleanup(stop)
	return stop
}

// start runs a subscriber with cfg until the test ends (then requiring Run to return within
// 40s), and returns what Run returned.
func (b *subBundle) start(cfg wire.OutcomeSubscriberConfig) <-chan error {
	sub, err := wire.NewOutcomeSubscriber(cfg)
	require.NoError(b.t, err)
	ctx, cancel := context.WithCancel(context.Background())
	done, exited := make(chan error, 1), make(chan struct{})
	go func() {
		done <- sub.Run(ctx)
		close(exited)
	}()
	b.t.Cleanup(func() {
		cancel()
		select {
		case <-exited:
		case <-time.After(40 * time.Second):
			b.t.Errorf("Run did not return within 40s of its context ending")
		}
	})
	return done
}

// consumerInfo returns the durable's state as the server has it.
func (b *subBundle) consumerInfo(durable string) *jetstream.ConsumerInfo {
	b.t.Helper()
	info, err := b.tryConsumerInfo(durable)
	require.NoError(b.t, err)
	return info
}

// tryConsumerInfo is consumerInfo for conditions polled before the durable may exist.
func (b *subBundle) tryConsumerInfo(durable string) (*jetstream.ConsumerInfo, error) {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	c, err := b.js.Consumer(ctx, b.stream, durable)
	if err != nil {
		return nil, err
	}
	return c.Info(ctx)
}

// idle reports whether durable exists and has nothing to deliver and nothing unacked.
func (b *subBundle) idle(durable string) bool {
	info, err := b.tryConsumerInfo(durable)
	return err == nil && info.NumPending == 0 && info.NumAckPending == 0
}

// waitAcked waits until durable has nothing pending and its ack floor is at stream sequence
// seq: every message up to seq was acked or terminated.
func (b *subBundle) waitAcked(durable string, seq uint64) *jetstream.ConsumerInfo {
	b.t.Helper()
	var info *jetstream.ConsumerInfo
	require.Eventually(b.t, func() bool {
		var err error
		info, err = b.tryConsumerInfo(durable)
		return err == nil && info.NumPending == 0 && info.NumAckPending == 0 && info.AckFloor.Stream == seq
	}, 30*time.Second, 10*time.Millisecond, "durable %s never acked up to %d", durable, seq)
	return info
}

// Rule: each outcome reaches the handler once. A copy stored under another Nats-Msg-Id (a
// relay replay past the duplicate window) is acked without a handler call.
func TestOutcomeSubscriberSkipsDuplicatesByMessageID(t *testing.T) {
	t.Parallel()
	b := setupSub(t, false)
	b.publish("c1", "r1", "")
	b.publish("c2", "r2", "")
	b.publish("c1", "r1", "replayed:"+wire.OutcomeMsgID("r1"))
	b.publish("c2", "r2", "replayed:"+wire.OutcomeMsgID("r2"))
	last := b.publish("c1", "r3", "")

	r := newRecorder(nil)
	b.run(b.config("dedupe", r))
	info := b.waitAcked("dedupe", last)
	require.Equal(t, []string{"r1", "r2", "r3"}, r.ids())
	require.Equal(t, last, info.Delivered.Consumer, "no message was delivered twice")
	r.mu.Lock()
	defer r.mu.Unlock()
	require.Equal(t, []uint64{1, 2, 5}, []uint64{r.calls[0].StreamSeq, r.calls[1].StreamSeq, r.calls[2].StreamSeq})
	for _, c := range r.calls {
		require.Equal(t, uint64(1), c.Delivery)
		require.False(t, c.Stored.IsZero())
		require.Equal(t, "reply "+c.Event.MessageID, c.Event.Content)
	}
	require.Contains(t, b.logs.String(), "duplicate outcome skipped")
}

// Rule: an outcome is acked only after the handler returned nil, and JetStream does not
// deliver it again while the handler runs longer than AckWait.
func TestOutcomeSubscriberAcksOnlyAfterHandlerReturns(t *testing.T) {
	t.Parallel()
	b := setupSub(t, false)
	seq := b.publish("c1", "r1", "")
	release := make(chan struct{})
	r := newRecorder(func(ctx context.Context, _ wire.Outcome) error {
		select {
		case <-release:
			return nil
		case <-ctx.Done():
			return ctx.Err()
		}
	})
	cfg := b.config("slow", r)
	cfg.AckWait = time.Second
	b.run(cfg)
	r.next(t)

	// The handler holds the outcome for 2.5 AckWaits: not acked, not delivered again.
	deadline := time.Now().Add(2500 * time.Millisecond)
	for time.Now().Before(deadline) {
		info := b.consumerInfo("slow")
		require.Equal(t, uint64(0), info.AckFloor.Stream, "acked while the handler runs")
		require.Equal(t, 1, info.NumAckPending)
		require.Equal(t, uint64(1), info.Delivered.Consumer, "delivered again while the handler runs")
		time.Sleep(50 * time.Millisecond)
	}
	close(release)
	info := b.waitAcked("slow", seq)
	require.Equal(t, uint64(1), info.Delivered.Consumer)
	require.Equal(t, []string{"r1"}, r.ids())
}

// Rule: a handler error has the outcome delivered again after RetryDelay; the outcomes after
// it are not held back, and it is acked once the handler succeeds.
func TestOutcomeSubscriberRedeliversAfterHandlerError(t *testing.T) {
	t.Parallel()
	b := setupSub(t, false)
	b.publish("c1", "r1", "")
	last := b.publish("c2", "r2", "")
	var failures atomic.Int32
	r := newRecorder(func(_ context.Context, o wire.Outcome) error {
		if o.Event.MessageID == "r1" && o.Delivery < 3 {
			failures.Add(1)
			return errors.New("downstream unavailable")
		}
		return nil
	})
	cfg := b.config("retry", r)
	cfg.RetryDelay = 100 * time.Millisecond
	b.run(cfg)
	b.waitAcked("retry", last)
	require.Equal(t, []string{"r1", "r2", "r1", "r1"}, r.ids())
	require.Equal(t, int32(2), failures.Load())
	r.mu.Lock()
	deliveries := []uint64{r.calls[0].Delivery, r.calls[1].Delivery, r.calls[2].Delivery, r.calls[3].Delivery}
	r.mu.Unlock()
	require.Equal(t, []uint64{1, 1, 2, 3}, deliveries)
	require.Contains(t, b.logs.String(), "outcome handler failed; delivering it again")
}

// Rule: a message that is not an outcome event is terminated with an error log, never handed
// on and never delivered again.
func TestOutcomeSubscriberTerminatesMalformed(t *testing.T) {
	t.Parallel()
	b := setupSub(t, false)
	c1, err := wire.OutcomeSubject(b.prefix, "c1")
	require.NoError(t, err)
	b.publishRaw(c1, "bad1", "", []byte("not json"))
	b.publishRaw(c1, "bad2", "", []byte(`{"conversation_id":"c1","role":"assistant"}`))
	b.publishRaw(c1, "bad3", "", []byte(`{"message_id":"bad3","conversation_id":"c2","role":"assistant"}`))
	b.publishRaw(b.prefix+".outcomes.~YQ", "bad4", "", []byte(`{"message_id":"bad4","conversation_id":"a","role":"assistant"}`))
	last := b.publish("c1", "r1", "")

	r := newRecorder(nil)
	cfg := b.config("malformed", r)
	cfg.AckWait = 300 * time.Millisecond
	b.run(cfg)
	b.waitAcked("malformed", last)
	time.Sleep(3 * cfg.AckWait) // long enough for a redelivery, were there one
	info := b.consumerInfo("malformed")
	require.Equal(t, last, info.Delivered.Consumer, "a malformed message was delivered again")
	require.Equal(t, last, info.AckFloor.Stream)
	require.Equal(t, []string{"r1"}, r.ids())
	require.Equal(t, 4, strings.Count(b.logs.String(), "not an outcome event; terminating it"))
}

// Rule: with ConversationID set, the handler sees that conversation's outcomes and no other,
// also when an id needs the encoded token or is a prefix of another; a message on its subject
// whose body names another conversation is terminated.
func TestOutcomeSubscriberOneConversation(t *testing.T) {
	t.Parallel()
	b := setupSub(t, false)
	const mine = "support/ticket 7"
	b.publish(mine, "m1", "")
	b.publish("support", "o1", "")
	b.publish("support-ticket-7", "o2", "")
	b.publish(mine, "m2", "")
	subj, err := wire.OutcomeSubject(b.prefix, mine)
	require.NoError(t, err)
	b.publishRaw(subj, "spoof", "", []byte(`{"message_id":"spoof","conversation_id":"support","role":"assistant"}`))
	b.publish("support", "o3", "")
	b.publish(mine, "m3", "")

	r := newRecorder(nil)
	cfg := b.config("one", r)
	cfg.ConversationID = mine
	b.run(cfg)
	for range 3 {
		r.next(t)
	}
	require.Eventually(t, func() bool { return b.idle("one") }, 30*time.Second, 10*time.Millisecond)
	require.Equal(t, []string{"m1", "m2", "m3"}, r.ids())
	r.mu.Lock()
	for _, c := range r.calls {
		require.Equal(t, mine, c.Event.ConversationID)
	}
	r.mu.Unlock()
	// Only the spoof was seen and terminated: the others' outcomes never reached this durable.
	require.Equal(t, 1, strings.Count(b.logs.String(), "not an outcome event; terminating it"))
	require.Equal(t, subj, b.consumerInfo("one").Config.FilterSubject)

	// Every conversation's subscriber, with a durable of its own, sees the rest too.
	all := newRecorder(nil)
	b.run(b.config("all", all))
	b.waitAcked("all", 7)
	require.Equal(t, []string{"m1", "o1", "o2", "m2", "o3", "m3"}, all.ids())

	// A durable made for every conversation cannot be reused for one: it would deliver the
	// others' outcomes.
	sub, err := wire.NewOutcomeSubscriber(wire.OutcomeSubscriberConfig{NATS: b.nc, SubjectPrefix: b.prefix,
		Durable: "all", ConversationID: mine, Handler: r.handle})
	require.NoError(t, err)
	err = sub.Run(b.ctx())
	require.ErrorContains(t, err, "exists with filter")
}

// A new durable starts where StartSeq or StartTime says; an existing one keeps its position
// and ignores them.
func TestOutcomeSubscriberStartPosition(t *testing.T) {
	t.Parallel()
	b := setupSub(t, false)
	b.publish("c1", "r1", "")
	between := time.Now()
	time.Sleep(10 * time.Millisecond) // stored times are taken by the server's clock, same host
	second := b.publish("c1", "r2", "")
	b.publish("c1", "r3", "")

	fromSeq := newRecorder(nil)
	cfg := b.config("from-seq", fromSeq)
	cfg.StartSeq = second
	stop := b.run(cfg)
	b.waitAcked("from-seq", 3)
	require.Equal(t, []string{"r2", "r3"}, fromSeq.ids())
	stop()

	since := newRecorder(nil)
	cfg = b.config("since", since)
	cfg.StartTime = between
	b.run(cfg)
	b.waitAcked("since", 3)
	require.Equal(t, []string{"r2", "r3"}, since.ids())

	// Restarted with another start, the first durable continues where it stopped.
	last := b.publish("c1", "r4", "")
	again := newRecorder(nil)
	cfg = b.config("from-seq", again)
	cfg.StartSeq = 1
	b.run(cfg)
	b.waitAcked("from-seq", last)
	require.Equal(t, []string{"r4"}, again.ids())
	require.Contains(t, b.logs.String(), "durable exists and keeps its position")
}

// Run waits for the stream the relay creates; when its context ends, it returns only after
// the handler call in progress returned, and that outcome, not acked, is delivered again
// after AckWait.
func TestOutcomeSubscriberWaitsForStreamAndStopsCleanly(t *testing.T) {
	t.Parallel()
	b := setupSub(t, true)
	var returned atomic.Bool
	r := newRecorder(func(ctx context.Context, o wire.Outcome) error {
		if o.Event.MessageID != "r2" {
			return nil
		}
		<-ctx.Done()
		time.Sleep(200 * time.Millisecond) // an effect finishing its clean-up
		returned.Store(true)
		return ctx.Err()
	})
	cfg := b.config("stop", r)
	cfg.AckWait = time.Second
	stop := b.run(cfg)
	require.Eventually(t, func() bool { return strings.Contains(b.logs.String(), "waiting for the outcomes stream") },
		30*time.Second, 10*time.Millisecond)

	b.createStream()
	b.publish("c1", "r1", "")
	require.Equal(t, "r1", r.next(t).Event.MessageID)
	b.publish("c1", "r2", "")
	require.Equal(t, "r2", r.next(t).Event.MessageID)
	stop()
	require.True(t, returned.Load(), "Run returned before the handler did")
	info := b.consumerInfo("stop")
	require.Equal(t, uint64(1), info.AckFloor.Stream, "the stopped outcome was acked")

	require.Contains(t, b.logs.String(), "stopped while handling an outcome")

	next := newRecorder(nil)
	b.run(b.config("stop", next))
	o := next.next(t)
	require.Equal(t, "r2", o.Event.MessageID)
	require.Equal(t, uint64(2), o.Delivery)
	b.waitAcked("stop", 2)
}

func TestNewOutcomeSubscriberValidates(t *testing.T) {
	t.Parallel()
	nc := &nats.Conn{} // never used: New does no I/O
	handle := func(context.Context, wire.Outcome) error { return nil }
	for _, tt := range []struct {
		name string
		cfg  wire.OutcomeSubscriberConfig
		err  string
	}{
		{"no NATS", wire.OutcomeSubscriberConfig{Durable: "d", Handler: handle}, "NATS is required"},
		{"no handler", wire.OutcomeSubscriberConfig{NATS: nc, Durable: "d"}, "Handler is required"},
		{"no durable", wire.OutcomeSubscriberConfig{NATS: nc, Handler: handle}, "not a consumer name"},
		{"durable with a dot", wire.OutcomeSubscriberConfig{NATS: nc, Handler: handle, Durable: "a.b"}, "not a consumer name"},
		{"bad prefix", wire.OutcomeSubscriberConfig{NATS: nc, Handler: handle, Durable: "d", SubjectPrefix: "a.*"}, "invalid subject prefix"},
		{"bad conversation", wire.OutcomeSubscriberConfig{NATS: nc, Handler: handle, Durable: "d",
			ConversationID: strings.Repeat("x", wire.MaxConversationIDLen+1)}, "invalid conversation id"},
		{"two starts", wire.OutcomeSubscriberConfig{NATS: nc, Handler: handle, Durable: "d", StartSeq: 3, StartTime: time.Now()},
			"exclude each other"},
		{"negative", wire.OutcomeSubscriberConfig{NATS: nc, Handler: handle, Durable: "d", DedupeWindow: -1}, "must not be negative"},
	} {
		_, err := wire.NewOutcomeSubscriber(tt.cfg)
		require.ErrorContains(t, err, tt.err, tt.name)
	}
}

// runExampleNATS starts an in-process NATS server with JetStream for the examples, which have
// no *testing.T; stop shuts it down and removes its store.
func runExampleNATS() (url string, stop func()) {
	dir, err := os.MkdirTemp("", "wire-example-")
	if err != nil {
		panic(err)
	}
	srv, err := server.NewServer(&server.Options{Host: "127.0.0.1", Port: server.RANDOM_PORT, JetStream: true,
		StoreDir: dir, NoLog: true, NoSigs: true})
	if err != nil {
		panic(err)
	}
	srv.Start()
	if !srv.ReadyForConnections(10 * time.Second) {
		panic("nats server not ready")
	}
	return srv.ClientURL(), func() {
		srv.Shutdown()
		srv.WaitForShutdown()
		_ = os.RemoveAll(dir)
	}
}

// publishExampleOutcomes creates the outcomes stream and publishes outcome events as the
// relay does: a reply and an error in conv-42, a reply in conv-7, and the first reply again,
// as a relay replaying after a crash stores it.
func publishExampleOutcomes(nc *nats.Conn) {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	js, err := jetstream.New(nc)
	if err != nil {
		panic(err)
	}
	if _, err := js.CreateStream(ctx, jetstream.StreamConfig{
		Name:     wire.StreamName(wire.DefaultSubjectPrefix, wire.KindOutcomes),
		Subjects: []string{wire.StreamFilter(wire.DefaultSubjectPrefix, wire.KindOutcomes)},
	}); err != nil {
		panic(err)
	}
	for i, ev := range []wire.OutcomeEvent{
		{MessageID: "r1", ConversationID: "conv-42", Role: "assistant", Content: "The Q3 numbers are in."},
		{MessageID: "r2", ConversationID: "conv-7", Role: "assistant", Content: "Hello."},
		{MessageID: "r1", ConversationID: "conv-42", Role: "assistant", Content: "The Q3 numbers are in."},
		{MessageID: "e1", ConversationID: "conv-42", Role: "error", Content: "The agent could not answer."},
	} {
		subj, err := wire.OutcomeSubject(wire.DefaultSubjectPrefix, ev.ConversationID)
		if err != nil {
			panic(err)
		}
		msg := nats.NewMsg(subj)
		msg.Header.Set(nats.MsgIdHdr, fmt.Sprintf("%s/%d", wire.OutcomeMsgID(ev.MessageID), i))
		msg.Data, err = json.Marshal(ev)
		if err != nil {
			panic(err)
		}
		if _, err := js.PublishMsg(ctx, msg); err != nil {
			panic(err)
		}
	}
}
