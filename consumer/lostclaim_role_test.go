package consumer

// A claim whose answer was lost, handed back by a worker logged in as roles.sql's
// baton_worker: the role deletes nothing, so handing back must not need DELETE.

import (
	"context"
	"log/slog"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	dto "github.com/prometheus/client_model/go"
	"github.com/stretchr/testify/require"

	"github.com/batonhq/baton/internal/testsvc"
)

// workerViaProxy returns a one-connection pool logged in as db's roles.sql worker role that
// connects through a fault-injecting TCP proxy (as viaProxy does for the admin).
func workerViaProxy(t *testing.T, db *testsvc.Database) (*pgxpool.Pool, *testsvc.Proxy) {
	t.Helper()
	proxy, proxied := testsvc.ProxyPostgres(t, db.RoleURL(testsvc.RoleWorker))
	cfg, err := pgxpool.ParseConfig(proxied)
	require.NoError(t, err)
	role := cfg.ConnConfig.User
	// No liveness ping on acquire: the fault must hit the statement under test, not a ping.
	cfg.ShouldPing = func(context.Context, pgxpool.ShouldPingParams) bool { return false }
	cfg.MaxConns = 1
	pool, err := pgxpool.NewWithConfig(context.Background(), cfg)
	require.NoError(t, err)
	t.Cleanup(pool.Close)
	var user string
	require.NoError(t, pool.QueryRow(context.Background(), "SELECT current_user").Scan(&user))
	require.Equal(t, role, user)
	return pool, proxy
}

// waitFired waits for a proxy fault to fire.
func waitFired(t *testing.T, fired <-chan struct{}) {
	t.Helper()
	select {
	case <-fired:
	case <-time.After(10 * time.Second):
		t.Fatal("the fault never fired")
	}
}

// Was: unclaim deleted the lost claim's run records, which baton_worker may not: the DELETE
// failed, took the rows' release with it (one transaction), and the error was dropped. The rows
// stayed processing under a run nobody runs until the lease ended, an attempt spent that no
// handler used. As baton_worker, the rows are pending again at once with the attempt refunded,
// and the run's record says it was released.
func TestLostClaimIsHandedBackAsWorkerRole(t *testing.T) {
	ctx := context.Background()
	db, s := storeFixture(t)
	conversations(t, db, "warm")
	send(t, db, "warm", "w1")
	send(t, db, "c", "m1", "m2")
	pool, proxy := workerViaProxy(t, db)
	s.pool = pool
	s.lostClaims = newMetrics(nil).lostClaims
	claimOne(t, s, "warm", "00000000-0000-4000-8000-0000000028a0") // prepares the statements

	const run = "00000000-0000-4000-8000-0000000028a1"
	fired := proxy.DropNextResponse()
	_, err := s.claimMany(ctx, []claimReq{{"c", run}})
	waitFired(t, fired)
	require.Error(t, err)
	t.Logf("rows of c: %v", testsvc.Query[string](t, db,
		`SELECT status || ' ' || attempts || ' ' || coalesce(run_id::text, '-') FROM agent_outbox WHERE conversation_id = 'c' ORDER BY id`))
	require.Equal(t, []string{"pending 0", "pending 0"}, testsvc.Query[string](t, db,
		`SELECT status || ' ' || attempts FROM agent_outbox WHERE conversation_id = 'c' ORDER BY id`),
		"the lost claim's rows are handed back at once, the attempt no handler used refunded")
	require.Equal(t, []string{"released"}, testsvc.Query[string](t, db,
		`SELECT coalesce(outcome, 'open') FROM agent_runs WHERE run_id = $1 AND finished_at IS NOT NULL`, run),
		"the run's record stays, ended as released")
	var handedBack dto.Metric
	require.NoError(t, s.lostClaims.WithLabelValues("handed_back").Write(&handedBack))
	require.Equal(t, 1.0, handedBack.GetCounter().GetValue())

	// The rows are claimable again, for one attempt in all.
	c := claimOne(t, s, "c", "00000000-0000-4000-8000-0000000028a2")
	require.Len(t, c.ids, 2)
	require.Equal(t, 1, c.attempts)
}

