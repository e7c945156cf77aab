package consumer

// Rows and timing that Baton never writes itself but that a database role or an application
// can produce: none of them may stop a worker, strand another conversation's claim, or switch
// the fence off.

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/batonhq/baton/internal/testsvc"
)

const (
	hostileRunA = "00000000-0000-4000-8000-00000000aa01"
	hostileRunB = "00000000-0000-4000-8000-00000000bb01"
	hostileRunC = "00000000-0000-4000-8000-00000000cc01"
)

// claimedPair gives conversations a and b one message each, claimed by runA and runB.
func claimedPair(t *testing.T, runA, runB string) (db *testsvc.Database, s *store, ca, cb claim) {
	t.Helper()
	db, s = storeFixture(t)
	conversations(t, db, "a", "b")
	send(t, db, "a", "a-m1")
	send(t, db, "b", "b-m1")
	return db, s, claimOne(t, s, "a", runA), claimOne(t, s, "b", runB)
}

// runWorker runs w until the test ends.
func runWorker(t *testing.T, w *Worker) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- w.Run(ctx) }()
	t.Cleanup(func() {
		cancel()
		require.NoError(t, <-done)
	})
}

func conversations(t *testing.T, db *testsvc.Database, ids ...string) {
	t.Helper()
	for _, id := range ids {
		_, err := db.Pool.Exec(context.Background(), `INSERT INTO conversations (id) VALUES ($1) ON CONFLICT DO NOTHING`, id)
		require.NoError(t, err)
	}
}

// A pending row with available_at = 'infinity' used to make the claim return a value the
// client could not scan, after the claim had committed: every batch-mate's rows were left
// processing under a run nobody ran. A non-finite available_at does not hold a row back.
func TestClaimWithInfiniteAvailableAt(t *testing.T) {
	ctx := context.Background()
	db, s := storeFixture(t)
	conversations(t, db, "bad", "good")
	send(t, db, "bad", "bad-m1")
	send(t, db, "good", "good-m1")
	_, err := db.Pool.Exec(ctx, `UPDATE agent_outbox SET available_at = 'infinity' WHERE conversation_id = 'bad'`)
	require.NoError(t, err)

	out, err := s.claimMany(ctx, []claimReq{{"bad", hostileRunA}, {"good", hostileRunB}})
	require.NoError(t, err)
	t.Logf("claim of good returned: ids=%v busy=%v locked=%v", out[1].ids, out[1].busy, out[1].locked)
	t.Logf("good's row in the database: %v", testsvc.Query[string](t, db,
		`SELECT status || ' run=' || coalesce(run_id::text, '-') || ' attempts=' || attempts FROM agent_outbox WHERE conversation_id = 'good'`))
	_, badErr := s.claimMany(ctx, []claimReq{{"bad", hostileRunC}})
	t.Logf("claim of bad alone: %v", badErr)
	// Either the claim returned good's rows to run, or it left them pending. Never both unseen.
	if len(out[1].ids) == 0 {
		require.Equal(t, []string{"pending"}, testsvc.Query[string](t, db,
			`SELECT status FROM agent_outbox WHERE conversation_id = 'good'`),
			"good's row was claimed by a run the caller never got: orphaned until the lease expires")
	}
	// And the bad conversation's own claim never settles: it fails on every try.
	require.NoError(t, badErr, "a conversation whose oldest row backs off 'forever' must not make its claim fail")
}

// Same with a message whose created_at no JSON decoder of time.Time accepts ('infinity', a year
// beyond 9999, a BC date): the batch-mates get their claims, and the odd message's claim comes
// back too, to be ended.
func TestClaimWithUndecodableCreatedAt(t *testing.T) {
	ctx := context.Background()
	db, s := storeFixture(t)
	conversations(t, db, "bad", "good")
	send(t, db, "bad", "bad-m1")
	send(t, db, "good", "good-m1")
	_, err := db.Pool.Exec(ctx, `UPDATE messages SET created_at = '10000-01-01' WHERE id = 'bad-m1'`)
	require.NoError(t, err)

	out, err := s.claimMany(ctx, []claimReq{{"bad", hostileRunA}, {"good", hostileRunB}})
	require.NoError(t, err)
	t.Logf("rows: %v", testsvc.Query[string](t, db,
		`SELECT conversation_id || ':' || status || ' run=' || coalesce(run_id::text, '-') FROM agent_outbox ORDER BY 1`))
	require.NotEmpty(t, out[1].ids,
		"good's row was claimed (processing under run %s) but the caller got nothing to run", hostileRunB)
	require.NotEmpty(t, out[0].ids, "the odd conversation's claim comes back, to be ended")
}

