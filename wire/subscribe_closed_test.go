package wire_test

import (
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/stretchr/testify/require"
)

// A connection nats.go closes for good (a login refused again on reconnect, or the caller
// closing it) ends Run with an error, so the program exits and its supervisor restarts it,
// instead of a subscriber that looks alive and never receives anything again.
func TestOutcomeSubscriberEndsWhenItsConnectionCloses(t *testing.T) {
	t.Parallel()
	b := setupSub(t, false)
	nc, err := nats.Connect(b.nc.ConnectedUrl())
	require.NoError(t, err)
	t.Cleanup(nc.Close)
	r := newRecorder(nil)
	cfg := b.config("closing", r)
	cfg.NATS = nc
	done := b.start(cfg)

	b.publish("c1", "m1", "outcome:m1")
	require.Equal(t, "m1", r.next(t).Event.MessageID)
	nc.Close()
	select {
	case err := <-done:
		require.ErrorContains(t, err, nats.ErrConnectionClosed.Error())
	case <-time.After(30 * time.Second):
		t.Fatal("Run still running 30s after its connection closed for good")
	}
}

// A durable deleted under a running subscriber (an operator's `nats consumer rm`) ends Run
// with an error saying so, instead of a subscriber that pulls from nothing for ever.
func TestOutcomeSubscriberEndsWhenItsDurableIsDeleted(t *testing.T) {
	t.Parallel()
	b := setupSub(t, false)
	r := newRecorder(nil)
	done := b.start(b.config("gone", r))

	b.publish("c1", "m1", "outcome:m1")
	require.Equal(t, "m1", r.next(t).Event.MessageID)
	require.NoError(t, b.js.DeleteConsumer(b.ctx(), b.stream, "gone"))
	select {
	case err := <-done:
		require.ErrorIs(t, err, jetstream.ErrConsumerDeleted)
	case <-time.After(30 * time.Second):
		t.Fatal("Run still running 30s after its durable was deleted")
	}
}