// Was: after a shared claim's lost answer, the hand back failed as above, so the fallback's
// per-conversation claims found every conversation busy (its rows still processing under the
// lost run) and claimed nothing: up to 32 conversations waited for the lease, an attempt spent.
// As baton_worker, each conversation is claimed again at once, for one attempt in all.
func TestLostSharedClaimIsClaimedAgainAsWorkerRole(t *testing.T) {
	ctx := context.Background()
	db, s := storeFixture(t)
	conversations(t, db, "warm", "d")
	send(t, db, "warm", "w1")
	send(t, db, "c", "m1")
	send(t, db, "d", "d1")
	pool, proxy := workerViaProxy(t, db)
	s.pool = pool
	claimOne(t, s, "warm", "00000000-0000-4000-8000-0000000028b0")

	lost := []string{"00000000-0000-4000-8000-0000000028b1", "00000000-0000-4000-8000-0000000028b2"}
	fired := proxy.DropNextResponse()
	out, err := s.claimMany(ctx, []claimReq{{"c", lost[0]}, {"d", lost[1]}})
	waitFired(t, fired)
	require.NoError(t, err)
	t.Logf("rows: %v", testsvc.Query[string](t, db,
		`SELECT conversation_id || ':' || status || ' ' || attempts || ' ' || coalesce(run_id::text, '-')
		 FROM agent_outbox WHERE conversation_id IN ('c', 'd') ORDER BY 1`))
	require.NotEmpty(t, out[0].ids, "the per-conversation claim of c took nothing")
	require.NotEmpty(t, out[1].ids, "the per-conversation claim of d took nothing")
	require.Equal(t, []string{"c:processing 1", "d:processing 1"}, testsvc.Query[string](t, db,
		`SELECT conversation_id || ':' || status || ' ' || attempts FROM agent_outbox WHERE conversation_id IN ('c', 'd') ORDER BY 1`))
	// Each conversation's rows are its new run's, which the caller got; the lost runs ended.
	for i, conv := range []string{"c", "d"} {
		require.NotEqual(t, lost[i], out[i].runID)
		require.Equal(t, []string{out[i].runID}, testsvc.Query[string](t, db,
			`SELECT DISTINCT run_id::text FROM agent_outbox WHERE conversation_id = $1`, conv))
	}
	require.Equal(t, []string{"released", "released"}, testsvc.Query[string](t, db,
		`SELECT coalesce(outcome, 'open') FROM agent_runs WHERE run_id = ANY($1::uuid[]) ORDER BY run_id`, lost))
}

// A hand back that fails is never silent: it is logged and counted, for every run it could not
// reach. Here a trigger of the database's owner refuses every update of a run record, so handing
// back fails (and is not retried: the failure is not transient); the claim's rows stay
// processing until their lease ends.
func TestLostClaimHandBackFailureIsLoggedAndCounted(t *testing.T) {
	ctx := context.Background()
	db, s := storeFixture(t)
	conversations(t, db, "warm")
	send(t, db, "warm", "w1")
	send(t, db, "c", "m1")
	pool, proxy := workerViaProxy(t, db)
	_, err := db.Pool.Exec(ctx, `
		CREATE FUNCTION refuse_run_updates() RETURNS trigger LANGUAGE plpgsql AS $$
		BEGIN RAISE EXCEPTION 'run records are read-only today'; END $$;
		CREATE TRIGGER refuse_run_updates BEFORE UPDATE ON agent_runs FOR EACH ROW EXECUTE FUNCTION refuse_run_updates()`)
	require.NoError(t, err)
	s.pool = pool
	var logs testsvc.Buffer
	s.log = slog.New(slog.NewTextHandler(&logs, nil))
	s.lostClaims = newMetrics(nil).lostClaims
	claimOne(t, s, "warm", "00000000-0000-4000-8000-0000000028c0")

	const run = "00000000-0000-4000-8000-0000000028c1"
	fired := proxy.DropNextResponse()
	_, err = s.claimMany(ctx, []claimReq{{"c", run}})
	waitFired(t, fired)
	require.Error(t, err)
	t.Logf("log: %s", logs.String())
	require.Contains(t, logs.String(), "hand back a claim whose answer was lost")
	require.Contains(t, logs.String(), run)
	require.Contains(t, logs.String(), "run records are read-only today")
	count := func(result string) float64 {
		var m dto.Metric
		require.NoError(t, s.lostClaims.WithLabelValues(result).Write(&m))
		return m.GetCounter().GetValue()
	}
	require.Equal(t, 1.0, count("failed"))
	require.Zero(t, count("handed_back"))
	require.Equal(t, []string{"processing"}, testsvc.Query[string](t, db,
		`SELECT status FROM agent_outbox WHERE conversation_id = 'c'`))
}
