package consumer

// Adversarial review of the "write row means no replay / all-or-nothing ownership" change.
// Every test here is written to PASS when the code is correct and to FAIL while the defect it
// names is present. See the commit message for which ones fail.

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/batonhq/baton/internal/testsvc"
)

const (
	reviewRunA = "00000000-0000-4000-8000-00000000aa01"
	reviewRunB = "00000000-0000-4000-8000-00000000bb01"
	reviewRunC = "00000000-0000-4000-8000-00000000cc01"
)

func reviewConv(t *testing.T, db *testsvc.Database, ids ...string) {
	t.Helper()
	for _, id := range ids {
		_, err := db.Pool.Exec(context.Background(), `INSERT INTO conversations (id) VALUES ($1) ON CONFLICT DO NOTHING`, id)
		require.NoError(t, err)
	}
}

// R1. A pending row with available_at = 'infinity' (any role can write it: a "snooze forever")
// makes the claim statement return a value the client cannot scan. The claim transaction has
// already committed by then (pipelined implicit transaction), so every other conversation of
// the same claim batch has its rows set processing under a run id nobody runs: orphaned until
// the lease expires, an attempt burned each time. The bad conversation itself is never claimed
// nor failed, so (JetStream source) its event comes back every second and poisons the next
// batch, forever.
func TestReviewInfiniteAvailableAtOrphansClaimBatchMates(t *testing.T) {
	ctx := context.Background()
	db, s := storeFixture(t)
	reviewConv(t, db, "bad", "good")
	send(t, db, "bad", "bad-m1")
	send(t, db, "good", "good-m1")
	_, err := db.Pool.Exec(ctx, `UPDATE agent_outbox SET available_at = 'infinity' WHERE conversation_id = 'bad'`)
	require.NoError(t, err)

	out, err := s.claimMany(ctx, []claimReq{{"bad", reviewRunA}, {"good", reviewRunB}})
	require.NoError(t, err)
	t.Logf("claim of good returned: ids=%v busy=%v locked=%v", out[1].ids, out[1].busy, out[1].locked)
	t.Logf("good's row in the database: %v", testsvc.Query[string](t, db,
		`SELECT status || ' run=' || coalesce(run_id::text, '-') || ' attempts=' || attempts FROM agent_outbox WHERE conversation_id = 'good'`))
	_, badErr := s.claimMany(ctx, []claimReq{{"bad", reviewRunC}})
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

// R2. Same mechanism with a message whose created_at no JSON decoder of time.Time accepts
// ('infinity', a year beyond 9999, a BC date): the claim commits, the client fails to decode
// the messages and reports an error; every conversation of the batch is orphaned, and the bad
// one burns its attempts without a handler ever running.
func TestReviewUndecodableCreatedAtOrphansClaimBatchMates(t *testing.T) {
	ctx := context.Background()
	db, s := storeFixture(t)
	reviewConv(t, db, "bad", "good")
	send(t, db, "bad", "bad-m1")
	send(t, db, "good", "good-m1")
	_, err := db.Pool.Exec(ctx, `UPDATE messages SET created_at = '10000-01-01' WHERE id = 'bad-m1'`)
	require.NoError(t, err)

	out, err := s.claimMany(ctx, []claimReq{{"bad", reviewRunA}, {"good", reviewRunB}})
	require.NoError(t, err)
	t.Logf("rows: %v", testsvc.Query[string](t, db,
		`SELECT conversation_id || ':' || status || ' run=' || coalesce(run_id::text, '-') FROM agent_outbox ORDER BY 1`))
	require.NotEmpty(t, out[1].ids,
		"good's row was claimed (processing under run %s) but the caller got nothing to run", reviewRunB)
}

// R3. A processing row with a NULL run_id and an expired lease (any role can write it) makes
// expiredRuns fail to scan, so recovery does nothing at all, on every worker, forever: every
// other expired run (a killed worker's) keeps its conversation busy for good.
func TestReviewNullRunIDHaltsAllRecovery(t *testing.T) {
	ctx := context.Background()
	db, s := storeFixture(t)
	reviewConv(t, db, "weird")
	send(t, db, "c", "m1")
	send(t, db, "weird", "w1")
	c := claimOne(t, s, "c", reviewRunA) // a run whose worker was killed
	require.Len(t, c.ids, 1)
	_, err := db.Pool.Exec(ctx, `UPDATE agent_outbox SET status = 'processing', run_id = NULL,
		lease_expires_at = now() - interval '1 hour' WHERE conversation_id = 'weird'`)
	require.NoError(t, err)
	expire(t, db)

	w, err := New(Config{Pool: db.Pool, Handler: func(context.Context, *Turn) (Reply, error) { return Reply{}, nil }})
	require.NoError(t, err)
	w.store = s
	runs, err := s.expiredRuns(ctx, 1000)
	t.Logf("expiredRuns: %v, %v", runs, err)
	w.recoverOnce(ctx)
	require.Equal(t, []string{"pending"}, testsvc.Query[string](t, db,
		`SELECT status FROM agent_outbox WHERE conversation_id = 'c'`),
		"the killed worker's run was not recovered: one odd row elsewhere stopped recovery")
}

// R4. A pending row whose attempts is at the integer maximum (any role can write it) makes
// every claim of its conversation fail (integer out of range): the row never runs, never fails
// visibly, and its conversation is stuck for good; the worker retries it forever.
func TestReviewAttemptsOverflowStuckForever(t *testing.T) {
	ctx := context.Background()
	db, _ := storeFixture(t)
	send(t, db, "c", "m1")
	_, err := db.Pool.Exec(ctx, `UPDATE agent_outbox SET attempts = 2147483647`)
	require.NoError(t, err)
	send(t, db, "c", "m2")

	w, err := New(Config{Pool: db.Pool, PollInterval: 20 * time.Millisecond, Debounce: time.Millisecond,
		Handler: func(context.Context, *Turn) (Reply, error) { return Reply{Content: "ok"}, nil }})
	require.NoError(t, err)
	wctx, cancel := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- w.Run(wctx) }()
	time.Sleep(3 * time.Second)
	cancel()
	require.NoError(t, <-done)
	t.Logf("rows after 3s of a worker: %v", testsvc.Query[string](t, db,
		`SELECT id || ':' || status || ' attempts=' || attempts FROM agent_outbox ORDER BY id`))
	require.Zero(t, scalar[int](t, db, `SELECT count(*) FROM agent_outbox WHERE status IN ('pending', 'processing')`),
		"rows no retry can fix must end visibly, not block the conversation forever")
}

