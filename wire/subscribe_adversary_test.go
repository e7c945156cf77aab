package wire_test

import (
	"context"
	"errors"
	"fmt"
	"net"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/stretchr/testify/require"

	"github.com/batonhq/baton/internal/testsvc"
	"github.com/batonhq/baton/wire"
)

// Attacks on the outcome subscriber's puller (Fetch, interruptions, consumer reset), by a
// reviewer with no stake in it: each failed on its first version (6a35081).

// proxiedConn is a subscriber connection through a proxy the test can freeze and reset.
func (b *subBundle) proxiedConn() (*testsvc.Proxy, *nats.Conn) {
	b.t.Helper()
	proxy := testsvc.StartProxy(b.t, b.nc.ConnectedAddr())
	sc, err := nats.Connect("nats://"+proxy.Addr(), nats.MaxReconnects(-1), nats.ReconnectWait(50*time.Millisecond))
	require.NoError(b.t, err)
	b.t.Cleanup(sc.Close)
	return proxy, sc
}

// loseNext publishes conv/id while the subscriber's link is frozen, waits until JetStream
// delivered it (stream sequence seq) into the link, and then drops the link: the delivery is
// lost, the subscriber reconnects.
func (b *subBundle) loseNext(proxy *testsvc.Proxy, sc *nats.Conn, durable, conv, id string) uint64 {
	b.t.Helper()
	reconnects := sc.Stats().Reconnects
	require.Eventually(b.t, func() bool {
		info, err := b.tryConsumerInfo(durable)
		return err == nil && info.NumWaiting > 0
	}, 10*time.Second, 10*time.Millisecond, "the subscriber is not pulling")
	proxy.Freeze()
	seq := b.publish(conv, id, "")
	require.Eventually(b.t, func() bool {
		info, err := b.tryConsumerInfo(durable)
		return err == nil && info.Delivered.Stream >= seq
	}, 10*time.Second, 10*time.Millisecond, "%s was never delivered", id)
	proxy.ResetAll()
	proxy.Unfreeze()
	require.Eventually(b.t, func() bool { return sc.IsConnected() && sc.Stats().Reconnects > reconnects },
		10*time.Second, 10*time.Millisecond, "the subscriber did not reconnect")
	return seq
}

// failPoison is a Handler that fails for the outcome "poison" and accepts every other.
func failPoison(_ context.Context, o wire.Outcome) error {
	if o.Event.MessageID == "poison" {
		return errors.New("this outcome fails for now")
	}
	return nil
}

// logOnFailure has the test print what the subscribers logged, if it fails.
func (b *subBundle) logOnFailure() {
	b.t.Cleanup(func() {
		if b.t.Failed() {
			b.t.Logf("subscriber logs:\n%s", b.logs.String())
		}
	})
}

// runProxied runs a subscriber on durable over a connection of its own through a proxy the
// test can freeze or cut (see loseNext), with a recorder whose Handler answers with respond,
// and the configuration as change leaves it; the subscriber's logs are printed if the test
// fails. It returns the proxy, the connection and the recorder.
func (b *subBundle) runProxied(durable string, respond func(context.Context, wire.Outcome) error,
	change func(*wire.OutcomeSubscriberConfig)) (*testsvc.Proxy, *nats.Conn, *recorder) {
	b.t.Helper()
	proxy, sc := b.proxiedConn()
	r := newRecorder(respond)
	cfg := b.config(durable, r)
	cfg.NATS = sc
	change(&cfg)
	b.logOnFailure()
	b.run(cfg)
	return proxy, sc, r
}

// runPoisoned is runProxied with failPoison for Handler (whose failures wait a minute for
// their retry, out of the way of the test), AckWait 2s and a dedupe window of 3.
func (b *subBundle) runPoisoned(durable string) (*testsvc.Proxy, *nats.Conn, *recorder) {
	b.t.Helper()
	return b.runProxied(durable, failPoison, func(cfg *wire.OutcomeSubscriberConfig) {
		cfg.AckWait = 2 * time.Second
		cfg.RetryDelay, cfg.MaxRetryDelay = time.Minute, time.Minute
		cfg.DedupeWindow = 3
	})
}

// countIDs counts how often each id was handled.
func countIDs(ids []string) map[string]int {
	n := map[string]int{}
	for _, id := range ids {
		n[id]++
	}
	return n
}

