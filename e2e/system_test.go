package e2e

import (
	"context"
	"encoding/json"
	"fmt"
	"net/url"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/batonhq/baton/internal/opsserver"
	"github.com/batonhq/baton/internal/testsvc"
	"github.com/batonhq/baton/migrations"
)

// The workers' settings: a short lease, recovery interval and ack wait, so that the turns of
// a killed or stopped worker are taken over within the run; attempts a little above the
// default, since every fault may cost a turn one.
const (
	workerLease       = 3 * time.Second
	workerMaxAttempts = 5
	workerPoolMax     = 6
	// The pool of a relay holds its lock session and its queries; its replication connection
	// comes on top.
	relayConnsMax = 6
)

// system is the whole of Baton under test: its servers, and its programs as processes, each
// talking to Postgres and NATS through proxies of its own.
type system struct {
	t    *testing.T
	pg   *testsvc.Postgres
	nats *testsvc.NATS // the NATS server; nil on a cluster
	// cluster is the JetStream cluster the run uses instead of one server (-chaos.cluster),
	// else nil.
	cluster *testsvc.Cluster
	pool    *pgxpool.Pool // the test's own connections, straight to Postgres, as the owner
	app     *pgxpool.Pool // the producers' connections, as roles.sql's baton_app
	nc      *nats.Conn    // the test's own connection, straight to NATS
	procs   []*proc
	named   map[string]*proc

	pgDown, natsDown bool                 // the servers' state, kept by the fault runner (natsDown: a node, on a cluster)
	stoppedNode      *testsvc.ClusterNode // the node stopNATS stopped, on a cluster
	// turnsConfig is the turns stream's configuration while a fault capped it, else nil.
	turnsConfig *jetstream.StreamConfig

	outcomes   outcomeLog
	deliveries deliveryLog // the turn events the workers received
}

// outcomeLog is what the subscriber printed, in order.
type outcomeLog struct {
	mu    sync.Mutex
	lines []subscriberLine
	bad   []string // lines that did not parse
}

// subscriberLine is one line of `subscriber --json`.
type subscriberLine struct {
	Seq            uint64  `json:"seq"`
	MessageID      string  `json:"message_id"`
	ConversationID string  `json:"conversation_id"`
	Role           string  `json:"role"`
	OutboxIDs      []int64 `json:"outbox_ids"`
}

func (l *outcomeLog) add(line string) {
	var s subscriberLine
	l.mu.Lock()
	defer l.mu.Unlock()
	if err := json.Unmarshal([]byte(line), &s); err != nil || s.MessageID == "" {
		l.bad = append(l.bad, line)
		return
	}
	l.lines = append(l.lines, s)
}

func (l *outcomeLog) snapshot() []subscriberLine {
	l.mu.Lock()
	defer l.mu.Unlock()
	return append([]subscriberLine(nil), l.lines...)
}

