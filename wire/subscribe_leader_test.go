package wire_test

import (
	"context"
	"encoding/json"
	"fmt"
	"net"
	"net/url"
	"slices"
	"testing"
	"time"

	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/stretchr/testify/require"

	"github.com/batonhq/baton/internal/testsvc"
	"github.com/batonhq/baton/wire"
)

// Rule: one subscriber process hands a conversation's outcomes to its handler in stream order,
// also when deliveries are lost in a JetStream cluster because the consumer's leader changed
// while the subscriber's connection stayed up. The old leader delivered r2 into a route that
// never carried it; the new leader learnt through Raft that r2 was delivered, tells the
// subscriber "409 Leadership Change", and answers its next pull with r3 at once, while r2
// waits out AckWait (the end-to-end cluster test printed an outcome after a later one of the
// same conversation).
func TestOutcomeSubscriberKeepsOrderWhenTheConsumerLeaderChanges(t *testing.T) {
	t.Parallel()
	cl := startRoutedCluster(t)
	a, b, c := cl.nodes[0], cl.nodes[1], cl.nodes[2] // the subscriber's node, the first leader, the next

	bd := newSubBundle(t, c.url()) // the test's own connection: stream, durable, publishing, consumer info
	nc, js, prefix := bd.nc, bd.js, bd.prefix
	var err error
	// Retried: a cluster that just elected its meta leader may not count every peer yet ("no
	// suitable peers for placement").
	require.Eventually(t, func() bool {
		_, err = js.CreateStream(bd.ctx(), jetstream.StreamConfig{
			Name:     bd.stream,
			Subjects: []string{wire.StreamFilter(prefix, wire.KindOutcomes)},
			Storage:  jetstream.FileStorage,
			Replicas: 3,
		})
		return err == nil
	}, 30*time.Second, 100*time.Millisecond, "create the R3 stream")
	// The stream is led by C throughout, so freezing A<->B leaves publishing alone.
	cl.moveLeader(t, nc, "$JS.API.STREAM.LEADER.STEPDOWN."+bd.stream, c.name, func() (string, error) {
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
		defer cancel()
		st, err := js.Stream(ctx, bd.stream)
		if err != nil || st.CachedInfo().Cluster == nil {
			return "", err
		}
		return st.CachedInfo().Cluster.Leader, nil
	})

	// The durable as the subscriber creates it, made beforehand so that its leader is B before
	// the subscriber's first pull.
	const ackWait = 15 * time.Second // r3 must come well within it
	_, err = js.CreateConsumer(bd.ctx(), bd.stream, jetstream.ConsumerConfig{
		Durable:       "leader",
		FilterSubject: wire.StreamFilter(prefix, wire.KindOutcomes),
		AckPolicy:     jetstream.AckExplicitPolicy,
		AckWait:       ackWait,
		MaxDeliver:    -1,
		DeliverPolicy: jetstream.DeliverAllPolicy,
	})
	require.NoError(t, err)
	cl.moveLeader(t, nc, "$JS.API.CONSUMER.LEADER.STEPDOWN."+bd.stream+".leader", b.name, func() (string, error) {
		info, err := bd.tryConsumerInfo("leader")
		if err != nil || info.Cluster == nil {
			return "", err
		}
		for _, r := range info.Cluster.Replicas {
			if !r.Current {
				return "", nil // all replicas current: C must be able to take over
			}
		}
		return info.Cluster.Leader, nil
	})

	// The subscriber is connected to A only.
	sc, err := nats.Connect(a.url())
	require.NoError(t, err)
	t.Cleanup(sc.Close)
	r := newRecorder(nil)
	cfg := bd.config("leader", r)
	cfg.NATS = sc
	cfg.AckWait = ackWait
	bd.logOnFailure()
	bd.run(cfg)
	bd.publish("c1", "r1", "")
	require.Equal(t, "r1", r.next(t).Event.MessageID)
	bd.waitAcked("leader", 1)

	// B delivers r2 into its frozen route to A ...
	cl.freeze(a, b)
	bd.publish("c1", "r2", "")
	require.Eventually(t, func() bool {
		info, err := bd.tryConsumerInfo("leader")
		return err == nil && info.Delivered.Stream == 2
	}, 10*time.Second, 10*time.Millisecond, "r2 was never delivered")
	// ... and hands the durable over to C, which knows through Raft that r2 was delivered; the
	// route between A and B drops what it held back, r2 among it.
	cl.moveLeader(t, nc, "$JS.API.CONSUMER.LEADER.STEPDOWN."+bd.stream+".leader", c.name, func() (string, error) {
		info, err := quickConsumerInfo(js, bd.stream, "leader")
		if err != nil || info.Cluster == nil {
			return "", err
		}
		return info.Cluster.Leader, nil
	})
	cl.reset(a, b)
	info, err := quickConsumerInfo(js, bd.stream, "leader")
	require.NoError(t, err)
	require.Equal(t, c.name, info.Cluster.Leader)
	require.Equal(t, uint64(2), info.Delivered.Stream, "C does not know r2 was delivered")
	require.Equal(t, 1, info.NumAckPending, "r2 is not pending at C")
	cl.unfreeze(a, b)
	bd.publish("c1", "r3", "")

	require.Eventually(t, func() bool {
		ids := r.ids()
		return slices.Contains(ids, "r2") && slices.Contains(ids, "r3")
	}, 3*ackWait, 10*time.Millisecond, "r2 and r3 were not both handled")
	require.Zero(t, sc.Stats().Reconnects, "the subscriber's connection was to stay up")
	require.Equal(t, []string{"r1", "r2", "r3"}, r.ids(), "handled out of stream order")
}