// Rule: each outcome is handled once within one Run (the dedupe window covers redeliveries),
// and acked outcomes are not delivered again. Attack: one outcome whose Handler keeps failing
// holds the durable's ack floor back while later outcomes are handled and acked. A lost
// delivery then makes the subscriber reset the durable to that ack floor: JetStream's reset
// forgets the acks above the floor (it clears the consumer's pending set and starts again at
// floor+1), so every outcome acked since the failing one is delivered again, and those older
// than the dedupe window are handled a second time. With the default window that is any
// backlog of more than 10000 outcomes handled while one conversation's outcome keeps failing.
func TestAdversaryRewindReplaysAckedOutcomesPastTheDedupeWindow(t *testing.T) {
	t.Parallel()
	b := setupSub(t, false)
	proxy, sc, r := b.runPoisoned("poison")

	b.publish("c0", "poison", "")
	require.Equal(t, "poison", r.next(t).Event.MessageID)
	var last uint64
	for i := 1; i <= 6; i++ {
		last = b.publish("c1", fmt.Sprintf("r%d", i), "")
	}
	require.Eventually(t, func() bool {
		info, err := b.tryConsumerInfo("poison")
		return err == nil && info.NumPending == 0 && info.NumAckPending == 1 && info.Delivered.Stream == last
	}, 10*time.Second, 10*time.Millisecond, "r1..r6 were not all acked")
	require.Equal(t, map[string]int{"poison": 1, "r1": 1, "r2": 1, "r3": 1, "r4": 1, "r5": 1, "r6": 1}, countIDs(r.ids()))

	b.loseNext(proxy, sc, "poison", "c1", "r7")
	b.publish("c1", "r8", "")
	require.Eventually(t, func() bool { return countIDs(r.ids())["r8"] > 0 }, 20*time.Second, 10*time.Millisecond,
		"r8 was never handled")
	require.Eventually(t, func() bool {
		info, err := b.tryConsumerInfo("poison")
		return err == nil && info.NumPending == 0 && info.NumAckPending == 1
	}, 20*time.Second, 10*time.Millisecond, "the durable did not settle")

	for id, n := range countIDs(r.ids()) {
		if id != "poison" {
			require.Equal(t, 1, n, "%s handled %d times: %v", id, n, r.ids())
		}
	}
}

// Rule: across restarts, and between processes sharing a Durable, JetStream's acks prevent
// repeats. Attack: run 1 acks r1..r5 while an earlier outcome keeps failing (the ack floor
// stays before it); run 2 with the same Durable (a restart, or a second process) loses one
// delivery in transit and resets the durable to its ack floor: JetStream delivers r1..r5 again,
// and run 2, which never saw them, hands every one of them to its Handler a second time.
func TestAdversaryRewindReplaysOutcomesAckedByAnEarlierRun(t *testing.T) {
	t.Parallel()
	b := setupSub(t, false)
	b.logOnFailure()

	r1 := newRecorder(failPoison)
	cfg := b.config("shared", r1)
	cfg.AckWait = 2 * time.Second
	cfg.RetryDelay = time.Minute // the failing outcome stays out of the way during the test
	cfg.MaxRetryDelay = time.Minute
	stop1 := b.run(cfg)
	b.publish("c0", "poison", "")
	require.Equal(t, "poison", r1.next(t).Event.MessageID)
	var last uint64
	for i := 1; i <= 5; i++ {
		last = b.publish("c1", fmt.Sprintf("r%d", i), "")
	}
	require.Eventually(t, func() bool {
		info, err := b.tryConsumerInfo("shared")
		return err == nil && info.NumPending == 0 && info.NumAckPending == 1 && info.Delivered.Stream == last
	}, 10*time.Second, 10*time.Millisecond, "r1..r5 were not all acked")
	stop1()
	require.Equal(t, []string{"poison", "r1", "r2", "r3", "r4", "r5"}, r1.ids())

	proxy, sc := b.proxiedConn()
	r2 := newRecorder(failPoison)
	cfg.Handler, cfg.NATS = r2.handle, sc
	b.run(cfg)
	b.publish("c1", "r6", "") // run 2 knows the delivery numbers from here on
	require.Equal(t, "r6", r2.next(t).Event.MessageID)
	b.loseNext(proxy, sc, "shared", "c1", "r7")
	b.publish("c1", "r8", "")
	require.Eventually(t, func() bool { return countIDs(r2.ids())["r8"] > 0 }, 20*time.Second, 10*time.Millisecond,
		"r8 was never handled")
	require.Eventually(t, func() bool {
		info, err := b.tryConsumerInfo("shared")
		return err == nil && info.NumPending == 0 && info.NumAckPending == 1
	}, 20*time.Second, 10*time.Millisecond, "the durable did not settle")
	for _, id := range r2.ids() {
		require.NotContains(t, []string{"r1", "r2", "r3", "r4", "r5"}, id,
			"run 2 handled %s, acked by run 1: run 1 handled %v, run 2 %v", id, r1.ids(), r2.ids())
	}
}

