package relay_test

import (
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"

	"github.com/batonhq/baton/relay"
)

// The first start's statements (recording the slot, dropping a stale one, creating it, the
// backfill's pages) run under deadlines like every other setup step. Without them a path that
// freezes there (the proxy here, after the INSERT had to wait for a lock) hangs the session
// for ever: there is no stream yet to check for liveness, and /healthz stays 200, so nothing
// restarts a lone relay.
func TestFirstStartStatementsHaveDeadlines(t *testing.T) {
	t.Parallel()
	b := setup(t)
	reg := prometheus.NewRegistry()
	b.cfg.Registerer = reg
	b.cfg.SetupTimeout = 2 * time.Second
	ctx := ctxT(t, 2*time.Minute)
	proxy, viaProxy := proxied(t, b.cfg.DatabaseURL)
	b.cfg.DatabaseURL = viaProxy

	lock, err := b.db.Pool.Begin(ctx)
	require.NoError(t, err)
	t.Cleanup(func() { _ = lock.Rollback(ctx) })
	_, err = lock.Exec(ctx, `LOCK TABLE baton_relay_slots IN SHARE MODE`) // readSlot's SELECT passes, the INSERT waits
	require.NoError(t, err)
	r := b.start(t)
	t.Cleanup(proxy.Unfreeze) // runs before the relay's cleanup stops it
	require.Eventually(t, func() bool {
		var n int
		err := b.db.Pool.QueryRow(ctx, `SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock'
			AND query LIKE '%INSERT INTO baton_relay_slots%'`).Scan(&n)
		return err == nil && n == 1
	}, 30*time.Second, 20*time.Millisecond, "the relay never reached its first-start INSERT")
	proxy.Freeze()
	require.NoError(t, lock.Commit(ctx)) // the INSERT completes; its answer is held on the path

	require.Eventually(t, func() bool { return counter(t, reg, "baton_relay_reconnects_total", "") >= 1 },
		b.cfg.SetupTimeout+20*time.Second, 50*time.Millisecond,
		"the first-start session hangs on a frozen path: no deadline on its setup statements")
	require.False(t, r.Active())
}

// A stream whose NoAck is set fails the relay with ErrSetup naming the setting, also when it
// is changed while the relay runs: streams are checked once per Run, and again after an ack
// timeout of events nats.go took without blocking. Checked only once, every session would end
// with an ack timeout and start again, for ever.
func TestStreamChangedToNoAckWhileRunningFailsSetup(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := ctxT(t, 2*time.Minute)
	createConversations(t, b.db.Pool, "c")
	r, done := b.run(t)
	require.Eventually(t, r.Active, time.Minute, 5*time.Millisecond)
	st, err := b.js.Stream(ctx, "AGENT_TURNS")
	require.NoError(t, err)
	sc := st.CachedInfo().Config
	sc.NoAck = true
	_, err = b.js.UpdateStream(ctx, sc)
	require.NoError(t, err)
	_, err = send(ctx, b.db.Pool, "c", "m1")
	require.NoError(t, err)
	select {
	case err := <-done:
		done <- err // for the cleanup
		require.ErrorIs(t, err, relay.ErrSetup)
		require.ErrorContains(t, err, "no_ack")
	case <-time.After(5*b.cfg.AckTimeout + 10*time.Second):
		t.Fatal("the relay loops on ack timeouts instead of failing with the stream's no_ack setting")
	}
}