// routedCluster is a 3-node JetStream cluster whose routes all pass through TCP proxies, one per
// pair of nodes, so that a test can freeze the link between two nodes only.
type routedCluster struct {
	nodes   []*routedNode
	proxies map[[2]int]*testsvc.Proxy // [to, from], to started before from: from's route to to
}

// proxy returns the proxy between x and y.
func (cl *routedCluster) proxy(x, y *routedNode) *testsvc.Proxy {
	return cl.proxies[[2]int{min(x.idx, y.idx), max(x.idx, y.idx)}]
}

type routedNode struct {
	idx  int
	name string
	port int
	srv  *server.Server
}

func (n *routedNode) url() string { return fmt.Sprintf("nats://127.0.0.1:%d", n.port) }

// stop shuts the node down and waits until it is gone.
func (n *routedNode) stop() {
	n.srv.Shutdown()
	n.srv.WaitForShutdown()
}

// startRoutedCluster starts the cluster and waits for its JetStream meta leader. Every node
// advertises a route address that refuses routes (its own is reached through the proxies
// only), so no node connects to another behind the proxies' back.
func startRoutedCluster(t *testing.T) *routedCluster {
	t.Helper()
	// Held for the whole test: a route dialled there is accepted and closed at once.
	var lc net.ListenConfig
	nowhere, err := lc.Listen(t.Context(), "tcp", "127.0.0.1:0")
	require.NoError(t, err)
	t.Cleanup(func() { _ = nowhere.Close() })
	go func() {
		for {
			conn, err := nowhere.Accept()
			if err != nil {
				return
			}
			_ = conn.Close()
		}
	}()

	// The nodes bind free ports themselves and start one after another, each routed to the
	// ones before it through a proxy to that one's route port: one route, so one proxy, per
	// pair of nodes. (Ports chosen first and bound later could be given to a proxy meanwhile.)
	// JetStream in a cluster refuses to start without a route configured: the first node's is
	// to nowhere.
	const n = 3
	cl := &routedCluster{proxies: map[[2]int]*testsvc.Proxy{}}
	for i := range n {
		node := &routedNode{idx: i, name: fmt.Sprintf("leader-n%d", i)}
		var routes []*url.URL
		for _, prev := range cl.nodes {
			p := testsvc.StartProxy(t, fmt.Sprintf("127.0.0.1:%d", prev.srv.ClusterAddr().Port))
			cl.proxies[[2]int{prev.idx, i}] = p
			routes = append(routes, &url.URL{Scheme: "nats", Host: p.Addr()})
		}
		if len(routes) == 0 {
			routes = []*url.URL{{Scheme: "nats", Host: nowhere.Addr().String()}}
		}
		srv, err := server.NewServer(&server.Options{
			ServerName:   node.name,
			Host:         "127.0.0.1",
			Port:         -1, // any free port
			JetStream:    true,
			StoreDir:     t.TempDir(),
			SyncAlways:   true,
			SyncInterval: 2 * time.Minute,
			Cluster: server.ClusterOpts{
				Name:      "leader-test",
				Host:      "127.0.0.1",
				Port:      -1,
				Advertise: nowhere.Addr().String(),
			},
			Routes: routes,
			NoSigs: true,
			NoLog:  true,
		})
		require.NoError(t, err)
		go srv.Start()
		require.True(t, srv.ReadyForConnections(30*time.Second), "%s not ready", node.name)
		node.srv, node.port = srv, srv.Addr().(*net.TCPAddr).Port
		t.Cleanup(node.stop)
		cl.nodes = append(cl.nodes, node)
	}
	require.Eventually(t, func() bool {
		leaders := 0
		for _, node := range cl.nodes {
			if node.srv.JetStreamIsLeader() {
				leaders++
			}
			if !node.srv.JetStreamIsCurrent() || node.srv.NumRoutes() == 0 {
				return false
			}
		}
		return leaders == 1
	}, time.Minute, 50*time.Millisecond, "no JetStream meta leader")
	return cl
}

// freeze stops the routes between x and y, both ways, without closing them.
func (cl *routedCluster) freeze(x, y *routedNode) {
	cl.proxy(x, y).Freeze()
}

// reset closes the routes between x and y, dropping what freeze held back.
func (cl *routedCluster) reset(x, y *routedNode) {
	cl.proxy(x, y).ResetAll()
}

// unfreeze undoes freeze.
func (cl *routedCluster) unfreeze(x, y *routedNode) {
	cl.proxy(x, y).Unfreeze()
}

// moveLeader asks, through the stepdown API subject, for the leadership to move to the node
// named want until leader (which returns "" while it cannot tell) reports it there.
func (cl *routedCluster) moveLeader(t *testing.T, nc *nats.Conn, subject, want string, leader func() (string, error)) {
	t.Helper()
	req, err := json.Marshal(map[string]any{"placement": map[string]string{"preferred": want}})
	require.NoError(t, err)
	deadline := time.Now().Add(time.Minute)
	for {
		got, err := leader()
		if err == nil && got == want {
			return
		}
		require.True(t, time.Now().Before(deadline), "leadership did not move to %s (at %q, %v)", want, got, err)
		if err == nil && got != "" {
			if _, err := nc.Request(subject, req, 5*time.Second); err != nil {
				t.Logf("stepdown %s: %v", subject, err)
			}
		}
		time.Sleep(100 * time.Millisecond)
	}
}

// quickConsumerInfo is tryConsumerInfo with a short bound: a request lost in an election is
// never answered.
func quickConsumerInfo(js jetstream.JetStream, stream, durable string) (*jetstream.ConsumerInfo, error) {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	c, err := js.Consumer(ctx, stream, durable)
	if err != nil {
		return nil, err
	}
	return c.Info(ctx)
}