// startSystem starts Postgres (a cluster of the test's own: the run restarts it), NATS (with
// cluster, a 3-node JetStream cluster and R3 streams), two relays (one streams, one stands
// by), three workers (the third with the write tool) and the subscriber, and waits until a
// relay streams. beforeRelays, if not nil, runs once the servers run, before the first relay
// starts (and creates the slot).
func startSystem(t *testing.T, ctx context.Context, cluster bool, beforeRelays func(*system)) *system {
	t.Helper()
	began := time.Now()
	pg, pool := startMigratedPostgres(t, ctx, 12)

	s := &system{t: t, pg: pg, pool: pool, app: rolePool(t, ctx, pg, "baton_app", 6), named: map[string]*proc{}}
	// natsTargets are the servers a process reaches, each through a proxy of its own.
	var natsTargets []string
	testURL := ""
	if cluster {
		// No node tells clients of the others: a process's proxies stay its only paths.
		s.cluster = testsvc.StartCluster(t, 3, testsvc.NoAdvertise())
		for _, node := range s.cluster.Nodes {
			natsTargets = append(natsTargets, fmt.Sprintf("127.0.0.1:%d", node.Port))
		}
		testURL = s.cluster.URLs()
	} else {
		s.nats = testsvc.StartNATS(t)
		if s.nats.External() {
			t.Fatalf("the chaos run stops and starts NATS: unset %s", testsvc.EnvNATSURL)
		}
		natsTargets = []string{fmt.Sprintf("127.0.0.1:%d", s.nats.Port)}
		testURL = s.nats.URL()
	}
	nc, err := nats.Connect(testURL, nats.Name("chaos-test"), nats.MaxReconnects(-1), nats.ReconnectWait(100*time.Millisecond))
	if err != nil {
		t.Fatalf("connect to nats: %v", err)
	}
	t.Cleanup(nc.Close)
	s.nc = nc

	bins := testsvc.Binaries(t, "github.com/batonhq/baton/cmd/baton", "github.com/batonhq/baton/examples/echoagent",
		"github.com/batonhq/baton/examples/subscriber")
	baton, echoagent, subscriber := bins[0], bins[1], bins[2]
	t.Logf("postgres up and migrated, programs built: %v", time.Since(began).Round(time.Millisecond))

	pgTarget := pg.SocketPath() // the proxies dial the cluster's Unix socket
	add := func(name, kind, bin string, args []string, withPG bool) *proc {
		pool := ""
		if kind == "worker" { // the relay connects without a pool; Postgres refuses the setting
			pool = fmt.Sprintf("&pool_max_conns=%d", workerPoolMax)
		}
		p := &proc{name: name, kind: kind, bin: bin, args: args, log: newTail(256 << 10)}
		var urls []string
		for _, target := range natsTargets {
			px := testsvc.StartProxy(t, target)
			p.nats = append(p.nats, px)
			urls = append(urls, "nats://"+px.Addr())
		}
		p.env = []string{"BATON_NATS_URL=" + strings.Join(urls, ","), "BATON_LOG_LEVEL=info"}
		if withPG {
			p.pg = testsvc.StartProxy(t, pgTarget)
			p.metricsAddr = opsserver.AnyPort
			p.env = append(p.env,
				fmt.Sprintf("BATON_DATABASE_URL=postgres://%s@%s/postgres?sslmode=disable&application_name=%s%s",
					roleOf(kind), p.pg.Addr(), name, pool),
				"BATON_METRICS_ADDR="+p.metricsAddr)
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
	for i := range 2 {
		// A lowered minimum silence: the neighbour's bulk transactions keep the walsender
		// busy, silent, for longer than that; and a lowered cut, below the neighbour's
		// largest logical messages (neighbour_test.go).
		r := add(fmt.Sprintf("relay-%d", i), "relay", baton, []string{"relay", "--status-interval", "250ms", "--min-silence", "1s",
			"--max-change-bytes", fmt.Sprint(8 << 20)}, true)
		// At debug level a relay logs each turn event its replay check does not publish.
		r.env = append(r.env, "BATON_FATAL_LINGER=0", "BATON_STREAM_DUPLICATES="+chaosDuplicates.String(), "BATON_LOG_LEVEL=debug")
		r.recordLine = s.deliveries.add
		if cluster {
			r.env = append(r.env, "BATON_STREAM_REPLICAS=3")
		}
	}
	for i := range 3 {
		args := []string{"--source", "jetstream", "--model-latency", "100ms",
			"--lease", workerLease.String(), "--recovery-interval", "1s", "--ack-wait", "5s",
			"--shutdown-grace", "3s", "--max-attempts", fmt.Sprint(workerMaxAttempts)}
		if i == 2 {
			args = append(args, "--write-tool")
		}
		w := add(fmt.Sprintf("worker-%d", i), "worker", echoagent, args, true)
		// At debug level a worker logs each turn event it receives: the stream-level checks
		// read those records (streams_test.go).
		w.env = append(w.env, "BATON_LOG_LEVEL=debug")
		w.recordLine = s.deliveries.add
	}
	sub := add("subscriber", "subscriber", subscriber, []string{"--json", "--durable", "chaos"}, false)
	sub.stdoutLine = s.outcomes.add

	if beforeRelays != nil {
		beforeRelays(s)
	}
	// The relays first: they create the streams the others use.
	s.named["relay-0"].start(t)
	s.named["relay-1"].start(t)
	s.awaitActiveRelay(ctx, time.Minute)
	if cluster {
		s.awaitReplicas(ctx)
	}
	for _, p := range s.procs {
		if p.kind != "relay" {
			p.start(t)
		}
	}
	return s
}

// awaitReplicas waits until the streams, R3 on the cluster, have every replica current.
func (s *system) awaitReplicas(ctx context.Context) {
	s.t.Helper()
	js, err := jetstream.New(s.nc)
	if err != nil {
		s.t.Fatalf("jetstream: %v", err)
	}
	rctx, cancel := context.WithTimeout(ctx, time.Minute)
	defer cancel()
	for _, name := range clusterStreams {
		for {
			st, err := js.Stream(rctx, name)
			if err == nil && st.CachedInfo().Config.Replicas != 3 {
				s.t.Fatalf("stream %s has %d replicas, want 3", name, st.CachedInfo().Config.Replicas)
			}
			if err == nil {
				break
			}
			if rctx.Err() != nil {
				s.t.Fatalf("stream %s: %v", name, err)
			}
			time.Sleep(100 * time.Millisecond)
		}
		if _, err := s.cluster.AwaitStreamReplicas(rctx, js, name); err != nil {
			s.t.Fatalf("stream %s: %v", name, err)
		}
	}
}

// activeRelay returns the relay that streams now (its baton_relay_active is 1), or nil.
func (s *system) activeRelay(ctx context.Context) *proc {
	for _, name := range []string{"relay-0", "relay-1"} {
		p := s.named[name]
		if p.isStopped() || !p.running() {
			continue
		}
		if v, err := p.metric(ctx, "baton_relay_active"); err == nil && v == 1 {
			return p
		}
	}
	return nil
}

// awaitActiveRelay waits until a relay streams.
func (s *system) awaitActiveRelay(ctx context.Context, within time.Duration) *proc {
	s.t.Helper()
	deadline := time.Now().Add(within)
	for {
		if p := s.activeRelay(ctx); p != nil {
			return p
		}
		if time.Now().After(deadline) {
			s.t.Fatalf("no relay streams after %v\n%s", within, s.logs(20))
		}
		time.Sleep(100 * time.Millisecond)
	}
}

// heal undoes whatever a fault may have left: proxies forward at full speed, the servers run,
// no process is stopped, and a process that exited on its own is started again (its exit is
// recorded as a crash).
func (s *system) heal(ctx context.Context) {
	t := s.t
	for _, p := range s.procs {
		for _, px := range append([]*testsvc.Proxy{p.pg}, p.nats...) {
			if px != nil {
				px.Unfreeze()
				px.SetLatency(0)
				px.SetReplyRate(0)
			}
		}
	}
	if s.natsDown {
		if err := s.startNATS(); err != nil {
			t.Fatalf("%v", err)
		}
	}
	if s.pgDown {
		if err := s.pg.Start(ctx); err != nil {
			t.Fatalf("start postgres: %v", err)
		}
		s.pgDown = false
	}
	if err := s.restoreTurns(); err != nil {
		t.Fatalf("%v", err)
	}
	for _, p := range s.procs {
		if p.isStopped() {
			if _, err := p.signal(syscall.SIGCONT, false); err != nil {
				t.Errorf("%v", err)
			}
		}
		if !p.running() {
			p.start(t)
		}
	}
}

// logs returns the last n lines of every process's log.
func (s *system) logs(n int) string {
	var b strings.Builder
	for _, p := range s.procs {
		fmt.Fprintf(&b, "=== %s (pid %d, %d starts), last %d lines:\n%s\n", p.name, p.pid(), p.starts, n, p.log.lines(n))
	}
	return b.String()
}

// roleOf is the roles.sql role a process of kind logs in as, as deployed.
func roleOf(kind string) string {
	switch kind {
	case "relay":
		return "baton_relay"
	case "worker":
		return "baton_worker"
	}
	panic("e2e: no role for a process of kind " + kind)
}

// roleURL is pg's URL of its postgres database, logged in as role (the cluster trusts local
// connections: no password).
func roleURL(pg *testsvc.Postgres, role string) string {
	u, err := url.Parse(pg.URL("postgres"))
	if err != nil {
		panic("e2e: the throwaway cluster's URL: " + err.Error())
	}
	u.User = url.User(role)
	return u.String()
}

// rolePool returns a pool of at most maxConns on pg's postgres database, logged in as role.
func rolePool(t *testing.T, ctx context.Context, pg *testsvc.Postgres, role string, maxConns int32) *pgxpool.Pool {
	t.Helper()
	pcfg, err := pgxpool.ParseConfig(roleURL(pg, role))
	if err != nil {
		t.Fatalf("pool config: %v", err)
	}
	pcfg.MaxConns = maxConns
	pool, err := pgxpool.NewWithConfig(ctx, pcfg)
	if err != nil {
		t.Fatalf("pool as %s: %v", role, err)
	}
	t.Cleanup(pool.Close)
	return pool
}

// checkPrivileges fails the run when Postgres refused one of Baton's roles a privilege
// (SQLSTATE 42501 in its log): such an error can hide where the code drops it.
func (c *checker) checkPrivileges() {
	lines, err := testsvc.PrivilegeErrors(c.s.pg.LogPath(), "postgres")
	if err != nil {
		c.fail("read the Postgres log for privilege errors: %v", err)
		return
	}
	if len(lines) > 0 {
		c.fail("privilege errors of Baton's roles (SQLSTATE 42501; roles.sql lacks a grant, or the code needs one it should not):\n%s",
			strings.Join(lines, "\n"))
	}
}

// startMigratedPostgres starts a throwaway cluster of the test's own (the runs stop and crash
// it), migrates its postgres database, applies deploy/postgres/roles.sql (the processes log in
// as its roles) and returns it with a pool of at most maxConns, as the owner.
func startMigratedPostgres(t *testing.T, ctx context.Context, maxConns int32) (*testsvc.Postgres, *pgxpool.Pool) {
	t.Helper()
	pg, err := testsvc.StartPostgres(ctx)
	if err != nil {
		t.Fatalf("start postgres: %v", err)
	}
	t.Cleanup(func() {
		if err := pg.Close(); err != nil {
			t.Errorf("stop postgres: %v", err)
		}
	})
	conn, err := pgx.Connect(ctx, pg.URL("postgres"))
	if err != nil {
		t.Fatalf("connect: %v", err)
	}
	if _, err := migrations.Up(ctx, conn); err != nil {
		t.Fatalf("migrate: %v", err)
	}
	roles, err := testsvc.RolesSQL("baton") // roles.sql's own names: the cluster is the test's
	if err != nil {
		t.Fatalf("roles.sql: %v", err)
	}
	if _, err := conn.Exec(ctx, roles); err != nil {
		t.Fatalf("apply roles.sql: %v", err)
	}
	_ = conn.Close(ctx)
	pcfg, err := pgxpool.ParseConfig(pg.URL("postgres"))
	if err != nil {
		t.Fatalf("pool config: %v", err)
	}
	pcfg.MaxConns = maxConns
	pool, err := pgxpool.NewWithConfig(ctx, pcfg)
	if err != nil {
		t.Fatalf("pool: %v", err)
	}
	t.Cleanup(pool.Close)
	return pg, pool
}
