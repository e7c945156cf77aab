package wire_test

import (
	"context"
	"errors"
	"fmt"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/stretchr/testify/require"

	"github.com/batonhq/baton/internal/testsvc"
	"github.com/batonhq/baton/wire"
)

// Attacks on the outcome subscriber by a third reviewer with no stake in it: a server restart,
// durables whose configuration is not the subscriber's, and two Runs of one subscriber. Each
// test names the rule, the attack, and how it failed before the fix.

// createDurableWith creates durable as an operator, or an earlier version of the program, would:
// with the subscriber's filter and ack policy, and what change sets.
func (b *subBundle) createDurableWith(durable string, change func(*jetstream.ConsumerConfig)) {
	b.t.Helper()
	cfg := jetstream.ConsumerConfig{
		Durable:       durable,
		FilterSubject: wire.StreamFilter(b.prefix, wire.KindOutcomes),
		AckPolicy:     jetstream.AckExplicitPolicy,
		AckWait:       wire.DefaultSubscriberAckWait,
		MaxDeliver:    -1,
	}
	change(&cfg)
	_, err := b.js.CreateConsumer(b.ctx(), b.stream, cfg)
	require.NoError(b.t, err)
}

// updateDurable has an operator change the durable's configuration while it is in use.
func (b *subBundle) updateDurable(durable string, change func(*jetstream.ConsumerConfig)) {
	b.t.Helper()
	cfg := b.consumerInfo(durable).Config
	change(&cfg)
	_, err := b.js.UpdateConsumer(b.ctx(), b.stream, cfg)
	require.NoError(b.t, err)
}

// Coverage (this attack held): a standalone server restarted on the same port and store
// directory while the subscriber has a backlog in its client-side buffer and a pull request
// open. Every outcome, before and after the restart, is handled once and in its
// conversation's order, and Run goes on (the shutdown ends the pull request at once).
func TestOutcomeSubscriberRidesThroughAServerRestartMidBacklog(t *testing.T) {
	t.Parallel()
	srv := testsvc.StartNATS(t)
	require.False(t, srv.External(), "this test restarts its NATS server: unset "+testsvc.EnvNATSURL)
	b := newSubBundle(t, srv.URL())
	_, err := b.js.CreateStream(b.ctx(), jetstream.StreamConfig{ // as the relay does: on file
		Name:     b.stream,
		Subjects: []string{wire.StreamFilter(b.prefix, wire.KindOutcomes)},
		Storage:  jetstream.FileStorage,
	})
	require.NoError(t, err)
	b.logOnFailure()
	sc, err := nats.Connect(srv.URL(), nats.MaxReconnects(-1), nats.ReconnectWait(50*time.Millisecond))
	require.NoError(t, err)
	t.Cleanup(sc.Close)
	r := newRecorder(func(context.Context, wire.Outcome) error {
		time.Sleep(100 * time.Millisecond)
		return nil
	})
	cfg := b.config("restart", r)
	cfg.NATS = sc
	cfg.AckWait = 2 * time.Second
	done := b.start(cfg)

	var last uint64
	for i := 1; i <= 30; i++ {
		last = b.publish(fmt.Sprintf("c%d", i%3), fmt.Sprintf("a%02d", i), "")
	}
	for range 10 {
		r.next(t)
	}
	srv.Stop()
	time.Sleep(300 * time.Millisecond)
	require.NoError(t, srv.Start())
	for i := 31; i <= 40; i++ {
		last = b.publish(fmt.Sprintf("c%d", i%3), fmt.Sprintf("a%02d", i), "")
	}
	b.waitAcked("restart", last)

	ids := r.ids()
	n := countIDs(ids)
	for i := 1; i <= 40; i++ {
		require.Equal(t, 1, n[fmt.Sprintf("a%02d", i)], "a%02d handled %d times: %v", i, n[fmt.Sprintf("a%02d", i)], ids)
	}
	lastOf := map[int]int{}
	for _, id := range ids {
		var i int
		_, err := fmt.Sscanf(id, "a%d", &i)
		require.NoError(t, err)
		require.Greater(t, i, lastOf[i%3], "conversation c%d out of order: %v", i%3, ids)
		lastOf[i%3] = i
	}
	select {
	case err := <-done:
		t.Fatalf("Run returned %v across a server restart", err)
	default:
	}
}