// Rule: a conversation's outcomes are handled in stream order, also when deliveries are lost
// in transit. Attack: the delivery lost is the first one this Run receives (the link breaks
// under the very first pull request that gets anything: a subscriber started into a backlog on a
// flaky link, or right after a restart). A count of deliveries that starts unknown never
// compares the first delivery after the reconnect with anything: r2 would be handled at once
// and r1 only after AckWait.
func TestAdversaryKeepsOrderWhenTheFirstDeliveryOfARunIsLost(t *testing.T) {
	t.Parallel()
	b := setupSub(t, false)
	proxy, sc, r := b.runProxied("first", nil, func(cfg *wire.OutcomeSubscriberConfig) { cfg.AckWait = 2 * time.Second })
	b.loseNext(proxy, sc, "first", "c1", "r1")
	last := b.publish("c1", "r2", "")
	b.waitAcked("first", last)
	require.Equal(t, []string{"r1", "r2"}, r.ids(), "handled out of stream order")
}

// setupDeniedReset starts a NATS server with two users: "admin", allowed everything, whose
// connection is the bundle's, and "sub", allowed everything but $JS.API.CONSUMER.RESET, for
// the subscriber, connected through a proxy.
func setupDeniedReset(t *testing.T) (*subBundle, *testsvc.Proxy, *nats.Conn) {
	t.Helper()
	srv, err := server.NewServer(&server.Options{
		Host: "127.0.0.1", Port: -1, JetStream: true, StoreDir: t.TempDir(), NoSigs: true, NoLog: true,
		Users: []*server.User{
			{Username: "admin", Password: "pw"},
			{Username: "sub", Password: "pw", Permissions: &server.Permissions{
				Publish: &server.SubjectPermission{Allow: []string{">"}, Deny: []string{"$JS.API.CONSUMER.RESET.>"}},
			}},
		},
	})
	require.NoError(t, err)
	go srv.Start()
	t.Cleanup(func() {
		srv.Shutdown()
		srv.WaitForShutdown()
	})
	require.True(t, srv.ReadyForConnections(30*time.Second))
	addr := fmt.Sprintf("127.0.0.1:%d", srv.Addr().(*net.TCPAddr).Port)
	b := newSubBundle(t, "nats://admin:pw@"+addr)
	b.createStream()
	proxy := testsvc.StartProxy(t, addr)
	sc, err := nats.Connect("nats://sub:pw@"+proxy.Addr(), nats.MaxReconnects(-1), nats.ReconnectWait(50*time.Millisecond))
	require.NoError(t, err)
	t.Cleanup(sc.Close)
	return b, proxy, sc
}

// Rule: Run returns an error when the connection closes for good. Attack: the connection is
// closed while the subscriber sits in rewind's fallback (the reset refused, here for lack of
// permission), waiting AckWait for the lost deliveries to time out. A wait that watches ctx
// only, not the connection's status, keeps Run going for the rest of AckWait (default 30s; here
// 20s) before it notices: a subscriber that looks alive with a dead connection.
func TestAdversaryEndsPromptlyWhenTheConnectionClosesDuringTheFallbackWait(t *testing.T) {
	t.Parallel()
	b, proxy, sc := setupDeniedReset(t)
	r := newRecorder(nil)
	cfg := b.config("denied", r)
	cfg.NATS = sc
	cfg.AckWait = 20 * time.Second
	b.logOnFailure()
	done := b.start(cfg)

	b.publish("c1", "r1", "")
	require.Equal(t, "r1", r.next(t).Event.MessageID)
	b.loseNext(proxy, sc, "denied", "c1", "r2")
	b.publish("c1", "r3", "")
	require.Eventually(t, func() bool { return strings.Contains(b.logs.String(), "waiting for their redelivery") },
		20*time.Second, 10*time.Millisecond, "the subscriber never fell back to waiting")

	sc.Close()
	select {
	case err := <-done:
		require.ErrorIs(t, err, nats.ErrConnectionClosed)
	case <-time.After(5 * time.Second):
		t.Fatal("Run still running 5s after its connection closed for good (it waits out AckWait first)")
	}
}