// A processing row with a NULL run_id (any role that may update the outbox can write it) used
// to make expiredRuns fail to scan, so recovery did nothing at all, on every worker: every
// other expired run kept its conversation busy for good. Such rows are recovered like a dead
// run of their own.
func TestRecoveryOfProcessingRowsWithoutARun(t *testing.T) {
	ctx := context.Background()
	db, s := storeFixture(t)
	conversations(t, db, "weird")
	send(t, db, "c", "m1")
	send(t, db, "weird", "w1")
	c := claimOne(t, s, "c", hostileRunA) // a run whose worker was killed
	require.Len(t, c.ids, 1)
	_, err := db.Pool.Exec(ctx, `UPDATE agent_outbox SET status = 'processing', run_id = NULL,
		lease_expires_at = now() - interval '1 hour' WHERE conversation_id = 'weird'`)
	require.NoError(t, err)
	expire(t, db)

	runs, err := s.expiredRuns(ctx, 1000)
	require.NoError(t, err, "one odd row stopped recovery")
	require.Len(t, runs, 2)
	for _, run := range runs {
		_, err := s.recoverRun(ctx, run)
		require.NoError(t, err)
	}
	require.Equal(t, []string{"c:pending", "weird:pending"}, testsvc.Query[string](t, db,
		`SELECT conversation_id || ':' || status FROM agent_outbox ORDER BY 1`))
}

// A pending row whose attempts is at the integer maximum used to make every claim of its
// conversation fail (integer out of range): stuck for good. It is claimed (and, being past
// every cap, fails visibly if its turn fails).
func TestAttemptsAtTheIntegerMaximum(t *testing.T) {
	ctx := context.Background()
	db, _ := storeFixture(t)
	send(t, db, "c", "m1")
	_, err := db.Pool.Exec(ctx, `UPDATE agent_outbox SET attempts = 2147483647`)
	require.NoError(t, err)
	send(t, db, "c", "m2")

	w, err := New(Config{Pool: db.RolePool(t, testsvc.RoleWorker), PollInterval: 20 * time.Millisecond, Debounce: time.Millisecond,
		Handler: func(context.Context, *Turn) (Reply, error) { return Reply{Content: "ok"}, nil }})
	require.NoError(t, err)
	runWorker(t, w)
	require.Eventually(t, func() bool {
		return scalar[int](t, db, `SELECT count(*) FROM agent_outbox WHERE status IN ('pending', 'processing')`) == 0
	}, 30*time.Second, 10*time.Millisecond, "the conversation is stuck: %v", testsvc.Query[string](t, db,
		`SELECT id || ':' || status || ' attempts=' || attempts FROM agent_outbox ORDER BY id`))
}

// The final commit's fence used to stand aside for the whole batch as soon as one
// conversation's update missed its row, trusting the foreign key to fail the statement. A
// conversation deleted and recreated with the same id (a "reset") while the batch waited on
// its row passed the foreign key, and a batch-mate whose rows another run held committed a
// second reply. The fence is per run now.
func TestFenceHoldsWhenABatchMatesConversationIsRecreated(t *testing.T) {
	ctx := context.Background()
	db, s, ca, cb := claimedPair(t, hostileRunA, hostileRunB)
	require.Len(t, ca.ids, 1)
	require.Len(t, cb.ids, 1)
	// b's run lost its lease: recovered and claimed again by run C, which is running.
	_, err := db.Pool.Exec(ctx, `UPDATE agent_outbox SET run_id = $1 WHERE conversation_id = 'b'`, hostileRunC)
	require.NoError(t, err)

	reset, err := db.Pool.Begin(ctx)
	require.NoError(t, err)
	defer func() { _ = reset.Rollback(ctx) }()
	_, err = reset.Exec(ctx, `DELETE FROM conversations WHERE id = 'a'`)
	require.NoError(t, err)
	_, err = reset.Exec(ctx, `INSERT INTO conversations (id) VALUES ('a')`)
	require.NoError(t, err)

	type result struct {
		errs []error
		err  error
	}
	res := make(chan result, 1)
	go func() {
		errs, err := s.finishMany(ctx, []finishReq{
			{conversationID: "a", runID: hostileRunA, ids: ca.ids, outcome: outcome{role: "assistant", content: "reply of A"}},
			{conversationID: "b", runID: hostileRunB, ids: cb.ids, outcome: outcome{role: "assistant", content: "stale reply of B"}},
		})
		res <- result{errs, err}
	}()
	require.Eventually(t, func() bool {
		return len(testsvc.Query[int](t, db, `SELECT pid FROM pg_stat_activity WHERE datname = current_database()
			AND wait_event_type = 'Lock' AND query LIKE '%pg_logical_emit_message%'`)) > 0
	}, 30*time.Second, 10*time.Millisecond)
	require.NoError(t, reset.Commit(ctx))
	r := <-res
	require.NoError(t, r.err)
	t.Logf("errs: %v", r.errs)
	t.Logf("replies: %v", testsvc.Query[string](t, db,
		`SELECT conversation_id || ': ' || content FROM messages WHERE role <> 'user' ORDER BY 1`))
	require.ErrorIs(t, r.errs[0], errLeaseLost, "run A's rows went with the old conversation")
	require.ErrorIs(t, r.errs[1], errLeaseLost, "run B lost its rows to run C: it must not commit")
	require.Zero(t, scalar[int](t, db, `SELECT count(*) FROM messages WHERE conversation_id = 'a' AND role = 'assistant'`),
		"the old turn's reply landed in the reset conversation")
	require.Zero(t, scalar[int](t, db, `SELECT count(*) FROM messages WHERE conversation_id = 'b' AND role = 'assistant'`),
		"the stale run B committed a reply while run C holds the turn")
}

