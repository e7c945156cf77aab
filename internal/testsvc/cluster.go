package testsvc

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/url"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go/jetstream"
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
	// Port is the client port, ClusterPort the route port; both stay across Stop and Start.
	Port, ClusterPort int
	// StoreDir is where the node keeps its streams and its Raft logs.
	StoreDir string

	routes   []*url.URL
	noAdvert bool
	mu       sync.Mutex
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
func StartCluster(t testing.TB, n int, opts ...ClusterOption) *Cluster {
	t.Helper()
	c := &Cluster{}
	ports := freePorts(t, 2*n)
	for i := range n {
		node := &ClusterNode{
			Name:        fmt.Sprintf("baton-n%d", i),
			Port:        ports[2*i],
			ClusterPort: ports[2*i+1],
			StoreDir:    t.TempDir(),
		}
		for _, o := range opts {
			o(node)
		}
		c.Nodes = append(c.Nodes, node)
	}
	for _, node := range c.Nodes {
		for _, other := range c.Nodes {
			if other != node {
				node.routes = append(node.routes, &url.URL{Scheme: "nats", Host: fmt.Sprintf("127.0.0.1:%d", other.ClusterPort)})
			}
		}
	}
	t.Cleanup(c.StopAll)
	for _, node := range c.Nodes {
		if err := node.Start(); err != nil {
			t.Fatalf("start %s: %v", node.Name, err)
		}
	}
	ctx, cancel := context.WithTimeout(t.Context(), time.Minute)
	defer cancel()
	if err := c.AwaitMetaLeader(ctx); err != nil {
		t.Fatalf("cluster: %v", err)
	}
	return c
}

// freePorts returns n loopback ports no one listens on now. They are held open together so
// that they differ, then released for the servers.
func freePorts(t testing.TB, n int) []int {
	t.Helper()
	var lc net.ListenConfig
	var ports []int
	for range n {
		ln, err := lc.Listen(t.Context(), "tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatalf("free port: %v", err)
		}
		defer func() { _ = ln.Close() }()
		ports = append(ports, ln.Addr().(*net.TCPAddr).Port)
	}
	return ports
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

// Running reports whether the node runs.
func (n *ClusterNode) Running() bool { return n.server() != nil }

func (n *ClusterNode) server() *server.Server {
	n.mu.Lock()
	defer n.mu.Unlock()
	return n.srv
}

// Start starts the node on its ports and store directory and waits until it accepts clients.
// A node started again recovers its streams and catches up with the cluster's leaders.
func (n *ClusterNode) Start() error {
	n.mu.Lock()
	defer n.mu.Unlock()
	if n.srv != nil {
		return fmt.Errorf("%s already running", n.Name)
	}
	srv, err := server.NewServer(&server.Options{
		ServerName: n.Name,
		Host:       "127.0.0.1",
		Port:       n.Port,
		JetStream:  true,
		StoreDir:   n.StoreDir,
		// sync_interval: always.
		SyncAlways:   true,
		SyncInterval: 2 * time.Minute,
		Cluster: server.ClusterOpts{
			Name:        ClusterName,
			Host:        "127.0.0.1",
			Port:        n.ClusterPort,
			NoAdvertise: n.noAdvert,
		},
		Routes: n.routes,
		NoSigs: true,
		NoLog:  true,
	})
	if err != nil {
		return fmt.Errorf("nats server %s: %w", n.Name, err)
	}
	go srv.Start()
	if !srv.ReadyForConnections(30 * time.Second) {
		srv.Shutdown()
		srv.WaitForShutdown()
		return errors.New("nats server " + n.Name + " not ready after 30s")
	}
	n.srv = srv
	return nil
}

// Stop shuts the node down and waits until it is gone: its clients are disconnected (and
// reconnect to another node of their URL list), the streams it led elect another leader
// among their running replicas. The store directory stays for Start. Stopping a stopped node
// does nothing.
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
