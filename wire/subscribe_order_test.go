package wire_test

import (
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/stretchr/testify/require"

	"github.com/batonhq/baton/internal/testsvc"
)

// Rule: one subscriber process hands a conversation's outcomes to its handler in stream order,
// also when its connection drops with deliveries in flight. JetStream counts those deliveries
// as made and delivers them again only after AckWait, while the reconnected subscriber's next
// pull already gets the outcomes stored after them: handled at once, they would overtake the
// lost ones (the chaos run found this with a connection reset while the subscriber's link was
// frozen, seed 5705147116635107).
func TestOutcomeSubscriberKeepsOrderWhenDeliveriesAreLost(t *testing.T) {
	t.Parallel()
	b := setupSub(t, false)
	proxy := testsvc.StartProxy(t, b.nc.ConnectedAddr())
	sc, err := nats.Connect("nats://"+proxy.Addr(), nats.MaxReconnects(-1), nats.ReconnectWait(50*time.Millisecond))
	require.NoError(t, err)
	t.Cleanup(sc.Close)

	r := newRecorder(nil)
	cfg := b.config("order", r)
	cfg.NATS = sc
	cfg.AckWait = time.Second
	b.run(cfg)
	b.publish("c1", "r1", "")
	require.Equal(t, "r1", r.next(t).Event.MessageID)

	// r2 is delivered into a frozen link, and lost with it.
	proxy.Freeze()
	b.publish("c1", "r2", "")
	require.Eventually(t, func() bool {
		info, err := b.tryConsumerInfo("order")
		return err == nil && info.Delivered.Stream == 2
	}, 10*time.Second, 10*time.Millisecond, "r2 was never delivered")
	proxy.ResetAll()
	proxy.Unfreeze()
	require.Eventually(t, func() bool { return sc.IsConnected() && sc.Stats().Reconnects > 0 }, 10*time.Second, 10*time.Millisecond)
	last := b.publish("c1", "r3", "")

	b.waitAcked("order", last)
	require.Equal(t, []string{"r1", "r2", "r3"}, r.ids(), "handled out of stream order; the subscriber logged:\n%s", b.logs.String())
}
