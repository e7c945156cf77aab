package relay_test

import (
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"

	"github.com/batonhq/baton/internal/testsvc"
)

// proxied starts a TCP proxy to the test database's server and returns it with the database
// URL through it.
func proxied(t *testing.T, dbURL string) (*testsvc.Proxy, string) {
	t.Helper()
	return testsvc.ProxyPostgres(t, dbURL)
}

// setWalSenderTimeout sets wal_sender_timeout for the test's database: per-database settings
// apply to replication sessions too, so the test's cluster is unchanged for the others.
func setWalSenderTimeout(t *testing.T, b *bundle, d time.Duration) {
	t.Helper()
	_, err := b.db.Pool.Exec(ctxT(t, 30*time.Second), "ALTER DATABASE "+pgx.Identifier{b.db.Name}.Sanitize()+
		" SET wal_sender_timeout = '"+d.String()+"'")
	require.NoError(t, err)
}

// counter reads a counter (with the given label value, or none) from reg.
func counter(t *testing.T, reg *prometheus.Registry, name, label string) float64 {
	t.Helper()
	mfs, err := reg.Gather()
	require.NoError(t, err)
	for _, mf := range mfs {
		if mf.GetName() != name {
			continue
		}
		for _, m := range mf.GetMetric() {
			if label == "" || (len(m.GetLabel()) > 0 && m.GetLabel()[0].GetValue() == label) {
				return m.GetCounter().GetValue()
			}
		}
	}
	return 0
}

// A path that drops everything and keeps the socket open (a dead host behind a middlebox, a
// half-open connection) must not leave the relay "ready" for ever: it asks the walsender for
// a reply with every status update and reconnects when none came within max(3 × the status
// interval, 10s).
func TestFrozenReplicationPathReconnects(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := ctxT(t, 3*time.Minute)
	proxy, dbURL := proxied(t, b.cfg.DatabaseURL)
	reg := prometheus.NewRegistry()
	b.cfg.DatabaseURL = dbURL
	b.cfg.Registerer = reg
	b.cfg.SetupTimeout = 2 * time.Second
	createConversations(t, b.db.Pool, "c1", "c2")
	r := b.startActive(t)
	t.Cleanup(proxy.Unfreeze) // before the relay stops
	_, err := send(ctx, b.db.Pool, "c1", "before")
	require.NoError(t, err)
	b.waitStream(t, "AGENT_TURNS", 1, 30*time.Second)

	proxy.Freeze()
	frozen := time.Now()
	const bound = 10 * time.Second // max(3 × 100ms, 10s)
	require.Eventually(t, func() bool { return counter(t, reg, "baton_relay_reconnects_total", "") >= 1 },
		bound+10*time.Second, 50*time.Millisecond, "the relay never noticed that its replication stream went silent")
	took := time.Since(frozen)
	t.Logf("reconnect %v after the freeze", took.Round(time.Millisecond))
	require.GreaterOrEqual(t, took, bound, "silence shorter than the bound ended the stream")
	require.Equal(t, 1.0, counter(t, reg, "baton_relay_errors_total", "liveness"))
	require.False(t, r.Ready(), "a relay that cannot reach Postgres is not ready")

	// The path heals: the relay streams again, and nothing is lost or doubled.
	proxy.Unfreeze()
	_, err = send(ctx, b.db.Pool, "c2", "after")
	require.NoError(t, err)
	b.waitStream(t, "AGENT_TURNS", 2, time.Minute)
	assertExactlyOnceInOrder(t, b.readStream(t, "AGENT_TURNS"), truth(t, b.db.Pool))
}

// Silence alone is no signal: on an idle database the walsender sends nothing while the relay
// reports more often than half of wal_sender_timeout. The relay must not take that for a dead
// stream.
func TestIdleStreamDoesNotReconnect(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := ctxT(t, 3*time.Minute)
	const walSenderTimeout = 5 * time.Second
	setWalSenderTimeout(t, b, walSenderTimeout)
	reg := prometheus.NewRegistry()
	b.cfg.Registerer = reg
	b.cfg.StatusInterval = time.Second // the default: the walsender never needs a keepalive
	createConversations(t, b.db.Pool, "c")
	r := b.startActive(t)
	_, err := send(ctx, b.db.Pool, "c", "one")
	require.NoError(t, err)
	b.waitStream(t, "AGENT_TURNS", 1, 30*time.Second)

	select { // the subject of the test: nothing happens for 3 × wal_sender_timeout
	case <-time.After(3 * walSenderTimeout):
	case <-ctx.Done():
	}
	require.Zero(t, counter(t, reg, "baton_relay_reconnects_total", ""))
	require.Zero(t, counter(t, reg, "baton_relay_errors_total", "liveness"))
	require.True(t, r.Active())
}
