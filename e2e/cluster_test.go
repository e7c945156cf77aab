package e2e

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/batonhq/baton/internal/opsserver"
	"github.com/batonhq/baton/internal/testsvc"
	"github.com/batonhq/baton/relay"
)

// clusterStreams are the relay's streams, all replicated on the three nodes.
var clusterStreams = []string{"AGENT_TURNS", "AGENT_OUTCOMES", "AGENT_DEADLETTER"}

// TestJetStreamCluster runs Baton on a 3-node JetStream cluster with R3 streams, every program
// given all three URLs, and under a steady load stops the turns stream's leader, then a second
// node (the streams and the meta layer lose their quorum: publishes stall, the relay must hold
// its LSN), then starts both again. Afterwards every accepted message has exactly one reply,
// nothing is lost or doubled, each conversation's outcomes come in commit order, and the slot
// caught up.
func TestJetStreamCluster(t *testing.T) {
	// The programs first (cached by the other tests of the package): the run itself is bounded.
	testsvc.Binaries(t, "github.com/batonhq/baton/cmd/baton", "github.com/batonhq/baton/examples/echoagent",
		"github.com/batonhq/baton/examples/subscriber")
	ctx, cancel := context.WithTimeout(t.Context(), 90*time.Second)
	defer cancel()
	began := time.Now()
	s, cl := startClusterSystem(t, ctx)
	t.Logf("cluster, postgres and programs up in %v", time.Since(began).Round(time.Millisecond))

	js, err := jetstream.New(s.nc)
	if err != nil {
		t.Fatalf("jetstream: %v", err)
	}
	l := s.startLoad(ctx)
	finished := false
	defer func() {
		if !finished {
			l.finish()
		}
	}()
	// progress waits until at least n more requests are done than when it was called, and the
	// relay had n more turn events acknowledged by JetStream: the workers' sweep of Postgres
	// would finish requests without the stream, so done rows alone do not show that it works.
	rp := s.named["relay"]
	turnsAcked := func() float64 {
		v, err := rp.metric(ctx, `baton_relay_events_total{kind="turn"}`)
		if err != nil {
			return -1
		}
		return v
	}
	progress := func(what string, n int, within time.Duration) {
		t.Helper()
		from, fromAcked := s.doneRows(ctx), turnsAcked()
		deadline := time.Now().Add(within)
		for s.doneRows(ctx) < from+n || turnsAcked() < fromAcked+float64(n) {
			if time.Now().After(deadline) || ctx.Err() != nil {
				t.Fatalf("%s: fewer than %d requests done and turn events acknowledged within %v (from %d done, %.0f acknowledged; now %d, %.0f)\n%s",
					what, n, within, from, fromAcked, s.doneRows(ctx), turnsAcked(), s.logs(30))
			}
			time.Sleep(100 * time.Millisecond)
		}
	}
	progress("before the faults", 80, 30*time.Second)

	// 1. The turns stream's leader goes away: its replicas elect another, clients reconnect
	// to the nodes that run.
	leader, err := cl.StreamLeader(ctx, js, "AGENT_TURNS")
	if err != nil {
		t.Fatalf("turns leader: %v", err)
	}
	t.Logf("stopping %s, leader of AGENT_TURNS", leader.Name)
	leader.Stop()
	progress("after the leader stopped", 80, 30*time.Second)

	// 2. A second node goes away: one of three runs, no stream has a quorum. Publishes get no
	// PubAck, so a message committed now must not be confirmed to Postgres until it is.
	var second *testsvc.ClusterNode
	for _, n := range cl.Nodes {
		if n.Running() {
			second = n
			break
		}
	}
	t.Logf("stopping %s: quorum lost", second.Name)
	second.Stop()
	before := s.acceptedCount(l)
	for s.acceptedCount(l) < before+20 { // accepted after the quorum was gone
		if !sleep(ctx, 50*time.Millisecond) {
			t.Fatalf("no message accepted while the quorum was lost")
		}
	}
	var stalled string
	if err := s.pool.QueryRow(ctx, `SELECT pg_current_wal_lsn()::text`).Scan(&stalled); err != nil {
		t.Fatalf("wal position: %v", err)
	}
	// The relay holds its position for as long as the quorum stays lost (3s here, a third of
	// its PubAck timeout, so that a timeout-driven restart is covered by the run as well).
	for watch := time.Now().Add(3 * time.Second); time.Now().Before(watch); {
		var passed bool
		if err := s.pool.QueryRow(ctx, `SELECT confirmed_flush_lsn >= $1::pg_lsn FROM pg_replication_slots
			WHERE slot_name = 'baton'`, stalled).Scan(&passed); err != nil {
			t.Fatalf("read slot: %v", err)
		}
		if passed {
			t.Fatalf("the relay confirmed LSN %s to Postgres while no stream had a quorum", stalled)
		}
		sleep(ctx, 100*time.Millisecond)
	}

	// 3. Both come back: the second first (quorum again), then the old leader, which catches up.
	if err := second.Start(); err != nil {
		t.Fatalf("start %s: %v", second.Name, err)
	}
	t.Logf("started %s: quorum again", second.Name)
	progress("after the quorum came back", 80, 45*time.Second)
	if err := leader.Start(); err != nil {
		t.Fatalf("start %s: %v", leader.Name, err)
	}
	t.Logf("started %s", leader.Name)
	actx, acancel := context.WithTimeout(ctx, 30*time.Second)
	defer acancel()
	for _, st := range clusterStreams {
		if _, err := cl.AwaitStreamReplicas(actx, js, st); err != nil {
			t.Fatalf("after the restarts: %v\n%s", err, s.logs(30))
		}
	}
	progress("after every node is back", 40, 30*time.Second)
	sent := l.finish()
	finished = true
	t.Logf("load done after %v: %d messages accepted, %d send retries", time.Since(began).Round(time.Millisecond), len(sent), l.retries.Load())

	c := newChecker(t, ctx, s)
	c.failures = append(c.failures, l.failures...)
	if c.drain(len(sent), 45*time.Second) {
		c.check(sent)
		c.awaitSubscriber()
		c.checkSubscriber(s.outcomes.snapshot())
		c.checkStreams()
	}
	c.checkCrashes()
	if c.replies+c.visibleErrors != len(sent) {
		c.fail("%d messages accepted, %d replies and %d visible errors", len(sent), c.replies, c.visibleErrors)
	}
	if c.visibleErrors != 0 {
		c.fail("%d visible errors: no fault of this run justifies one", c.visibleErrors)
	}
	t.Logf("cluster: faults=2 (stopped the turns leader %s, then %s: quorum lost; both restarted) messages=%d replies=%d lost=%d doubled=%d in %v",
		leader.Name, second.Name, len(sent), c.replies, c.lost, c.doubled, time.Since(began).Round(time.Second))
	if len(c.failures) > 0 {
		t.Errorf("%d failures:\n%s", len(c.failures), strings.Join(c.failures, "\n"))
		t.Logf("state: %s", c.state())
		t.Logf("logs:\n%s", s.logs(40))
	}
}

