package consumer_test

import (
	"context"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/stretchr/testify/require"

	"github.com/batonhq/baton/consumer"
)

// A NATS connection closed for good (nats.go closes it when the server refuses the login again
// on a reconnect, e.g. after a password rotation; or its owner closes it) ends Run with an
// error, so the program exits and its supervisor restarts it. Before, the worker stayed up,
// answering only what its sweep found, once per SweepInterval.
func TestRunEndsWhenItsNATSConnectionCloses(t *testing.T) {
	t.Parallel()
	b := setup(t, jetStream)
	nc, err := nats.Connect(b.nc.ConnectedUrl())
	require.NoError(t, err)
	t.Cleanup(nc.Close)
	w, err := consumer.New(consumer.Config{Pool: b.workers, NATS: nc, Handler: echo, Logger: testLogger(t)})
	require.NoError(t, err)
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(cancel)
	done := make(chan error, 1)
	go func() { done <- w.Run(ctx) }()
	b.conversation("c")
	b.send("c", "m1", "hi")
	b.waitTerminal(30 * time.Second) // consuming

	nc.Close()
	select {
	case err := <-done:
		require.ErrorIs(t, err, nats.ErrConnectionClosed)
	case <-time.After(30 * time.Second):
		t.Fatal("Run still running 30s after its NATS connection closed for good")
	}
}
