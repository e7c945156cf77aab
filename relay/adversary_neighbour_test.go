package relay_test

import (
	"context"
	"fmt"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/batonhq/baton/migrations"
)

// Adversarial review of issue 27 ("nothing a neighbour does stops it"): the first-start claim
// (claimFirstStart, migration 11) and the migrators' table lock.

// advOpenNeighbourTx opens a neighbour's transaction holding a transaction id: creating a
// slot waits for it. The returned function commits it.
func advOpenNeighbourTx(t *testing.T, b *bundle) func() {
	t.Helper()
	ctx := ctxT(t, 5*time.Minute)
	_, err := b.db.Pool.Exec(ctx, `CREATE TABLE IF NOT EXISTS adv_neighbour (id bigint)`)
	require.NoError(t, err)
	long, err := b.db.Pool.Begin(ctx)
	require.NoError(t, err)
	t.Cleanup(func() { _ = long.Rollback(context.Background()) })
	_, err = long.Exec(ctx, `INSERT INTO adv_neighbour VALUES (1)`)
	require.NoError(t, err)
	return func() { require.NoError(t, long.Commit(ctx)) }
}

// advClaimant returns the backend pid the slot's first-start claim names.
func advClaimant(t *testing.T, b *bundle) int32 {
	t.Helper()
	var pid *int32
	require.NoError(t, b.db.Pool.QueryRow(ctxT(t, 30*time.Second),
		`SELECT starter_pid FROM baton_relay_slots WHERE slot_name = $1`, b.cfg.Slot).Scan(&pid))
	require.NotNil(t, pid, "the first start was not claimed")
	return *pid
}

// advAwaitGone waits until no backend has pid.
func advAwaitGone(t *testing.T, b *bundle, pid int32) {
	t.Helper()
	require.Eventually(t, func() bool {
		var n int
		err := b.db.Pool.QueryRow(context.Background(), `SELECT count(*) FROM pg_stat_activity WHERE pid = $1`, pid).Scan(&n)
		return err == nil && n == 0
	}, time.Minute, 50*time.Millisecond, "backend %d never ended", pid)
}

// advKilledClaimant starts a relay (logged in as the relay role, whose URL it returns) whose
// first start waits on a neighbour's open transaction, with a row of backlog, kills it
// (kill -9) once it claimed the first start, commits the neighbour's transaction and waits
// until the claimant's backend is gone; it returns that backend's pid too.
func advKilledClaimant(t *testing.T, b *bundle) (string, int32) {
	t.Helper()
	ctx := ctxT(t, 4*time.Minute)
	url := b.cfg.DatabaseURL // roles.sql's relay role: neither a superuser nor in pg_read_all_stats
	createConversations(t, b.db.Pool, "c")
	_, err := send(ctx, b.db.Pool, "c", "backlog")
	require.NoError(t, err)
	commit := advOpenNeighbourTx(t, b)
	a := b.startAdvProcess(t, url, b.nats.URL())
	a.awaitLogged(t, "creating the slot waits for transactions")
	claimant := advClaimant(t, b)
	a.kill9(t)
	commit()
	advAwaitGone(t, b, claimant)
	return url, claimant
}

// Control: the claimant relay is killed (kill -9) during its first start, while creating the
// slot waits for a neighbour's transaction. Its backend ends with its socket, the claim is
// free, and a second relay finishes the first start and streams.
func TestAdvNeighbourKilledClaimantFreesTheFirstStart(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := ctxT(t, 4*time.Minute)
	url, _ := advKilledClaimant(t, b)

	second := b.startAdvProcess(t, url, b.nats.URL())
	require.Eventually(t, func() bool { return second.logged("msg=streaming") }, time.Minute, 50*time.Millisecond,
		"the second relay never streamed after the claimant was killed")
	_, err := send(ctx, b.db.Pool, "c", "after")
	require.NoError(t, err)
	b.waitStream(t, "AGENT_TURNS", 2, time.Minute)
}

