package testsvc

import (
	"context"
	"fmt"
	"net"
	"net/url"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/batonhq/baton/internal/throwaway"
)

// ClusterName is the name of the JetStream cluster StartCluster starts.
const ClusterName = "baton-test"

// Cluster is a NATS JetStream cluster of a test's own: several nats-server instances in this
// process, on 127.0.0.1, routed to one another, each with its own store directory. A node can
// be stopped and started again on the same ports with the same store, where it catches up
// with the others. Every node writes JetStream data with sync_interval: always semantics
// (server.Options.SyncAlways): a PubAck means the replicas that acknowledged it have it on
// disk.
type Cluster struct {
	// Nodes are the cluster's servers, in the order of URLs.
	Nodes []*ClusterNode
}

// ClusterNode is one server of a Cluster.
type ClusterNode struct {
	// Name is the server name: what StreamInfo.Cluster.Leader and its replicas report.
	Name string
	// Port is the client port, ClusterPort the route port: free ones the node bound when it
	// first started (0 before), the same across Stop and Start.
	Port, ClusterPort int
	// StoreDir is where the node keeps its streams and its Raft logs.
	StoreDir string

	noAdvert bool
	mu       sync.Mutex
	routes   []*url.URL     // the other nodes' route URLs, once the cluster has started
	srv      *server.Server // nil when stopped
}

// ClusterOption changes how StartCluster starts its nodes.
type ClusterOption func(*ClusterNode)

// NoAdvertise keeps the nodes from telling clients of one another (the cluster's
// no_advertise): a client reaches only the URLs it was given, so a test's proxy in front of one
// node is its only path, also across reconnects.
func NoAdvertise() ClusterOption { return func(n *ClusterNode) { n.noAdvert = true } }

// StartCluster starts a cluster of n nodes (3 for replicated streams that survive one node's
// loss) and waits until it has elected a JetStream meta leader; the cluster stops when the
// test ends. It ignores BATON_TEST_NATS_URL: a test that stops nodes needs nodes of its own.
//
// Every node binds free ports itself and reports them (no port is chosen first and bound
// later, when another listener may have been given it), so the nodes start one after another,
// each routed to the ones before it: every pair of nodes has a route, the full mesh. Once all
// run, each node is given routes to all the others, for when it starts again.
func StartCluster(t testing.TB, n int, opts ...ClusterOption) *Cluster {
	t.Helper()
	c := &Cluster{}
	for i := range n {
		node := &ClusterNode{Name: fmt.Sprintf("baton-n%d", i), StoreDir: t.TempDir()}
		for _, o := range opts {
			o(node)
		}
		c.Nodes = append(c.Nodes, node)
	}
	// Cleanups run last first: the nodes stop before the seed closes, and before their store
	// directories, made above, are removed.
	seed := routeSeed(t)
	t.Cleanup(c.StopAll)
	for i, node := range c.Nodes {
		for _, prev := range c.Nodes[:i] {
			node.routes = append(node.routes, prev.routeURL())
		}
		if i == 0 {
			node.routes = []*url.URL{seed}
		}
		if err := node.Start(); err != nil {
			t.Fatalf("start %s: %v", node.Name, err)
		}
	}
	// A node started again routes to all the others itself, whichever of them still run; the
	// first one no longer needs the seed.
	for _, node := range c.Nodes {
		var routes []*url.URL
		for _, other := range c.Nodes {
			if other != node {
				routes = append(routes, other.routeURL())
			}
		}
		node.mu.Lock()
		node.routes = routes
		node.mu.Unlock()
	}
	ctx, cancel := context.WithTimeout(t.Context(), time.Minute)
	defer cancel()
	if err := c.AwaitMetaLeader(ctx); err != nil {
		t.Fatalf("cluster: %v", err)
	}
	return c
}

// routeSeed returns the route URL of a listener that takes route connections and closes them
// at once. JetStream in a cluster refuses to start without a route configured, and the first
// node has no other node to route to yet: it is given this one, and keeps trying it while it
// runs. The listener stays until the test's end, after the nodes stop: its port, let go, could
// be given to a node of another test's cluster, of the same cluster name, which the first node
// would then join.
func routeSeed(t testing.TB) *url.URL {
	t.Helper()
	var lc net.ListenConfig
	ln, err := lc.Listen(t.Context(), "tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatalf("route seed: listen: %v", err)
	}
	var wg sync.WaitGroup
	wg.Go(func() {
		for {
			conn, err := ln.Accept()
			if err != nil {
				return // closed
			}
			_ = conn.Close()
		}
	})
	t.Cleanup(func() {
		_ = ln.Close()
		wg.Wait()
	})
	return &url.URL{Scheme: "nats", Host: ln.Addr().String()}
}

// URLs returns the client URLs of every node, comma-separated, as BATON_NATS_URL takes them.
// They stay the same across Stop and Start.
func (c *Cluster) URLs() string {
	urls := make([]string, len(c.Nodes))
	for i, n := range c.Nodes {
		urls[i] = n.URL()
	}
	return strings.Join(urls, ",")
}

// Node returns the node of that server name, or nil.
func (c *Cluster) Node(name string) *ClusterNode {
	for _, n := range c.Nodes {
		if n.Name == name {
			return n
		}
	}
	return nil
}

// StopAll stops every node that runs.
func (c *Cluster) StopAll() {
	for _, n := range c.Nodes {
		n.Stop()
	}
}

