package relay_test

import (
	"context"
	"fmt"
	"net/url"
	"syscall"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"

	"github.com/batonhq/baton/internal/testsvc"
	"github.com/batonhq/baton/relay"
	"github.com/batonhq/baton/wire"
)

// fenceWorld returns a bundle whose streams have replicas replicas: 1 on the bundle's server,
// 3 on a 3-node cluster of the test's own. viaProxy is the server a proxied relay reaches.
func fenceWorld(t *testing.T, replicas int) (b *bundle, viaProxy string) {
	t.Helper()
	b = setup(t)
	if replicas == 1 {
		return b, b.nats.URL()
	}
	// Proxied relays reach the cluster only through their proxy, also when they reconnect.
	c := testsvc.StartCluster(t, 3, testsvc.NoAdvertise())
	nc, err := nats.Connect(c.URLs(), nats.MaxReconnects(-1), nats.ReconnectWait(50*time.Millisecond))
	require.NoError(t, err)
	t.Cleanup(nc.Close)
	js, err := jetstream.New(nc)
	require.NoError(t, err)
	b.nc, b.js, b.cfg.NATS = nc, js, nc
	b.cfg.Streams.Replicas = replicas
	return b, c.Nodes[0].URL()
}

// replicaCases runs test once on an R1 stream and once on a 3-node R3 cluster.
func replicaCases(t *testing.T, test func(t *testing.T, replicas int)) {
	for _, replicas := range []int{1, 3} {
		t.Run(fmt.Sprintf("R%d", replicas), func(t *testing.T) {
			t.Parallel()
			test(t, replicas)
		})
	}
}

// proxiedNATS returns a NATS connection to server through a proxy the test can freeze, with
// nats.go's stale-connection pings out of the test's way.
func proxiedNATS(t *testing.T, server string) (*testsvc.Proxy, *nats.Conn) {
	t.Helper()
	u, err := url.Parse(server)
	require.NoError(t, err)
	proxy := testsvc.StartProxy(t, u.Host)
	// Through the proxy only: not to the other nodes of a cluster, which the server announces.
	nc, err := nats.Connect("nats://"+proxy.Addr(), nats.MaxReconnects(-1), nats.PingInterval(time.Hour),
		nats.FlusherTimeout(time.Hour), nats.IgnoreDiscoveredServers(), nats.ReconnectWait(100*time.Millisecond))
	require.NoError(t, err)
	t.Cleanup(nc.Close)
	return proxy, nc
}

// startProxied runs a relay publishing through nc (a proxied connection) until stop is called
// or the test ends, and waits until it streams.
func (b *bundle) startProxied(t *testing.T, ctx context.Context, nc *nats.Conn) (r *relay.Relay, stop func()) {
	t.Helper()
	cfg := b.cfg
	cfg.NATS = nc
	cfg.DrainTimeout = 200 * time.Millisecond
	r, err := relay.New(cfg)
	require.NoError(t, err)
	ctx, cancel := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- r.Run(ctx) }()
	stopped := false
	stop = func() {
		if stopped {
			return
		}
		stopped = true
		cancel()
		select {
		case err := <-done:
			require.NoError(t, err)
		case <-time.After(30 * time.Second):
			t.Fatal("relay did not stop")
		}
	}
	t.Cleanup(stop)
	require.Eventually(t, r.Active, time.Minute, 5*time.Millisecond, "relay never became active")
	return r, stop
}

// Relay A's path to NATS loses the server's answers (held, not refused) while its publishes go
// through: the streams store A's events and A never sees a PubAck, so the slot is not
// confirmed past them. A stops; relay B starts after the duplicate window and replays from the
// confirmed LSN. B must learn what A stored and not store it again, in either stream: the
// duplicate window no longer removes the copies.
func TestEventsStoredWithoutTheirPubAckAreNotStoredAgain(t *testing.T) {
	t.Parallel()
	replicaCases(t, storedWithoutPubAckNotStoredAgain)
}