// Rule: an outcome whose Handler failed waits RetryDelay (doubling) before it is delivered
// again. Attack: the durable exists already (Run "uses it as it is") with an AckWait shorter
// than the configuration's, say 1s where the configuration keeps the 30s default (an operator
// shortened it, or an earlier deployment created it). keepAlive sends InProgress every
// cfg.AckWait/3 = 10s, not every durable AckWait/3, so while a Handler runs 2.5s JetStream
// delivers its outcome again twice, into the same pull request; when the Handler fails, those
// copies, not in the dedupe window, are handed to the Handler at once, one after the other,
// instead of a minute later. Failed 3 of 3 on 2d8edb1; InProgress now follows the durable's
// AckWait when it is the shorter (puller.limits).
func TestOutcomeSubscriberKeepsTheRetryDelayOnADurableWithAShorterAckWait(t *testing.T) {
	t.Parallel()
	b, r := slowHandlerOnAShortAckWait(t, "short", errors.New("fails for now"))
	cfg := b.config("short", r)
	cfg.RetryDelay = time.Minute
	cfg.MaxRetryDelay = time.Minute
	b.run(cfg)
	b.publish("c1", "slow", "")
	require.Equal(t, "slow", r.next(t).Event.MessageID)
	select {
	case o := <-r.called:
		t.Fatalf("%s (delivery %d) handed to the Handler again at once, not after RetryDelay (1m): %v",
			o.Event.MessageID, o.Delivery, r.ids())
	case <-time.After(6 * time.Second):
	}
}

// slowHandlerOnAShortAckWait creates durable with an AckWait of 1s (the configuration keeps
// its 30s default) and returns a recorder whose Handler runs 2.5s and returns result.
func slowHandlerOnAShortAckWait(t *testing.T, durable string, result error) (*subBundle, *recorder) {
	t.Helper()
	b := setupSub(t, false)
	b.logOnFailure()
	b.createDurableWith(durable, func(c *jetstream.ConsumerConfig) { c.AckWait = time.Second })
	return b, newRecorder(func(context.Context, wire.Outcome) error {
		time.Sleep(2500 * time.Millisecond)
		return result
	})
}

// Rule: between processes sharing a Durable, JetStream's acks prevent repeats; while Handler
// runs the subscriber keeps the outcome from being delivered again. Attack: as above, a durable
// with a shorter AckWait (1s) than the configuration's default, and two processes sharing it.
// A Handler that runs 2.5s and succeeds has its outcome delivered to the other process
// meanwhile, whose Handler handles it a second time, concurrently. Failed 3 of 3 on 2d8edb1.
func TestOutcomeSubscriberKeepsASlowHandlersOutcomeOnADurableWithAShorterAckWait(t *testing.T) {
	t.Parallel()
	b, r := slowHandlerOnAShortAckWait(t, "shared", nil)
	b.run(b.config("shared", r))
	b.run(b.config("shared", r))
	require.Eventually(t, func() bool {
		info, err := b.tryConsumerInfo("shared")
		return err == nil && info.NumWaiting >= 2
	}, 10*time.Second, 10*time.Millisecond, "the two processes are not both pulling")
	seq := b.publish("c1", "slow", "")
	b.waitAcked("shared", seq)
	time.Sleep(500 * time.Millisecond) // a second call in progress shows
	require.Equal(t, []string{"slow"}, r.ids(), "one outcome, no failure, no lost ack: handled %d times", len(r.ids()))
}

// Rule: Run goes on delivering while the durable exists; a durable whose MaxRequestBatch or
// MaxRequestExpires is below the subscriber's 500 / 30s is used with those limits. Attack: an
// operator lowers either limit while Run is active (the durable's state and position are
// untouched). newPuller read the limits once, so every later pull request is refused ("409
// Exceeded MaxRequestBatch/MaxRequestExpires") and retried unchanged, every 5s, forever: Run
// neither delivers nor returns, and says so only in warnings. (The durable starts with
// MaxRequestExpires 2s so that the pull request open at the change ends within the test; with
// the default it ends within 30s, and the wedge is the same.) Failed 3 of 3 on 2d8edb1; a
// refused request now has the puller read the durable's limits again before the next.
func TestOutcomeSubscriberFollowsAMaxRequestBatchLoweredWhileRunning(t *testing.T) {
	t.Parallel()
	testWedgesOnALowerLimit(t, func(c *jetstream.ConsumerConfig) { c.MaxRequestBatch = 10 })
}