// AwaitMetaLeader waits until a running node is the JetStream meta leader (streams can be
// created and looked up) and every running node knows of it, or ctx ends.
func (c *Cluster) AwaitMetaLeader(ctx context.Context) error {
	for {
		leaders, running, current := 0, 0, 0
		for _, n := range c.Nodes {
			srv := n.server()
			if srv == nil {
				continue
			}
			running++
			if srv.JetStreamIsLeader() {
				leaders++
			}
			if srv.JetStreamIsCurrent() {
				current++
			}
		}
		if leaders == 1 && current == running {
			return nil
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("no JetStream meta leader among %d running nodes (%d current): %w", running, current, ctx.Err())
		case <-time.After(50 * time.Millisecond):
		}
	}
}

// StreamLeader returns the node that leads the stream now, as StreamInfo.Cluster reports it
// through js. It fails while the stream has no leader (an election is under way, or too few
// of its replicas run).
func (c *Cluster) StreamLeader(ctx context.Context, js jetstream.JetStream, stream string) (*ClusterNode, error) {
	st, err := js.Stream(ctx, stream)
	if err != nil {
		return nil, fmt.Errorf("look up stream %s: %w", stream, err)
	}
	info := st.CachedInfo()
	if info.Cluster == nil || info.Cluster.Leader == "" {
		return nil, fmt.Errorf("stream %s has no leader now", stream)
	}
	n := c.Node(info.Cluster.Leader)
	if n == nil {
		return nil, fmt.Errorf("stream %s is led by %s, which is not a node of this cluster", stream, info.Cluster.Leader)
	}
	return n, nil
}

// AwaitStreamReplicas waits until the stream has a leader and every other replica it is
// configured with is there and current, or ctx ends. It returns the leader.
func (c *Cluster) AwaitStreamReplicas(ctx context.Context, js jetstream.JetStream, stream string) (*ClusterNode, error) {
	for {
		// Each look-up bounded: a request a server lost in an election is never answered.
		actx, cancel := context.WithTimeout(ctx, 2*time.Second)
		leader, err := c.StreamLeader(actx, js, stream)
		if err == nil {
			st, serr := js.Stream(actx, stream)
			if serr != nil {
				err = serr
			} else if cl, want := st.CachedInfo().Cluster, st.CachedInfo().Config.Replicas; len(cl.Replicas) < want-1 {
				err = fmt.Errorf("stream %s has %d of its %d replicas besides its leader", stream, len(cl.Replicas), want-1)
			} else {
				for _, r := range cl.Replicas {
					if !r.Current || r.Offline {
						err = fmt.Errorf("replica %s of stream %s is not current", r.Name, stream)
						break
					}
				}
			}
		}
		cancel()
		if err == nil {
			return leader, nil
		}
		select {
		case <-ctx.Done():
			return nil, fmt.Errorf("%w (%w)", err, ctx.Err())
		case <-time.After(100 * time.Millisecond):
		}
	}
}

// URL returns the node's client URL.
func (n *ClusterNode) URL() string { return fmt.Sprintf("nats://127.0.0.1:%d", n.Port) }

// routeURL is the URL other nodes route to this one at.
func (n *ClusterNode) routeURL() *url.URL {
	return &url.URL{Scheme: "nats", Host: fmt.Sprintf("127.0.0.1:%d", n.ClusterPort)}
}

// Running reports whether the node runs.
func (n *ClusterNode) Running() bool { return n.server() != nil }

func (n *ClusterNode) server() *server.Server {
	n.mu.Lock()
	defer n.mu.Unlock()
	return n.srv
}

// Start starts the node on its store directory and waits until it accepts clients. The first
// time, the node binds free ports and Port and ClusterPort report them; after Stop it binds
// those again. One of them may have been given to another listener meanwhile (a test's proxy
// listening on port 0): while a port is in use, Start tries again, for up to a minute
// (throwaway.StartServer), and then fails naming the port. A node started again recovers its
// streams and catches up with the cluster's leaders.
func (n *ClusterNode) Start() error {
	n.mu.Lock()
	defer n.mu.Unlock()
	if n.srv != nil {
		return fmt.Errorf("%s already running", n.Name)
	}
	port, clusterPort := n.Port, n.ClusterPort
	if port == 0 {
		port, clusterPort = -1, -1 // the server's "any free port"; its 0 means a default port
	}
	srv, err := throwaway.StartServer(func() *server.Options {
		return &server.Options{
			ServerName: n.Name,
			Host:       "127.0.0.1",
			Port:       port,
			JetStream:  true,
			StoreDir:   n.StoreDir,
			// sync_interval: always.
			SyncAlways:   true,
			SyncInterval: 2 * time.Minute,
			Cluster: server.ClusterOpts{
				Name:        ClusterName,
				Host:        "127.0.0.1",
				Port:        clusterPort,
				NoAdvertise: n.noAdvert,
			},
			Routes: n.routes,
			NoSigs: true,
			NoLog:  true,
		}
	}, n.Port != 0)
	if err != nil {
		return fmt.Errorf("nats server %s: %w", n.Name, err)
	}
	n.srv = srv
	if n.Port == 0 { // written once: tests read them while the node restarts
		n.Port, n.ClusterPort = srv.Addr().(*net.TCPAddr).Port, srv.ClusterAddr().Port
	}
	return nil
}

// Stop shuts the node down and waits until it is gone: its clients are disconnected (and
// reconnect to another node of their URL list), the streams it led elect another leader
// among their running replicas. The store directory and the ports stay for Start. Stopping a
// stopped node does nothing.
func (n *ClusterNode) Stop() {
	n.mu.Lock()
	defer n.mu.Unlock()
	if n.srv == nil {
		return
	}
	n.srv.Shutdown()
	n.srv.WaitForShutdown()
	n.srv = nil
}
