package testsvc

import (
	"context"
	"fmt"
	"net"
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

// A node started again is back on the ports it bound first, also when another listener was
// given one of them while the node was down (as a test's proxy listening on port 0 can be):
// Start tries again until the port is free, and the node rejoins the cluster.
func TestClusterNodeStartedAgainWaitsForItsPort(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(t.Context(), 2*time.Minute)
	defer cancel()
	c := StartCluster(t, 3)
	ports := map[int]bool{}
	for _, n := range c.Nodes {
		for _, p := range []int{n.Port, n.ClusterPort} {
			require.Positive(t, p, "%s: the ports it bound", n.Name)
			require.False(t, ports[p], "%s: port %d twice", n.Name, p)
			ports[p] = true
		}
		// Every node knows every other's route port, for when it starts again.
		var want, got []string
		for _, other := range c.Nodes {
			if other != n {
				want = append(want, fmt.Sprintf("127.0.0.1:%d", other.ClusterPort))
			}
		}
		for _, r := range n.routes {
			got = append(got, r.Host)
		}
		require.Equal(t, want, got, "%s: routes", n.Name)
	}

	// Node 0 started with no routes; started again, it routes to the others itself.
	node := c.Nodes[0]
	port, clusterPort := node.Port, node.ClusterPort
	node.Stop()
	requireStartWaitsForPort(ctx, t, clusterPort, node.Start)
	require.Equal(t, port, node.Port)
	require.Equal(t, clusterPort, node.ClusterPort)
	srv := node.server()
	require.Equal(t, port, srv.Addr().(*net.TCPAddr).Port, "client port it listens on")
	require.Equal(t, clusterPort, srv.ClusterAddr().Port, "route port it listens on")
	require.NoError(t, c.AwaitMetaLeader(ctx))
	require.True(t, srv.JetStreamIsCurrent(), "the node started again is in the cluster")
}
