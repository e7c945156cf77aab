package wire_test

import (
	"context"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/stretchr/testify/require"

	"github.com/batonhq/baton/wire"
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
	sub, err := wire.NewOutcomeSubscriber(cfg)
	require.NoError(t, err)
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(cancel)
	done := make(chan error, 1)
	go func() { done <- sub.Run(ctx) }()

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