// R5. The final commit's fence stands aside for the WHOLE batch as soon as one conversation's
// UPDATE misses its row ("(SELECT count(*) FROM conv) < cardinality($1)"), trusting the
// foreign key to fail the statement. A conversation deleted and recreated with the same id in
// one transaction (a "reset conversation") while the batch waits on its row passes the
// foreign key: the fence is off, and a batch-mate whose lease was lost and whose rows another
// run now holds commits its reply: two replies to one message, fencing broken.
func TestReviewRecreatedConversationDisablesFenceForBatchMates(t *testing.T) {
	ctx := context.Background()
	db, s := storeFixture(t)
	reviewConv(t, db, "a", "b")
	send(t, db, "a", "a-m1")
	send(t, db, "b", "b-m1")
	ca := claimOne(t, s, "a", reviewRunA)
	cb := claimOne(t, s, "b", reviewRunB)
	require.Len(t, ca.ids, 1)
	require.Len(t, cb.ids, 1)
	// b's run lost its lease: recovered and claimed again by run C, which is running.
	_, err := db.Pool.Exec(ctx, `UPDATE agent_outbox SET run_id = $1 WHERE conversation_id = 'b'`, reviewRunC)
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
			{conversationID: "a", runID: reviewRunA, ids: ca.ids, outcome: outcome{role: "assistant", content: "reply of A"}},
			{conversationID: "b", runID: reviewRunB, ids: cb.ids, outcome: outcome{role: "assistant", content: "stale reply of B"}},
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
	require.ErrorIs(t, r.errs[1], errLeaseLost, "run B lost its rows to run C: it must not commit")
	require.Zero(t, scalar[int](t, db, `SELECT count(*) FROM messages WHERE conversation_id = 'b' AND role = 'assistant'`),
		"the stale run B committed a reply while run C holds the turn")
}