// A conversation row held by another transaction (an application's long UPDATE, a frozen
// client holding a lock) used to stall the whole final-commit batch until the runner's
// deadline, failing every batch-mate. With lock_timeout the batch fails fast, is redone run by
// run, and only the held conversation's run fails.
func TestLockedConversationFailsOnlyItsOwnCommit(t *testing.T) {
	ctx := context.Background()
	db, s, ca, cb := claimedPair(t, hostileRunA, hostileRunB)

	app, err := db.Pool.Begin(ctx)
	require.NoError(t, err)
	defer func() { _ = app.Rollback(ctx) }()
	_, err = app.Exec(ctx, `SELECT 1 FROM conversations WHERE id = 'a' FOR UPDATE`)
	require.NoError(t, err)

	s.lockTimeout = 200 * time.Millisecond
	// The batcher's deadline.
	fctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	errs, err := s.finishMany(fctx, []finishReq{
		{conversationID: "a", runID: hostileRunA, ids: ca.ids, outcome: outcome{role: "assistant", content: "re a"}},
		{conversationID: "b", runID: hostileRunB, ids: cb.ids, outcome: outcome{role: "assistant", content: "re b"}},
	})
	require.NoError(t, err)
	require.Error(t, errs[0], "a's conversation row is held")
	require.NoError(t, errs[1])
	require.Equal(t, []string{"done"}, testsvc.Query[string](t, db, `SELECT status FROM agent_outbox WHERE conversation_id = 'b'`),
		"b's commit failed only because a's conversation row was locked by someone else")
}

// The fence holds for a batch-mate's lost rows when another conversation of the batch was
// deleted (not recreated): that run reports the deletion, the other the lost lease.
func TestFenceHoldsWhenAConversationIsDeleted(t *testing.T) {
	ctx := context.Background()
	db, s, ca, cb := claimedPair(t, hostileRunA, hostileRunB)
	_, err := db.Pool.Exec(ctx, `UPDATE agent_outbox SET run_id = $1 WHERE conversation_id = 'b'`, hostileRunC)
	require.NoError(t, err)
	_, err = db.Pool.Exec(ctx, `DELETE FROM conversations WHERE id = 'a'`)
	require.NoError(t, err)
	errs, err := s.finishMany(ctx, []finishReq{
		{conversationID: "a", runID: hostileRunA, ids: ca.ids, outcome: outcome{role: "assistant", content: "x"}},
		{conversationID: "b", runID: hostileRunB, ids: cb.ids, outcome: outcome{role: "assistant", content: "y"}},
	})
	require.NoError(t, err)
	require.ErrorIs(t, errs[0], errConversationGone)
	require.ErrorIs(t, errs[1], errLeaseLost)
	require.Zero(t, scalar[int](t, db, `SELECT count(*) FROM messages WHERE role <> 'user'`))
}

// The polling source schedules a page of the 4*MaxConcurrentTurns conversations whose pending
// rows are oldest. Busy conversations (a turn running elsewhere, a newer message waiting) used
// to fill that page, every poll found them busy, and no other conversation was ever scheduled.
func TestPollingSkipsBusyConversations(t *testing.T) {
	ctx := context.Background()
	db, _ := storeFixture(t)
	busy := []string{"b1", "b2", "b3", "b4"}
	conversations(t, db, busy...)
	conversations(t, db, "fresh")
	for _, c := range busy {
		send(t, db, c, c+"-m1")
	}
	for _, c := range busy {
		send(t, db, c, c+"-m2")
	}
	send(t, db, "fresh", "fresh-m1")
	// Another worker runs the turns of m1 in each busy conversation (a long model call).
	_, err := db.Pool.Exec(ctx, `UPDATE agent_outbox SET status = 'processing', run_id = gen_random_uuid(), attempts = 1,
		lease_expires_at = now() + interval '1 hour' WHERE message_id LIKE '%-m1' AND conversation_id <> 'fresh'`)
	require.NoError(t, err)

	w, err := New(Config{Pool: db.RolePool(t, testsvc.RoleWorker), PollInterval: 20 * time.Millisecond, Debounce: time.Millisecond,
		MaxConcurrentTurns: 1, Handler: func(context.Context, *Turn) (Reply, error) { return Reply{Content: "ok"}, nil }})
	require.NoError(t, err)
	runWorker(t, w)
	require.Eventually(t, func() bool {
		return testsvc.Query[string](t, db, `SELECT status FROM agent_outbox WHERE conversation_id = 'fresh'`)[0] == "done"
	}, 30*time.Second, 10*time.Millisecond, "an idle worker never got to the fresh conversation: the page is full of busy ones")
}
