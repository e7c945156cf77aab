package testsvc

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/stretchr/testify/require"
)

// A replicated stream keeps every acknowledged message through the loss of its leader and a
// restart of that node, and a client given every node's URL follows the cluster.
func TestClusterSurvivesTheLossOfTheStreamLeader(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(t.Context(), 90*time.Second)
	defer cancel()
	c := StartCluster(t, 3)
	nc, err := nats.Connect(c.URLs(), nats.MaxReconnects(-1), nats.ReconnectWait(100*time.Millisecond))
	require.NoError(t, err)
	t.Cleanup(nc.Close)
	js, err := jetstream.New(nc)
	require.NoError(t, err)

	_, err = js.CreateStream(ctx, jetstream.StreamConfig{Name: "R3", Subjects: []string{"r3.>"}, Replicas: 3,
		Storage: jetstream.FileStorage})
	require.NoError(t, err)
	leader, err := c.AwaitStreamReplicas(ctx, js, "R3")
	require.NoError(t, err)
	for _, n := range c.Nodes {
		require.True(t, n.Running())
	}

	publish := func(from, to int) {
		t.Helper()
		for i := from; i < to; i++ {
			// Retried through the election: the same Msg-Id is stored once.
			require.Eventually(t, func() bool {
				// A request the server lost in the election is never answered: each try is bounded.
				pctx, cancel := context.WithTimeout(ctx, 2*time.Second)
				defer cancel()
				_, err := js.Publish(pctx, "r3.x", fmt.Appendf(nil, "%d", i), jetstream.WithMsgID(fmt.Sprint(i)))
				return err == nil
			}, 30*time.Second, 50*time.Millisecond, "publish %d", i)
		}
	}
	publish(0, 50)
	leader.Stop()
	require.False(t, leader.Running())
	publish(50, 100)
	next, err := c.StreamLeader(ctx, js, "R3")
	require.NoError(t, err)
	require.NotEqual(t, leader.Name, next.Name, "a running node leads")

	require.NoError(t, leader.Start())
	_, err = c.AwaitStreamReplicas(ctx, js, "R3")
	require.NoError(t, err)
	msgs := StreamMsgs(ctx, t, js, "R3")
	require.Len(t, msgs, 100)
	for i, m := range msgs {
		require.Equal(t, fmt.Sprint(i), string(m.Data))
	}
	require.Len(t, c.Nodes, 3)
	require.Equal(t, c.Nodes[0].URL()+","+c.Nodes[1].URL()+","+c.Nodes[2].URL(), c.URLs())
}