// R6. The final commit waits, without lock_timeout, for every conversation row of its batch. A
// conversation row held by any other transaction (an application's long UPDATE, a frozen
// client holding a lock) stalls the whole batch and the single finish runner behind it; when
// the runner's deadline (30s in the worker) ends it, every batch-mate fails without the
// per-run fallback, although nothing was wrong with them: their rows wait for recovery, an
// attempt is burned, and a batch-mate that ran a write tool ends as a visible failure.
func TestReviewLockedConversationFailsBatchMates(t *testing.T) {
	ctx := context.Background()
	db, s := storeFixture(t)
	reviewConv(t, db, "a", "b")
	send(t, db, "a", "a-m1")
	send(t, db, "b", "b-m1")
	ca := claimOne(t, s, "a", reviewRunA)
	cb := claimOne(t, s, "b", reviewRunB)

	app, err := db.Pool.Begin(ctx)
	require.NoError(t, err)
	defer func() { _ = app.Rollback(ctx) }()
	_, err = app.Exec(ctx, `SELECT 1 FROM conversations WHERE id = 'a' FOR UPDATE`)
	require.NoError(t, err)

	// Stands for the batcher's 30s deadline.
	fctx, cancel := context.WithTimeout(ctx, 3*time.Second)
	defer cancel()
	errs, err := s.finishMany(fctx, []finishReq{
		{conversationID: "a", runID: reviewRunA, ids: ca.ids, outcome: outcome{role: "assistant", content: "re a"}},
		{conversationID: "b", runID: reviewRunB, ids: cb.ids, outcome: outcome{role: "assistant", content: "re b"}},
	})
	t.Logf("finishMany: errs=%v err=%v", errs, err)
	require.Equal(t, []string{"done"}, testsvc.Query[string](t, db, `SELECT status FROM agent_outbox WHERE conversation_id = 'b'`),
		"b's commit failed only because a's conversation row was locked by someone else")
}

// R7. Deleting one message of a multi-message turn (the user "unsends" it) is treated as a
// lost lease: renewal fails, the tool check fails, the final commit is fenced, endRun refuses.
// A turn whose write tool already ran and whose reply was ready is discarded; after the lease
// expires recovery sees the write and commits a visible failure: the effect happened, the
// reply saying so is lost, and the user sees "Sorry, this request could not be completed."
func TestReviewDeletedMessageDiscardsACompletedTurn(t *testing.T) {
	ctx := context.Background()
	db, s := storeFixture(t)
	w, err := New(Config{Pool: db.Pool, Handler: func(context.Context, *Turn) (Reply, error) { return Reply{}, nil }})
	require.NoError(t, err)
	w.store = s
	send(t, db, "c", "m1", "m2")
	c := claimOne(t, s, "c", reviewRunA)
	require.Len(t, c.ids, 2)
	turn := &Turn{ConversationID: "c", RunID: reviewRunA, OutboxIDs: c.ids, w: w}
	_, err = turn.Tool(ctx, "send_email", Write, "to bob", func(context.Context) (any, error) { return "sent", nil })
	require.NoError(t, err)

	_, err = db.Pool.Exec(ctx, `DELETE FROM messages WHERE id = 'm2'`) // cascades to its outbox row
	require.NoError(t, err)

	err = s.finishOne(ctx, finishReq{conversationID: "c", runID: reviewRunA, ids: c.ids,
		outcome: outcome{role: "assistant", content: "I sent the email."}})
	t.Logf("finish after m2 was deleted: %v", err)
	if errors.Is(err, errLeaseLost) {
		expire(t, db)
		r, rerr := s.recoverRun(ctx, expiredRun{reviewRunA, "c"})
		require.NoError(t, rerr)
		t.Logf("recovery: failed=%v retried=%v reason=%q", r.failed, r.retried, r.reason)
		t.Logf("conversation now: %v", testsvc.Query[string](t, db,
			`SELECT role || ': ' || content FROM messages ORDER BY created_at, id`))
	}
	require.NoError(t, err, "the run still held every row that exists: deleting a message is not losing the turn")
	require.Equal(t, []string{"I sent the email."}, testsvc.Query[string](t, db,
		`SELECT content FROM messages WHERE role = 'assistant'`))
}

