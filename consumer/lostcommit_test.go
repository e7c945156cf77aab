package consumer

import (
	"context"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/batonhq/baton/internal/testsvc"
)

// viaProxy returns a pool on db that connects through a fault-injecting TCP proxy.
func viaProxy(t *testing.T, db *testsvc.Database) (*pgxpool.Pool, *testsvc.Proxy) {
	t.Helper()
	proxy, proxied := testsvc.ProxyPostgres(t, db.URL)
	cfg, err := pgxpool.ParseConfig(proxied)
	require.NoError(t, err)
	// No liveness ping on acquire: the fault must hit the statement under test, not a ping.
	cfg.ShouldPing = func(context.Context, pgxpool.ShouldPingParams) bool { return false }
	cfg.MaxConns = 1
	pool, err := pgxpool.NewWithConfig(context.Background(), cfg)
	require.NoError(t, err)
	t.Cleanup(pool.Close)
	return pool, proxy
}

// A final commit whose answer is lost (the connection dropped after Postgres
// committed) is recognised by its reply id: reported as committed, not as a lost lease, and
// not committed twice.
func TestFinishWhoseAnswerWasLost(t *testing.T) {
	ctx := context.Background()
	db, s := storeFixture(t)
	conversations(t, db, "warm")
	send(t, db, "warm", "w1")
	send(t, db, "c", "m1")
	const run = "00000000-0000-4000-8000-000000000052"
	c := claimOne(t, s, "c", run)
	pool, proxy := viaProxy(t, db)
	s.pool = pool
	// A first final commit on the pool's one connection prepares the statements, so the fault
	// below hits the commit itself, not a round trip that prepares it.
	const warm = "00000000-0000-4000-8000-000000000053"
	w := claimOne(t, s, "warm", warm)
	require.NoError(t, s.finishOne(ctx, finishReq{conversationID: "warm", runID: warm, ids: w.ids,
		outcome: outcome{role: "assistant", content: "warm"}}))

	fired := proxy.DropNextResponse()
	err := s.finishOne(ctx, finishReq{conversationID: "c", runID: run, ids: c.ids, outcome: outcome{role: "assistant", content: "ok"}})
	select {
	case <-fired:
	case <-time.After(10 * time.Second):
		t.Fatal("the fault never fired")
	}
	require.NoError(t, err, "a commit that happened is reported as such")
	require.Equal(t, []string{"done"}, testsvc.Query[string](t, db, `SELECT status FROM agent_outbox WHERE conversation_id = 'c'`))
	require.Equal(t, []string{"ok"}, testsvc.Query[string](t, db, `SELECT content FROM messages WHERE role = 'assistant' AND conversation_id = 'c'`))
}

// A claim whose answer is lost (the connection dropped after the claim committed) hands its
// rows back at once, attempt refunded and run record ended as released, instead of leaving them
// processing under a run nobody runs until the lease ends.
func TestClaimWhoseAnswerWasLost(t *testing.T) {
	ctx := context.Background()
	db, s := storeFixture(t)
	conversations(t, db, "warm")
	send(t, db, "warm", "w1")
	send(t, db, "c", "m1")
	pool, proxy := viaProxy(t, db)
	s.pool = pool
	claimOne(t, s, "warm", "00000000-0000-4000-8000-000000000054") // prepares the statements

	fired := proxy.DropNextResponse()
	_, err := s.claimMany(ctx, []claimReq{{"c", "00000000-0000-4000-8000-000000000055"}})
	select {
	case <-fired:
	case <-time.After(10 * time.Second):
		t.Fatal("the fault never fired")
	}
	require.Error(t, err)
	require.Equal(t, []string{"pending 0"}, testsvc.Query[string](t, db,
		`SELECT status || ' ' || attempts FROM agent_outbox WHERE conversation_id = 'c'`))
	require.Equal(t, []string{"released"}, testsvc.Query[string](t, db,
		`SELECT coalesce(outcome, 'open') FROM agent_runs WHERE conversation_id = 'c' AND finished_at IS NOT NULL`),
		"no handler saw the run: its record ends as released (baton_worker deletes nothing)")
}
