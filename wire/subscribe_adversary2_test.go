package wire_test

import (
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/batonhq/baton/wire"
)

// Second round of attacks on the outcome subscriber's puller, on c65f1b2 (the reset guarded by
// the count of outcomes acked above the ack floor).

// Rule: deliveries lost in transit do not get overtaken; the subscriber rewinds the durable by
// a consumer reset, used when it delivers again nothing this Run could not skip. Attack: a
// durable restricted to one conversation (ConversationID) on a stream where other
// conversations' outcomes are stored in between, the relay's ordinary traffic. The guard
// counts every stream sequence between the ack floor and the last delivered one that is not
// pending as "acked above the floor", the other conversations' too, which this durable never
// delivers: it refuses the reset although the reset would deliver again only the lost outcome
// and those after it, and falls back to waiting out AckWait (here 2 minutes; default 30s) with
// nothing handled, after which a new outcome may overtake the lost one. The same
// overestimate follows from stream messages deleted or discarded (max_msgs) above the floor.
func TestAdversary2FilteredDurableRewindsByResetAcrossOtherConversations(t *testing.T) {
	t.Parallel()
	b := setupSub(t, false)
	proxy, sc, r := b.runProxied("onlyc1", nil, func(cfg *wire.OutcomeSubscriberConfig) {
		cfg.ConversationID = "c1"
		cfg.AckWait = 2 * time.Minute
	})

	b.publish("c1", "r1", "")
	require.Equal(t, "r1", r.next(t).Event.MessageID)
	for _, id := range []string{"x1", "x2", "x3"} {
		b.publish("c2", id, "") // another conversation's: never delivered to this durable
	}
	b.loseNext(proxy, sc, "onlyc1", "c1", "r2")
	b.publish("c1", "r3", "")
	require.Eventually(t, func() bool { return len(r.ids()) >= 3 }, 20*time.Second, 10*time.Millisecond,
		"r2 and r3 not handled within 20s of the lost delivery (the subscriber waits out AckWait instead of resetting); handled: %v", r.ids())
	require.Equal(t, []string{"r1", "r2", "r3"}, r.ids())
	require.False(t, strings.Contains(b.logs.String(), "waiting for their redelivery"), "fell back to waiting")
}

// Rule: within one Run an outcome reaches Handler once while its id is in the dedupe window,
// and a rewind delivers again only what this Run can skip: the puller's record of acked
// stream sequences ("every one of them is still in seen or was terminated") is what the reset
// guard counts on. Attack: that record also takes the stream sequences of duplicates it acked
// without a Handler call (a relay replay stored again under a new Nats-Msg-Id), and it moves
// on with every ack while the dedupe window moves on only with Handler calls, so a duplicate's
// sequence stays in the record after its id left the window. A reset then delivers the
// duplicate again and Handler is called for an outcome it handled already, one that would
// never have reached Handler without the rewind.
func TestAdversary2RewindHandsAReplayedDuplicateToTheHandler(t *testing.T) {
	t.Parallel()
	b := setupSub(t, false)
	proxy, sc, r := b.runPoisoned("replay")

	for _, id := range []string{"a", "x", "y"} {
		b.publish("c1", id, "")
		require.Equal(t, id, r.next(t).Event.MessageID)
	}
	b.publish("c0", "poison", "") // holds the ack floor from here on
	require.Equal(t, "poison", r.next(t).Event.MessageID)
	replay := b.publish("c1", "a", "replayed:"+wire.OutcomeMsgID("a")) // a is in the window: skipped
	b.publish("c1", "d", "")                                           // a leaves the window
	require.Equal(t, "d", r.next(t).Event.MessageID)
	require.Eventually(t, func() bool {
		info, err := b.tryConsumerInfo("replay")
		return err == nil && info.NumPending == 0 && info.NumAckPending == 1 && info.Delivered.Stream > replay
	}, 10*time.Second, 10*time.Millisecond, "the replay and d were not acked")
	require.Equal(t, []string{"a", "x", "y", "poison", "d"}, r.ids())

	b.loseNext(proxy, sc, "replay", "c1", "e")
	b.publish("c1", "f", "")
	require.Eventually(t, func() bool { return countIDs(r.ids())["f"] > 0 }, 20*time.Second, 10*time.Millisecond,
		"f was never handled")
	require.Eventually(t, func() bool {
		info, err := b.tryConsumerInfo("replay")
		return err == nil && info.NumPending == 0 && info.NumAckPending == 1
	}, 20*time.Second, 10*time.Millisecond, "the durable did not settle")
	require.Equal(t, 1, countIDs(r.ids())["a"], "a handled again after the rewind: %v", r.ids())
}