// R8 (control). The fence holds for a batch whose conversations all exist, and for a
// conversation deleted without being recreated: checked so the R5 finding is specific.
func TestReviewFenceHoldsWithoutRecreate(t *testing.T) {
	ctx := context.Background()
	db, s := storeFixture(t)
	reviewConv(t, db, "a", "b")
	send(t, db, "a", "a-m1")
	send(t, db, "b", "b-m1")
	ca := claimOne(t, s, "a", reviewRunA)
	cb := claimOne(t, s, "b", reviewRunB)
	_, err := db.Pool.Exec(ctx, `UPDATE agent_outbox SET run_id = $1 WHERE conversation_id = 'b'`, reviewRunC)
	require.NoError(t, err)
	_, err = db.Pool.Exec(ctx, `DELETE FROM conversations WHERE id = 'a'`)
	require.NoError(t, err)
	errs, err := s.finishMany(ctx, []finishReq{
		{conversationID: "a", runID: reviewRunA, ids: ca.ids, outcome: outcome{role: "assistant", content: "x"}},
		{conversationID: "b", runID: reviewRunB, ids: cb.ids, outcome: outcome{role: "assistant", content: "y"}},
	})
	require.NoError(t, err)
	require.ErrorIs(t, errs[0], errConversationGone)
	require.ErrorIs(t, errs[1], errLeaseLost)
	require.Zero(t, scalar[int](t, db, `SELECT count(*) FROM messages WHERE role <> 'user'`))
	_ = strings.TrimSpace
}

// R9. The polling source schedules only the page of the 4*MaxConcurrentTurns conversations
// whose pending rows are oldest, and polls again at once (10ms) while the page is full. A
// conversation whose turn is running (here in another worker) and that has a newer pending
// message is on that page, and its claim finds it busy. While a full page of such
// conversations exists (chatty users sending follow-ups during long model calls), every poll
// claims the same busy conversations every 10ms and no other conversation is ever scheduled.
func TestReviewPollingStarvesBehindBusyConversations(t *testing.T) {
	ctx := context.Background()
	db, _ := storeFixture(t)
	busy := []string{"b1", "b2", "b3", "b4"}
	reviewConv(t, db, busy...)
	reviewConv(t, db, "fresh")
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

	w, err := New(Config{Pool: db.Pool, PollInterval: 20 * time.Millisecond, Debounce: time.Millisecond,
		MaxConcurrentTurns: 1, Handler: func(context.Context, *Turn) (Reply, error) { return Reply{Content: "ok"}, nil }})
	require.NoError(t, err)
	wctx, cancel := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- w.Run(wctx) }()
	time.Sleep(3 * time.Second)
	cancel()
	require.NoError(t, <-done)
	require.Equal(t, []string{"done"}, testsvc.Query[string](t, db, `SELECT status FROM agent_outbox WHERE conversation_id = 'fresh'`),
		"an idle worker never got to the fresh conversation: the page is always full of busy ones")
}