// The claimant relay dies during its first start (kill -9), and its backend's pid is then
// reused by a backend the relay's role may not see the start time of: another role's client
// backend, or an auxiliary process. That is what a Postgres restart leaves when pids start
// over (a Postgres container restarts its pid namespace at 1, and the checkpointer and the
// application's pool take the low pids again) or when pids wrap (pid_max is 32768 on this
// machine). claimFirstStart counts any live pid whose backend_start it cannot read as the
// claimant, so every relay stands by for as long as that backend lives: for the
// checkpointer, until the next restart.
//
// A test cannot pick the pid a backend gets, so the reuse is staged: after the real claimant's
// backend is gone, the claim's pid is set to the reusing backend's (the start time stays the
// dead claimant's).
func TestAdvNeighbourReusedClaimantPidHoldsTheFirstStartForEver(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name  string
		reuse func(t *testing.T, b *bundle) int32
	}{
		{"checkpointer", func(t *testing.T, b *bundle) int32 {
			var pid int32
			require.NoError(t, b.db.Pool.QueryRow(context.Background(),
				`SELECT pid FROM pg_stat_activity WHERE backend_type = 'checkpointer'`).Scan(&pid))
			return pid
		}},
		{"neighbour's connection", func(t *testing.T, b *bundle) int32 {
			role := b.db.Name + "_advapp"
			_, err := b.db.Pool.Exec(context.Background(), `CREATE ROLE `+role+` LOGIN`)
			require.NoError(t, err)
			t.Cleanup(func() { _, _ = b.db.Pool.Exec(context.Background(), `DROP ROLE IF EXISTS `+role) })
			c, err := pgx.Connect(context.Background(), strings.Replace(b.db.URL, "postgres@", role+"@", 1))
			require.NoError(t, err)
			t.Cleanup(func() { _ = c.Close(context.Background()) })
			var pid int32
			require.NoError(t, c.QueryRow(context.Background(), `SELECT pg_backend_pid()`).Scan(&pid))
			return pid
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			b := setup(t)
			ctx := ctxT(t, 4*time.Minute)
			url, claimant := advKilledClaimant(t, b)

			reused := tc.reuse(t, b)
			_, err := b.db.Pool.Exec(ctx, `UPDATE baton_relay_slots SET starter_pid = $2 WHERE slot_name = $1`, b.cfg.Slot, reused)
			require.NoError(t, err)
			t.Logf("the dead claimant's backend was pid %d; pid %d (%s) now has that number", claimant, reused, tc.name)

			second := b.startAdvProcess(t, url, b.nats.URL())
			ok := assertEventually(func() bool { return second.logged("msg=streaming") }, 75*time.Second)
			require.True(t, ok, "the claimant died; the relay must finish the first start, yet it stands by for as long as "+
				"pid %d (%s, its backend_start hidden from the relay's role) lives (standing by: %v)",
				reused, tc.name, second.logged("another relay runs its first start"))
		})
	}
}

// The claimant relay's host vanishes during its first start, behind a path that keeps its
// sockets open (the proxy frozen, the process stopped): the situation the streaming takeover
// test (TestStandbyTakesOverFromAVanishedHost) bounds by wal_sender_timeout. Its backends never
// learn, so its claim never ends, and the standby never takes the first start over: the
// claim has no liveness of its own (the advisory lock it replaced had StaleLockAfter).
func TestAdvNeighbourVanishedFirstStartClaimantHoldsStandbysForEver(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := ctxT(t, 4*time.Minute)
	const walSenderTimeout = 3 * time.Second
	setWalSenderTimeout(t, b, walSenderTimeout)
	createConversations(t, b.db.Pool, "c")
	_, err := send(ctx, b.db.Pool, "c", "backlog")
	require.NoError(t, err)
	commit := advOpenNeighbourTx(t, b)
	proxy, viaProxy := proxied(t, b.cfg.DatabaseURL)

	a := b.startHAProcess(t, viaProxy)
	a.awaitLogged(t, "creating the slot waits for transactions")
	claimant := advClaimant(t, b)
	proxy.Freeze()
	require.NoError(t, a.cmd.Process.Signal(syscall.SIGSTOP))
	t.Cleanup(proxy.Unfreeze)
	vanished := time.Now()
	commit() // the slot's creation completes; the vanished relay never hears of it

	standby := b.startHAProcess(t, b.cfg.DatabaseURL)
	within := walSenderTimeout + 10*time.Second + 30*time.Second
	ok := assertEventually(func() bool { return standby.logged("msg=streaming") }, within+30*time.Second)
	var alive int
	_ = b.db.Pool.QueryRow(ctx, `SELECT count(*) FROM pg_stat_activity WHERE pid = $1`, claimant).Scan(&alive)
	var slotActive, done bool
	_ = b.db.Pool.QueryRow(ctx, `SELECT s.active, r.backfill_done FROM pg_replication_slots s
		JOIN baton_relay_slots r USING (slot_name) WHERE slot_name = $1`, b.cfg.Slot).Scan(&slotActive, &done)
	require.True(t, ok, "the standby did not take over the first start within %s of the claimant's host vanishing "+
		"(waited %s; the slot exists, active: %v, backfill done: %v; the claimant's backend %d still alive: %v)",
		within, time.Since(vanished).Round(time.Second), slotActive, done, claimant, alive == 1)
}

// assertEventually polls cond every 100ms for at most d.
func assertEventually(cond func() bool, d time.Duration) bool {
	deadline := time.Now().Add(d)
	for time.Now().Before(deadline) {
		if cond() {
			return true
		}
		time.Sleep(100 * time.Millisecond)
	}
	return cond()
}