// As TestOutcomeSubscriberFollowsAMaxRequestBatchLoweredWhileRunning, with MaxRequestExpires
// lowered from 2s to 1s.
func TestOutcomeSubscriberFollowsAMaxRequestExpiresLoweredWhileRunning(t *testing.T) {
	t.Parallel()
	testWedgesOnALowerLimit(t, func(c *jetstream.ConsumerConfig) { c.MaxRequestExpires = time.Second })
}

func testWedgesOnALowerLimit(t *testing.T, change func(*jetstream.ConsumerConfig)) {
	b := setupSub(t, false)
	b.logOnFailure()
	b.createDurableWith("op", func(c *jetstream.ConsumerConfig) { c.MaxRequestExpires = 2 * time.Second })
	r := newRecorder(nil)
	b.run(b.config("op", r))
	b.publish("c1", "m1", "")
	require.Equal(t, "m1", r.next(t).Event.MessageID)
	b.updateDurable("op", change)
	time.Sleep(3 * time.Second) // the pull request open at the change ends
	seq := b.publish("c1", "m2", "")
	require.Eventually(t, func() bool {
		info, err := b.tryConsumerInfo("op")
		return err == nil && info.NumAckPending == 0 && info.AckFloor.Stream == seq
	}, 10*time.Second, 20*time.Millisecond, "m2 was never handled after the operator's change: handled %v", r.ids())
}

// Rule: "Handler is called for one outcome at a time", in the order JetStream delivers them.
// Attack: Run called twice, concurrently, on one OutcomeSubscriber. Unguarded, the two Runs
// pulled from the durable side by side and called the Handler concurrently for outcomes of
// one conversation (failed 3 of 3 on 2d8edb1 with 2 calls at once). The second Run now
// returns ErrAlreadyRunning at once; the first goes on alone, one outcome at a time, and a
// Run after it returned is allowed again.
func TestOutcomeSubscriberRefusesASecondConcurrentRun(t *testing.T) {
	t.Parallel()
	b := setupSub(t, false)
	b.logOnFailure()
	var active, most atomic.Int32
	r := newRecorder(func(context.Context, wire.Outcome) error {
		n := active.Add(1)
		defer active.Add(-1)
		for m := most.Load(); n > m; m = most.Load() {
			if most.CompareAndSwap(m, n) {
				break
			}
		}
		time.Sleep(100 * time.Millisecond)
		return nil
	})
	sub, err := wire.NewOutcomeSubscriber(b.config("twice", r))
	require.NoError(t, err)
	ctx, cancel := context.WithCancel(context.Background())
	first := make(chan error, 1)
	go func() { first <- sub.Run(ctx) }()
	firstReturned := false
	t.Cleanup(func() {
		cancel()
		if !firstReturned {
			if err := awaitRun(first); err != nil {
				t.Errorf("the first Run: %v", err)
			}
		}
	})
	require.Eventually(t, func() bool {
		info, err := b.tryConsumerInfo("twice")
		return err == nil && info.NumWaiting >= 1
	}, 10*time.Second, 10*time.Millisecond, "the first Run is not pulling")
	second := make(chan error, 1)
	go func() { second <- sub.Run(ctx) }()
	select {
	case err := <-second:
		require.ErrorIs(t, err, wire.ErrAlreadyRunning)
	case <-time.After(10 * time.Second):
		t.Fatal("a second Run of the same subscriber is running beside the first")
	}
	var last uint64
	for i := 1; i <= 4; i++ {
		last = b.publish("c1", fmt.Sprintf("m%d", i), "")
	}
	b.waitAcked("twice", last)
	require.Equal(t, []string{"m1", "m2", "m3", "m4"}, r.ids())
	require.Equal(t, int32(1), most.Load(), "the Handler ran for %d outcomes of c1 at once", most.Load())

	// Once the first returned, Run may be called again.
	cancel()
	firstReturned = true
	require.NoError(t, awaitRun(first), "the first Run")
	ctx2, cancel2 := context.WithCancel(context.Background())
	again := make(chan error, 1)
	go func() { again <- sub.Run(ctx2) }()
	last = b.publish("c1", "m5", "")
	b.waitAcked("twice", last)
	cancel2()
	require.NoError(t, awaitRun(again), "the Run after the first")
	require.Equal(t, []string{"m1", "m2", "m3", "m4", "m5"}, r.ids())
}

// awaitRun returns what a stopped Run sent on done, or an error when it sent nothing in 30s.
func awaitRun(done <-chan error) error {
	select {
	case err := <-done:
		return err
	case <-time.After(30 * time.Second):
		return errors.New("did not return within 30s of its stop")
	}
}