// Rule: an outcome whose Handler failed is delivered again after RetryDelay, doubled for each
// further failed delivery up to MaxRetryDelay (Outcome.Delivery counts its deliveries).
// Attack: a delivery lost in transit while one outcome keeps failing (a downstream outage:
// the same moments that drop links). The consumer reset that rewinds the durable forgets the
// failed outcome's nak delay and its delivery count: it is handed to Handler again at once,
// with Delivery 1, so every rewind retries it without its delay and starts the doubling over.
func TestAdversary2RewindKeepsAFailedOutcomesRetryDelay(t *testing.T) {
	t.Parallel()
	b := setupSub(t, false)
	proxy, sc, r := b.runProxied("backoff", failPoison, func(cfg *wire.OutcomeSubscriberConfig) {
		cfg.AckWait = 2 * time.Second
		cfg.RetryDelay, cfg.MaxRetryDelay = time.Minute, time.Hour
	})

	b.publish("c0", "poison", "")
	require.Equal(t, "poison", r.next(t).Event.MessageID)
	b.publish("c1", "r1", "")
	require.Equal(t, "r1", r.next(t).Event.MessageID)
	b.loseNext(proxy, sc, "backoff", "c1", "r2")
	b.publish("c1", "r3", "")
	require.Eventually(t, func() bool { return countIDs(r.ids())["r3"] > 0 }, 20*time.Second, 10*time.Millisecond,
		"r3 was never handled")
	var poison []wire.Outcome
	r.mu.Lock()
	for _, o := range r.calls {
		if o.Event.MessageID == "poison" {
			poison = append(poison, o)
		}
	}
	r.mu.Unlock()
	for i, o := range poison[1:] {
		require.Greater(t, o.Delivery, uint64(i+1), "poison's delivery count started over: %v", r.ids())
	}
	require.Len(t, poison, 1, "poison handed to Handler again within its 1m RetryDelay: %v", r.ids())
}

// Rule: deliveries lost in transit are rewound by a consumer reset where the server offers
// it; only where the reset is refused (an older server, no permission) does the subscriber
// wait out AckWait. Attack: a slow link (1.3s each way) on which the consumer info and the
// reset requests together take longer than the 5s the subscriber gives them. The server does
// reset the durable, but its answer comes late; the subscriber takes the timeout for a
// refusal, waits out AckWait (here 2 minutes; default 30s) with nothing handled although the
// lost outcome is already waiting for it, and asks for no reset for the next 10 minutes.
func TestAdversary2AResetWhoseAnswerIsLateIsNotARefusal(t *testing.T) {
	t.Parallel()
	b := setupSub(t, false)
	proxy, sc, r := b.runProxied("late", nil, func(cfg *wire.OutcomeSubscriberConfig) { cfg.AckWait = 2 * time.Minute })
	b.publish("c1", "r1", "")
	require.Equal(t, "r1", r.next(t).Event.MessageID)
	b.loseNext(proxy, sc, "late", "c1", "r2")
	proxy.SetLatency(1300 * time.Millisecond)
	b.publish("c1", "r3", "")
	if !assert.Eventually(t, func() bool { return len(r.ids()) >= 3 }, 30*time.Second, 10*time.Millisecond,
		"r2 and r3 not handled within 30s of the lost delivery; handled: %v", r.ids()) {
		info := b.consumerInfo("late")
		t.Fatalf("the durable: delivered %+v, ack floor %+v, pending %d, ack pending %d (a reset leaves both unacked outcomes pending, none ack pending)",
			info.Delivered, info.AckFloor, info.NumPending, info.NumAckPending)
	}
	require.Equal(t, []string{"r1", "r2", "r3"}, r.ids())
}