// Several `baton migrate` start at once on an empty database, into a schema that does not
// exist yet: each version is applied once, and every migrator succeeds.
func TestAdvNeighbourConcurrentMigratorsOnAnEmptyDatabase(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := ctxT(t, 3*time.Minute)
	name := b.db.Name + "_advempty"
	_, err := b.db.Pool.Exec(ctx, `CREATE DATABASE `+name)
	require.NoError(t, err)
	t.Cleanup(func() { _, _ = b.db.Pool.Exec(context.Background(), `DROP DATABASE IF EXISTS `+name+` WITH (FORCE)`) })
	url := strings.Replace(b.db.URL, "/"+b.db.Name, "/"+name, 1)

	for _, schema := range []string{"public", "adv_new_schema"} {
		const migrators = 6
		var wg sync.WaitGroup
		errs := make([]error, migrators)
		applied := make([][]int, migrators)
		start := make(chan struct{})
		for i := range migrators {
			wg.Add(1)
			go func() {
				defer wg.Done()
				conn, err := pgx.Connect(ctx, url)
				if err != nil {
					errs[i] = err
					return
				}
				defer func() { _ = conn.Close(context.Background()) }()
				<-start
				applied[i], errs[i] = migrations.UpWith(ctx, conn, migrations.Options{Schema: schema, Publication: "adv_" + schema})
			}()
		}
		close(start)
		wg.Wait()
		count := map[int]int{}
		for i := range migrators {
			require.NoError(t, errs[i], "migrator %d into %s", i, schema)
			for _, v := range applied[i] {
				count[v]++
			}
		}
		for v := 1; v <= migrations.Latest(); v++ {
			require.Equal(t, 1, count[v], "version %d into %s applied %d times", v, schema, count[v])
		}
	}
}

// EnsureShards before any migration fails with a message naming `baton migrate`, and creates
// nothing.
func TestAdvNeighbourEnsureShardsBeforeMigrate(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := ctxT(t, time.Minute)
	name := b.db.Name + "_advnoschema"
	_, err := b.db.Pool.Exec(ctx, `CREATE DATABASE `+name)
	require.NoError(t, err)
	t.Cleanup(func() { _, _ = b.db.Pool.Exec(context.Background(), `DROP DATABASE IF EXISTS `+name+` WITH (FORCE)`) })
	conn, err := pgx.Connect(ctx, strings.Replace(b.db.URL, "/"+b.db.Name, "/"+name, 1))
	require.NoError(t, err)
	t.Cleanup(func() { _ = conn.Close(context.Background()) })
	_, err = migrations.EnsureShards(ctx, conn, migrations.ShardOptions{}, 2)
	require.Error(t, err)
	require.Contains(t, err.Error(), "baton migrate")
	var pubs int
	require.NoError(t, conn.QueryRow(ctx, `SELECT count(*) FROM pg_publication`).Scan(&pubs))
	require.Zero(t, pubs)
	_, _ = fmt.Fprintln(testWriter{t}, "EnsureShards before migrate:", err)
}

// A role that may only read baton_schema_migrations (baton_console's grant) runs migrate on a
// current schema: it must not hold anything back, and what it says is checked here.
func TestAdvNeighbourReadOnlyRoleRunsMigrate(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := ctxT(t, time.Minute)
	role := b.db.Name + "_advro"
	for _, stmt := range []string{`CREATE ROLE ` + role + ` LOGIN`, `GRANT SELECT ON baton_schema_migrations TO ` + role} {
		_, err := b.db.Pool.Exec(ctx, stmt)
		require.NoError(t, err)
	}
	t.Cleanup(func() {
		_, _ = b.db.Pool.Exec(context.Background(), `DROP OWNED BY `+role)
		_, _ = b.db.Pool.Exec(context.Background(), `DROP ROLE IF EXISTS `+role)
	})
	conn, err := pgx.Connect(ctx, strings.Replace(b.db.URL, "postgres@", role+"@", 1))
	require.NoError(t, err)
	t.Cleanup(func() { _ = conn.Close(context.Background()) })
	// It holds ACCESS SHARE (all SELECT allows) in an open transaction beside a real migrator.
	tx, err := conn.Begin(ctx)
	require.NoError(t, err)
	_, err = tx.Exec(ctx, `LOCK TABLE baton_schema_migrations IN ACCESS SHARE MODE`)
	require.NoError(t, err)
	mctx, cancel := context.WithTimeout(ctx, 20*time.Second)
	defer cancel()
	_, err = migrations.Up(mctx, b.db.Pool)
	require.NoError(t, err, "the owner's migrate waited for a reader's ACCESS SHARE")
	require.NoError(t, tx.Rollback(ctx))
	_, err = migrations.Up(ctx, conn)
	_, _ = fmt.Fprintln(testWriter{t}, "read-only role runs migrate on a current schema:", err)
}
