package relay_test

import (
	"context"
	"encoding/json"
	"net/url"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"

	"github.com/batonhq/baton/internal/testsvc"
	"github.com/batonhq/baton/relay"
	"github.com/batonhq/baton/wire"
)

// A NATS server that stops reading (a stalled server, a path that drops everything and keeps
// the socket open) fills nats.go's write buffer and then the socket, and PublishMsg blocks
// holding the connection's lock for as long as FlusherTimeout allows (a minute by default).
// None of that may reach the relay's own loop: it keeps sending status updates to Postgres,
// notices the missing PubAcks within AckTimeout, and stops at once when told to.
//
// Both ways of publishing: event by event, where the publishes fill the socket and block, and in
// fast-ingest batches, where the first message of a batch waits for its answer.
func TestStalledNATSBlocksNeitherStatusUpdatesNorShutdown(t *testing.T) {
	for _, classic := range []bool{false, true} {
		t.Run(map[bool]string{false: "batched", true: "classic"}[classic], func(t *testing.T) {
			t.Parallel()
			stalledNATS(t, classic)
		})
	}
}

func stalledNATS(t *testing.T, classic bool) {
	b := setup(t)
	b.cfg.ClassicPublish = classic
	ctx := ctxT(t, 3*time.Minute)
	// A write to a stalled peer may block for the FlusherTimeout; unfreezing runs before
	// nc.Close, which waits for a write in progress.
	proxy, nc := b.proxiedNATS(t, nats.FlusherTimeout(5*time.Minute))
	t.Cleanup(proxy.Unfreeze)
	reg := prometheus.NewRegistry()
	b.cfg.NATS = nc
	b.cfg.Registerer = reg
	b.cfg.DrainTimeout = time.Second

	r, err := relay.New(b.cfg)
	require.NoError(t, err)
	runCtx, stop := context.WithCancel(context.Background())
	defer stop()
	done := make(chan error, 1)
	go func() { done <- r.Run(runCtx) }()
	require.Eventually(t, r.Active, time.Minute, 5*time.Millisecond, "relay never became active")

	// Replies far larger than every buffer between the relay and the server (nats.go's, both
	// sockets', the proxy's): one outcome each, each on its own subject, so all are published
	// at once.
	const replies, size = 80, 400 << 10
	convs := make([]string, replies)
	for i := range convs {
		convs[i] = "c" + strconv.Itoa(i)
	}
	createConversations(t, b.db.Pool, convs...)
	proxy.Freeze()
	frozen := time.Now()
	_, err = b.db.Pool.Exec(ctx, `INSERT INTO messages (id, conversation_id, role, content)
		SELECT 'r' || c, c, 'assistant', $2 FROM unnest($1::text[]) c`, convs, strings.Repeat("x", size))
	require.NoError(t, err)

	// The ack-timeout check runs: the session ends for want of PubAcks.
	require.Eventually(t, func() bool { return counter(t, reg, "baton_relay_errors_total", "publish") >= 1 },
		b.cfg.AckTimeout+10*time.Second, 50*time.Millisecond,
		"no ack timeout while the publish is stuck in a full socket")
	// Status updates keep reaching Postgres after the stall began.
	require.Eventually(t, func() bool {
		var reply time.Time
		err := b.db.Pool.QueryRow(ctx, `SELECT coalesce(max(s.reply_time), 'epoch')
			FROM pg_stat_replication s JOIN pg_replication_slots r ON r.active_pid = s.pid
			WHERE r.slot_name = $1`, b.cfg.Slot).Scan(&reply)
		return err == nil && reply.After(frozen.Add(3*time.Second))
	}, 20*time.Second, 50*time.Millisecond, "no standby status update reached Postgres during the stall")

	// SIGTERM's path: Run returns within the drain timeout, not when the write gives up.
	stop()
	select {
	case err := <-done:
		require.NoError(t, err)
	case <-time.After(b.cfg.DrainTimeout + 10*time.Second):
		t.Fatal("Run did not return while a publish was stuck")
	}

	// Once NATS reads again, a relay delivers every reply once.
	proxy.Unfreeze()
	b.cfg.NATS = b.nc
	b.cfg.Registerer = nil
	b.start(t)
	msgs := b.waitStream(t, "AGENT_OUTCOMES", replies, time.Minute)
	seen := map[string]int{}
	for _, m := range msgs {
		var ev wire.OutcomeEvent
		require.NoError(t, json.Unmarshal(m.data, &ev))
		seen[ev.MessageID]++
	}
	require.Len(t, seen, replies)
	for id, n := range seen {
		require.Equal(t, 1, n, "reply %s stored %d times", id, n)
	}
}

// proxiedNATS returns a TCP proxy in front of the bundle's NATS server and a connection through
// it that reconnects for ever, closed when the test ends (register proxy.Unfreeze after it, so
// that it runs first).
func (b *bundle) proxiedNATS(t *testing.T, opts ...nats.Option) (*testsvc.Proxy, *nats.Conn) {
	t.Helper()
	u, err := url.Parse(b.nats.URL())
	require.NoError(t, err)
	proxy := testsvc.StartProxy(t, u.Host)
	opts = append([]nats.Option{nats.MaxReconnects(-1), nats.ReconnectWait(50 * time.Millisecond)}, opts...)
	nc, err := nats.Connect("nats://"+proxy.Addr(), opts...)
	require.NoError(t, err)
	t.Cleanup(nc.Close)
	return proxy, nc
}