// Rule: stream order per conversation, and nothing lost. Attack: a link with a round trip over
// about a second (700ms each way here: a subscriber in another region, or a congested link).
// Each pull request is a Fetch whose context ends its expiry after it was sent (30s, here 6s),
// and the server's a tenth less (at most 1s less) after it received it, so the server goes on
// delivering for about a round trip less that after the client closed the request's inbox. Whatever it sent then is dropped by
// the client: unless that counts as an interruption, the next request's gap is not taken for
// lost deliveries, the outcomes after them are handled first, and the dropped ones come back
// only after AckWait.
func TestAdversaryKeepsOrderOnASlowLinkAcrossPullExpiry(t *testing.T) {
	t.Parallel()
	b := setupSub(t, false)
	proxy, sc := b.proxiedConn()
	r := newRecorder(nil)
	cfg := b.config("slowlink", r)
	cfg.NATS = sc
	cfg.AckWait = 5 * time.Second
	t.Cleanup(func() {
		if t.Failed() {
			t.Logf("subscriber logs:\n%s", b.logs.Tail(4000))
		}
	})
	// The durable caps pull requests at 6s, and the subscriber keeps within it: the run
	// crosses two requests' expiries in 12s instead of one in the default 30s.
	_, err := b.js.CreateConsumer(b.ctx(), b.stream, jetstream.ConsumerConfig{
		Durable:           "slowlink",
		FilterSubject:     wire.StreamFilter(b.prefix, wire.KindOutcomes),
		AckPolicy:         jetstream.AckExplicitPolicy,
		AckWait:           cfg.AckWait,
		MaxDeliver:        -1,
		MaxRequestExpires: 6 * time.Second,
	})
	require.NoError(t, err)
	proxy.SetLatency(700 * time.Millisecond)
	b.run(cfg)
	require.Eventually(t, func() bool {
		info, err := b.tryConsumerInfo("slowlink")
		return err == nil && info.NumWaiting > 0
	}, 10*time.Second, 10*time.Millisecond, "the subscriber is not pulling")

	// One outcome every 100ms across the requests' expiries (6s after each was sent).
	var last uint64
	var want []string
	tick := time.NewTicker(100 * time.Millisecond)
	defer tick.Stop()
	for i := range 130 {
		<-tick.C
		id := fmt.Sprintf("r%03d", i)
		want = append(want, id)
		last = b.publish("c1", id, "")
	}
	require.Eventually(t, func() bool {
		info, err := b.tryConsumerInfo("slowlink")
		return err == nil && info.NumPending == 0 && info.NumAckPending == 0 && info.AckFloor.Stream == last
	}, time.Minute, 50*time.Millisecond, "not all acked")
	require.Equal(t, want, r.ids(), "handled out of stream order (or twice)")
}

// Rule: Run handles outcomes, or returns an error when it cannot set up the consumer. Attack:
// an existing durable made by another tool or an older configuration with MaxRequestBatch
// below the puller's fixed 500 (also MaxRequestExpires below 29s does this). Run accepts it
// (only the filter is checked); pull requests larger than the durable allows are refused with
// a 409, so nothing would ever be handled.
func TestAdversaryHandlesOutcomesOfADurableWithASmallMaxRequestBatch(t *testing.T) {
	t.Parallel()
	b := setupSub(t, false)
	_, err := b.js.CreateConsumer(b.ctx(), b.stream, jetstream.ConsumerConfig{
		Durable:         "smallbatch",
		FilterSubject:   wire.StreamFilter(b.prefix, wire.KindOutcomes),
		AckPolicy:       jetstream.AckExplicitPolicy,
		MaxDeliver:      -1,
		MaxRequestBatch: 100,
	})
	require.NoError(t, err)
	r := newRecorder(nil)
	done := b.start(b.config("smallbatch", r))
	b.publish("c1", "r1", "")
	select {
	case o := <-r.called:
		require.Equal(t, "r1", o.Event.MessageID)
	case err := <-done:
		require.Error(t, err) // refusing the durable with a reason is fine too
	case <-time.After(15 * time.Second):
		t.Fatalf("r1 not handled within 15s and Run still running; the subscriber logged:\n%s", b.logs.Tail(600))
	}
}