// startClusterSystem starts a 3-node JetStream cluster, Postgres, one relay (with
// BATON_STREAM_REPLICAS=3), two echo-agent workers and the subscriber, every program with all
// three NATS URLs, and waits until the streams are replicated on the three nodes.
func startClusterSystem(t *testing.T, ctx context.Context) (*system, *testsvc.Cluster) {
	t.Helper()
	cl := testsvc.StartCluster(t, 3)
	pg, pool := startMigratedPostgres(t, ctx, 8)
	nc, err := nats.Connect(cl.URLs(), nats.Name("cluster-test"), nats.MaxReconnects(-1), nats.ReconnectWait(100*time.Millisecond))
	if err != nil {
		t.Fatalf("connect to nats: %v", err)
	}
	t.Cleanup(nc.Close)
	s := &system{t: t, pg: pg, pool: pool, app: rolePool(t, ctx, pg, "baton_app", 6), nc: nc, named: map[string]*proc{}}

	bins := testsvc.Binaries(t, "github.com/batonhq/baton/cmd/baton", "github.com/batonhq/baton/examples/echoagent",
		"github.com/batonhq/baton/examples/subscriber")
	add := func(name, kind, bin string, args []string, withPG bool) *proc {
		p := &proc{name: name, kind: kind, bin: bin, args: args, log: newTail(256 << 10)}
		p.env = []string{"BATON_NATS_URL=" + cl.URLs(), "BATON_LOG_LEVEL=info"}
		if withPG {
			p.metricsAddr = opsserver.AnyPort
			pool := ""
			if kind == "worker" {
				pool = fmt.Sprintf("&pool_max_conns=%d", workerPoolMax)
			}
			p.env = append(p.env, fmt.Sprintf("BATON_DATABASE_URL=%s&application_name=%s%s",
				roleURL(pg, roleOf(kind)), name, pool), "BATON_METRICS_ADDR="+p.metricsAddr)
		}
		s.procs = append(s.procs, p)
		s.named[name] = p
		t.Cleanup(func() {
			if p.running() {
				_ = p.kill()
			}
		})
		return p
	}
	// At debug level, relays and workers write the records of the stream-level checks
	// (streams_test.go).
	rp := add("relay", "relay", bins[0], []string{"relay"}, true)
	rp.env = append(rp.env, "BATON_FATAL_LINGER=0", "BATON_STREAM_REPLICAS=3", "BATON_LOG_LEVEL=debug")
	rp.recordLine = s.deliveries.add
	for i := range 2 {
		w := add(fmt.Sprintf("worker-%d", i), "worker", bins[1], []string{"--source", "jetstream", "--model-latency", "20ms",
			"--lease", workerLease.String(), "--recovery-interval", "1s", "--ack-wait", "5s",
			"--shutdown-grace", "3s", "--max-attempts", fmt.Sprint(workerMaxAttempts)}, true)
		w.env = append(w.env, "BATON_LOG_LEVEL=debug")
		w.recordLine = s.deliveries.add
	}
	sub := add("subscriber", "subscriber", bins[2], []string{"--json", "--durable", "cluster"}, false)
	sub.stdoutLine = s.outcomes.add

	// The streams, created R3 by a relay in this process with the settings the relay uses
	// (relay.StreamSettings.Replicas), before the relay process starts on the slot it leaves.
	// The process is given BATON_STREAM_REPLICAS=3 too: a relay that creates its streams from
	// that variable finds them as it would have made them.
	precreateStreams(t, ctx, pg.URL("postgres"), nc)
	rp.start(t)
	deadline := time.Now().Add(time.Minute)
	for {
		if v, err := rp.metric(ctx, "baton_relay_active"); err == nil && v == 1 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the relay does not stream after a minute\n%s", s.logs(30))
		}
		time.Sleep(100 * time.Millisecond)
	}
	js, err := jetstream.New(nc)
	if err != nil {
		t.Fatalf("jetstream: %v", err)
	}
	rctx, rcancel := context.WithTimeout(ctx, 30*time.Second)
	defer rcancel()
	for _, name := range clusterStreams {
		st, err := js.Stream(rctx, name)
		if err != nil {
			t.Fatalf("stream %s: %v", name, err)
		}
		if r := st.CachedInfo().Config.Replicas; r != 3 {
			t.Fatalf("stream %s has %d replicas, want 3", name, r)
		}
		if _, err := cl.AwaitStreamReplicas(rctx, js, name); err != nil {
			t.Fatalf("stream %s: %v", name, err)
		}
	}
	for _, p := range s.procs {
		if p.kind != "relay" {
			p.start(t)
		}
	}
	return s, cl
}