func storedWithoutPubAckNotStoredAgain(t *testing.T, replicas int) {
	b, server := fenceWorld(t, replicas)
	ctx := ctxT(t, 3*time.Minute)
	const window = time.Second
	b.cfg.Streams.Duplicates = window
	convs := conversationIDs(4)
	createConversations(t, b.db.Pool, convs...)

	proxy, ncA := proxiedNATS(t, server)
	t.Cleanup(proxy.Unfreeze)
	ra, stopA := b.startProxied(t, ctx, ncA)
	_, err := send(ctx, b.db.Pool, convs[0], "warm")
	require.NoError(t, err)
	b.waitStream(t, "AGENT_TURNS", 1, 30*time.Second)

	proxy.FreezeReplies()
	for i := range 3 * len(convs) {
		_, err := send(ctx, b.db.Pool, convs[i%len(convs)], fmt.Sprintf("u%d", i))
		require.NoError(t, err)
	}
	for i, c := range convs {
		_, err := b.db.Pool.Exec(ctx, `INSERT INTO messages (id, conversation_id, role, content) VALUES ($1, $2, 'assistant', 'hi')`,
			fmt.Sprintf("r%d", i), c)
		require.NoError(t, err)
	}
	want := truth(t, b.db.Pool)
	// A sends no more to a subject (event by event) or a stream (an atomic batch) before it
	// hears back: the streams get the first of what A sends, stored without an answer.
	b.waitStream(t, "AGENT_TURNS", 2, time.Minute)
	b.waitStream(t, "AGENT_OUTCOMES", 1, time.Minute)
	require.Eventually(t, func() bool { return !ra.Active() }, time.Minute, 5*time.Millisecond, "relay A's session never ended")
	stopA()
	// The duplicate window is a server-side timer: nothing to await but time.
	time.Sleep(2 * window)

	b.start(t)
	requireSlotCaughtUp(t, b)
	assertExactlyOnceInOrder(t, b.readStream(t, "AGENT_TURNS"), want)
	seen := map[string]int{}
	for _, m := range b.readStream(t, "AGENT_OUTCOMES") {
		seen[m.header.Get(wire.HeaderMessageID)]++
	}
	for i := range convs {
		require.Equal(t, 1, seen[fmt.Sprintf("r%d", i)], "outcome r%d stored once: %v", i, seen)
	}
}

// On a replicated stream the relay publishes atomic batches, which JetStream refuses whole when
// one of their Nats-Msg-Ids is in the stream already. Anyone with publish rights can store a
// message with an event's Nats-Msg-Id first: the relay must not stall on it, but publish that
// batch's events one at a time, the copy dropped as a duplicate, and go on in batches.
func TestAtomicBatchWithAForeignDuplicateGoesOneByOne(t *testing.T) {
	t.Parallel()
	b, _ := fenceWorld(t, 3)
	ctx := ctxT(t, 3*time.Minute)
	reg := prometheus.NewRegistry()
	b.cfg.Registerer = reg
	createConversations(t, b.db.Pool, "a", "b")
	b.startActive(t)
	first, err := send(ctx, b.db.Pool, "a", "warm")
	require.NoError(t, err)
	b.waitStream(t, "AGENT_TURNS", 1, time.Minute)

	// The next outbox ids are first+1…: a foreign message takes the Nats-Msg-Id of the third.
	forged := first + 3
	subj, err := wire.TurnSubject("agent", "b")
	require.NoError(t, err)
	m := nats.NewMsg(subj)
	m.Header.Set(nats.MsgIdHdr, fmt.Sprintf("turn:%d", forged))
	m.Header.Set("Forged", "yes")
	_, err = b.js.PublishMsg(ctx, m)
	require.NoError(t, err)

	tx, err := b.db.Pool.Begin(ctx)
	require.NoError(t, err)
	for i := range 6 {
		_, err := send(ctx, tx, []string{"a", "b"}[i%2], fmt.Sprintf("m%d", i))
		require.NoError(t, err)
	}
	require.NoError(t, tx.Commit(ctx))
	more, err := send(ctx, b.db.Pool, "a", "after")
	require.NoError(t, err)
	requireSlotCaughtUp(t, b)

	want := truth(t, b.db.Pool)
	delete(want, forged) // its place is taken by the foreign copy
	var events []got
	for _, g := range b.readStream(t, "AGENT_TURNS") {
		if g.header.Get("Forged") == "" {
			events = append(events, g)
		}
	}
	assertExactlyOnceInOrder(t, events, want)
	require.Contains(t, want, more)
	require.Zero(t, counter(t, reg, "baton_relay_reconnects_total", ""), "the relay went on in the same session")
}

// processFault is what happens to relay process A's path to NATS while it has publishes in
// flight, in the process fence tests.
type processFault int

const (
	// faultFrozen freezes the path (bytes held, not refused): A's session ends on its ack
	// timeout, A stands by, and its held publishes land when the path heals.
	faultFrozen processFault = iota
	// faultFrozenPaused freezes the path and SIGSTOPs A: its walsender times out, and A
	// resumes after the path healed, its held publishes landing first.
	faultFrozenPaused
	// faultReconnect breaks A's connection while the path is frozen: nats.go keeps what A
	// publishes in its reconnect buffer, and sends it when it reconnects after the heal.
	faultReconnect
)

// Relay A runs as a process, and its path to NATS fails while it has publishes in flight (see
// processFault). Standby B (a process) takes over and publishes those rows. The path heals
// after the duplicate window: what A sent or buffered reaches the server, which must refuse it.
func TestFrozenRelayProcessIsFencedOut(t *testing.T) {
	t.Parallel()
	replicaCases(t, func(t *testing.T, replicas int) { processIsFencedOut(t, replicas, faultFrozen) })
}

func TestPausedRelayProcessIsFencedOut(t *testing.T) {
	t.Parallel()
	replicaCases(t, func(t *testing.T, replicas int) { processIsFencedOut(t, replicas, faultFrozenPaused) })
}

