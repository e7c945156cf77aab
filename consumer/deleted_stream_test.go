package consumer_test

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/stretchr/testify/require"

	"github.com/batonhq/baton/consumer"
	"github.com/batonhq/baton/internal/testsvc"
)

// TestTurnEventsResumeAfterStreamDeleted deletes the turns stream under a running worker, as
// an operator might; the relay creates it again at its next publish. The worker creates its
// durable consumer again and takes the events of the new stream: with a sweep that never
// runs during the test, only events can answer the messages sent afterwards. An operator
// deleting the durable consumer alone is handled the same way.
func TestTurnEventsResumeAfterStreamDeleted(t *testing.T) {
	t.Parallel()
	b := setup(t, jetStream)
	b.worker(consumer.Config{SweepInterval: time.Hour})
	b.conversation("c")
	js, err := jetstream.New(b.nc)
	require.NoError(t, err)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	answered, n := b.answerer("c")
	answered()

	require.NoError(t, js.DeleteStream(ctx, "AGENT_TURNS"))
	// The relay's next publish finds no stream and creates it again; the worker must follow.
	answered()
	answered()

	require.NoError(t, js.DeleteConsumer(ctx, "AGENT_TURNS", consumer.DefaultDurable))
	answered()
	require.Equal(t, []int{*n}, testsvc.Query[int](t, b.db, `SELECT count(*)::int FROM agent_outbox WHERE status = 'done'`))
}

// TestTurnEventsResumeWhenDeletionWentUnseen deletes the turns stream while the worker's
// connection to NATS is down, so the worker never gets the server's "consumer deleted"
// notice: when it reconnects, its pull requests find no consumer ("no responders"), which
// nats.go reports without stopping. The worker checks its consumer on such errors and
// creates it again on the new stream.
func TestTurnEventsResumeWhenDeletionWentUnseen(t *testing.T) {
	t.Parallel()
	b := setup(t, jetStream)
	proxy := testsvc.StartProxy(t, strings.TrimPrefix(b.nc.ConnectedUrl(), "nats://"))
	wnc, err := nats.Connect("nats://"+proxy.Addr(), nats.MaxReconnects(-1), nats.ReconnectWait(50*time.Millisecond))
	require.NoError(t, err)
	t.Cleanup(wnc.Close)
	b.worker(consumer.Config{NATS: wnc, SweepInterval: time.Hour})
	b.conversation("c")
	js, err := jetstream.New(b.nc)
	require.NoError(t, err)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	answered, _ := b.answerer("c")
	answered()

	proxy.Freeze() // the notice of the deletion is held back, then dropped with the connection
	require.NoError(t, js.DeleteStream(ctx, "AGENT_TURNS"))
	proxy.ResetAll()
	proxy.Unfreeze()
	answered()
	answered()
}

// answerer returns a function that sends conversation conv its next message (m1, m2, …) and
// waits until every row is answered, and the count of messages it sent.
func (b *bundle) answerer(conv string) (answered func(), n *int) {
	n = new(int)
	return func() {
		b.t.Helper()
		*n++
		b.send(conv, fmt.Sprintf("m%d", *n), "hi")
		b.waitTerminal(30 * time.Second)
	}, n
}