// precreateStreams runs a relay in this process with relay.StreamSettings{Replicas: 3} until it
// streams: it creates the streams R3 and the slot, which the relay process then takes over.
func precreateStreams(t *testing.T, ctx context.Context, databaseURL string, nc *nats.Conn) {
	t.Helper()
	r, err := relay.New(relay.Config{DatabaseURL: databaseURL, NATS: nc, Streams: relay.StreamSettings{Replicas: 3}})
	if err != nil {
		t.Fatalf("relay: %v", err)
	}
	rctx, cancel := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- r.Run(rctx) }()
	deadline := time.Now().Add(time.Minute)
	for !r.Active() {
		if time.Now().After(deadline) {
			cancel()
			t.Fatalf("the in-process relay does not stream after a minute: %v", <-done)
		}
		time.Sleep(20 * time.Millisecond)
	}
	cancel()
	if err := <-done; err != nil {
		t.Fatalf("in-process relay: %v", err)
	}
}

// doneRows counts the requests that ended (done or error); -1 when Postgres cannot say.
func (s *system) doneRows(ctx context.Context) int {
	var n int
	if err := s.pool.QueryRow(ctx, `SELECT count(*) FROM agent_outbox WHERE status IN ('done', 'error')`).Scan(&n); err != nil {
		return -1
	}
	return n
}

// acceptedCount returns how many messages the producers had accepted so far.
func (s *system) acceptedCount(l *load) int {
	l.mu.Lock()
	defer l.mu.Unlock()
	return len(l.accepted)
}