func TestReconnectedRelayProcessIsFencedOut(t *testing.T) {
	t.Parallel()
	replicaCases(t, func(t *testing.T, replicas int) { processIsFencedOut(t, replicas, faultReconnect) })
}

func processIsFencedOut(t *testing.T, replicas int, fault processFault) {
	b, server := fenceWorld(t, replicas)
	ctx := ctxT(t, 3*time.Minute)
	const window = time.Second
	// A frozen or paused relay A lets go of the slot once its walsender times out: short, so
	// that B takes over within the test. A's session in the reconnect case must end on its
	// missing PubAcks instead, with its Postgres path healthy: a walsender timeout of seconds
	// ended it first once in CI, under load.
	walSenderTimeout := 3 * time.Second
	if fault == faultReconnect {
		walSenderTimeout = 50 * time.Second
	}
	setWalSenderTimeout(t, b, walSenderTimeout)
	convs := conversationIDs(5)
	createConversations(t, b.db.Pool, convs...)
	u, err := url.Parse(server)
	require.NoError(t, err)
	proxy := testsvc.StartProxy(t, u.Host)
	t.Cleanup(proxy.Unfreeze)
	args := []string{"--stream-duplicates", window.String(), "--stream-replicas", fmt.Sprint(replicas)}
	a := b.startAdvProcess(t, b.cfg.DatabaseURL, "nats://"+proxy.Addr(), args...)
	require.Eventually(t, func() bool { return a.logged("msg=streaming") }, time.Minute, 20*time.Millisecond, "relay A never streamed")
	standby := b.startAdvProcess(t, b.cfg.DatabaseURL, b.nc.ConnectedUrl(), args...)
	require.Eventually(t, func() bool { return standby.logged("standing by") }, time.Minute, 20*time.Millisecond, "relay B never stood by")
	_, err = send(ctx, b.db.Pool, convs[0], "warm")
	require.NoError(t, err)
	b.waitStream(t, "AGENT_TURNS", 1, 30*time.Second)

	proxy.Freeze()
	if fault == faultReconnect {
		proxy.ResetAll() // reconnects reach the frozen proxy and time out until it heals
		a.awaitLogged(t, "NATS disconnected")
	}
	before := proxy.FromClients()
	for i := range 2 * len(convs) {
		_, err := send(ctx, b.db.Pool, convs[i%len(convs)], fmt.Sprintf("held-%d", i))
		require.NoError(t, err)
	}
	if fault != faultReconnect {
		require.Eventually(t, func() bool { return proxy.FromClients() > before }, 30*time.Second, 5*time.Millisecond,
			"relay A never published into the frozen path")
	}
	if fault == faultFrozenPaused {
		require.NoError(t, a.cmd.Process.Signal(syscall.SIGSTOP))
	}

	want := truth(t, b.db.Pool)
	b.waitStream(t, "AGENT_TURNS", len(want), time.Minute)
	require.True(t, standby.logged("msg=streaming"), "B published without taking over?")
	if fault != faultFrozenPaused {
		a.awaitLogged(t, "relay session ended")
	}
	// The duplicate window is a server-side timer: nothing to await but time.
	time.Sleep(2 * window)

	// Checked while the path is still frozen: once it heals, A reconnects within moments
	// (seen in CI: between the heal and a check made after it).
	reconnectedFrozen := fault == faultReconnect && a.logged("NATS reconnected")
	held := proxy.FromClients()
	proxy.Unfreeze()
	if fault == faultFrozenPaused {
		require.NoError(t, a.cmd.Process.Signal(syscall.SIGCONT))
	}
	if fault == faultReconnect {
		// A's session published after its connection broke (the rows came after the
		// disconnect) and before it reconnected, so into nats.go's reconnect buffer, which it
		// sends once it reconnected after the heal.
		require.True(t, a.logged("no PubAck within"), "relay A's session ended without a publish waiting for its PubAck")
		require.False(t, reconnectedFrozen, "relay A reconnected through the frozen path")
		a.awaitLogged(t, "NATS reconnected")
		held = proxy.FromClients()
	}
	require.Eventually(t, func() bool { return proxy.ToServers() >= held }, 30*time.Second, 5*time.Millisecond,
		"the proxy never delivered what it held")
	// The server stores or refuses them within moments: none may become a second copy.
	s, err := b.js.Stream(ctx, "AGENT_TURNS")
	require.NoError(t, err)
	require.Never(t, func() bool {
		info, err := s.Info(ctx)
		if err != nil {
			return false // a replicated stream's API may not answer for a moment
		}
		fences, err := streamFences(ctx, s)
		return err == nil && info.State.Msgs-fences > uint64(len(want))
	}, 2*time.Second, 100*time.Millisecond, "relay A's late publishes were stored")
	assertExactlyOnceInOrder(t, b.readStream(t, "AGENT_TURNS"), want)
}
