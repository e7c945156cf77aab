package relay_test

import (
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/batonhq/baton/internal/opsserver"
	"github.com/batonhq/baton/internal/testsvc"
	"github.com/batonhq/baton/relay"
)

// The events in flight are bounded in bytes as well as in count: an outcome may be as large
// as the server's max payload, so MaxInFlight alone (8192 events) would let a relay behind a
// stalled NATS hold gigabytes. Here NATS is frozen while 300 replies of 1 MB are committed:
// the relay must stop reading once MaxInFlightBytes are outstanding (the walsender then
// waits on TCP), stay under half the 512Mi memory limit of relay-deployment.yaml, and
// deliver every reply once NATS is back. On the code that bounded only the count, the
// walsender sent everything and the relay held it all (seen: 735 MiB for 600 replies).
func TestInFlightIsBoundedInBytes(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := ctxT(t, 6*time.Minute)
	createConversations(t, b.db.Pool, "c")
	natsProxy := testsvc.StartProxy(t, strings.TrimPrefix(b.nats.URL(), "nats://"))
	// The first event's fence write waits on the frozen NATS: with the default --ack-timeout
	// (10s) the session ends then, and in CI beside other packages the relay had not yet read a
	// full window by that time (seen: the sync point below never held). A minute keeps the
	// session, and its window, alive long enough; not much longer, since a publish lost in a
	// reconnect of nats.go meanwhile is sent again only by the session after it.
	p := b.startAdvProcess(t, b.cfg.DatabaseURL, "nats://"+natsProxy.Addr(), "--metrics-addr", opsserver.AnyPort, "--ack-timeout", "1m")
	addr := p.metricsAddr(t)
	require.Eventually(t, func() bool { return p.logged("msg=streaming") }, time.Minute, 20*time.Millisecond, "relay never streamed")
	const limit = 256 << 20

	natsProxy.Freeze()
	t.Cleanup(natsProxy.Unfreeze)
	const n = 300
	_, err := b.db.Pool.Exec(ctx, `INSERT INTO messages (id, conversation_id, role, content)
		SELECT 'r' || g, 'c', 'assistant', repeat(chr(97 + g % 26), 1000000) FROM generate_series(1, $1) g`, n)
	require.NoError(t, err)
	target := walInsertLSN(t, b)
	// Sync point: either the walsender sent the relay everything (bar what sits in socket
	// buffers), or the relay holds a full window and stopped reading.
	full := float64(relay.DefaultMaxInFlightBytes) * 7 / 8
	require.Eventually(t, func() bool {
		if _, body := httpGet(t, "http://"+addr+"/metrics"); gauge(body, "baton_relay_in_flight_bytes") >= full {
			return true
		}
		var sent bool
		err := b.db.Pool.QueryRow(ctx, `SELECT coalesce(bool_or(r.sent_lsn >= $1::pg_lsn), false)
			FROM pg_stat_replication r JOIN pg_replication_slots s ON s.active_pid = r.pid
			WHERE s.slot_name = $2`, target.String(), b.cfg.Slot).Scan(&sent)
		return err == nil && sent
	}, 90*time.Second, 20*time.Millisecond, "the relay neither filled its window nor received every reply")
	hwm := peakRSS(t, p.cmd.Process.Pid)
	natsProxy.Unfreeze()
	// Counted, not read: 300 MB would overrun the test's own subscription. Nats-Msg-Id
	// deduplication makes the count exact.
	require.Equal(t, uint64(n), b.waitStreamCount(t, "AGENT_OUTCOMES", n, 3*time.Minute))
	hwm = max(hwm, peakRSS(t, p.cmd.Process.Pid))
	t.Logf("peak RSS %d MiB", hwm>>20)
	require.Less(t, hwm, int64(limit), "peak RSS %d MiB with %d outcomes of 1 MB behind a stalled NATS", hwm>>20, n)
	requireSlotCaughtUp(t, b)
}

// gauge returns the value of an unlabelled metric in a Prometheus text exposition, or -1.
func gauge(body, name string) float64 {
	m := regexp.MustCompile(`(?m)^` + regexp.QuoteMeta(name) + ` (\S+)$`).FindStringSubmatch(body)
	if m == nil {
		return -1
	}
	v, err := strconv.ParseFloat(m[1], 64)
	if err != nil {
		return -1
	}
	return v
}
