package consumer

// Faults and races around claims, final commits and recovery: answers lost to a timeout or a
// dropped connection, locks held by others, recreated conversations, rows Baton does not write.
// Each test holds one of the worker's promises against one of them.

import (
	"context"
	"fmt"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/batonhq/baton/internal/testsvc"
)

const (
	hostile2RunA = "00000000-0000-4000-8000-0000000002a1"
	hostile2RunB = "00000000-0000-4000-8000-0000000002b1"
)

// resetConversation deletes and recreates conversation id in a transaction it leaves open
// (an application "clear chat" that keeps the id), and returns that transaction.
func resetConversation(t *testing.T, db *testsvc.Database, id string) interface {
	Commit(context.Context) error
	Rollback(context.Context) error
} {
	t.Helper()
	ctx := context.Background()
	tx, err := db.Pool.Begin(ctx)
	require.NoError(t, err)
	t.Cleanup(func() { _ = tx.Rollback(ctx) })
	_, err = tx.Exec(ctx, `DELETE FROM conversations WHERE id = $1`, id)
	require.NoError(t, err)
	_, err = tx.Exec(ctx, `INSERT INTO conversations (id) VALUES ($1)`, id)
	require.NoError(t, err)
	return tx
}

// waitFinishBlocked waits until a final commit waits on a lock.
func waitFinishBlocked(t *testing.T, db *testsvc.Database) {
	t.Helper()
	awaitLockWait(t, db, "pg_logical_emit_message", "no final commit waited on a lock")
}

// awaitLockWait waits (up to 30s) until a statement on db whose text contains like waits on a
// lock, or until past says the wait is over already (a wait bounded by lock_timeout may end
// between two looks on a loaded machine), and fails with what and the database's sessions
// otherwise.
func awaitLockWait(t *testing.T, db *testsvc.Database, like, what string, past ...func() bool) {
	t.Helper()
	waiting := func() bool {
		if len(past) > 0 && past[0]() {
			return true
		}
		return len(testsvc.Query[int](t, db, `SELECT pid FROM pg_stat_activity WHERE datname = current_database()
			AND wait_event_type = 'Lock' AND strpos(query, $1) > 0`, like)) > 0
	}
	advEventually(t, waiting, 30*time.Second, func() string {
		return fmt.Sprintf("%s; sessions: %q", what, testsvc.Query[string](t, db, `SELECT coalesce(wait_event_type, '-') || ' '
			|| coalesce(state, '-') || ' ' || left(query, 100) FROM pg_stat_activity WHERE datname = current_database()`))
	})
}

// holdOpen runs sql in a transaction that stays open, as an application holding rows would,
// until the test rolls it back or ends.
func holdOpen(t *testing.T, db *testsvc.Database, sql string, args ...any) pgx.Tx {
	t.Helper()
	tx, err := db.Pool.Begin(context.Background())
	require.NoError(t, err)
	t.Cleanup(func() { _ = tx.Rollback(context.Background()) })
	_, err = tx.Exec(context.Background(), sql, args...)
	require.NoError(t, err)
	return tx
}

// Was: The per-run fence still stands aside for a run whose conversation row its
// statement could not update ("c.id IS NULL"), trusting the foreign key to fail the reply.
// When the conversation is deleted and recreated with the same id while the final commit
// waits on it, the foreign key passes (it checks with a fresh snapshot), the outbox rows are
// gone with the old conversation, and the old turn's reply is committed into the new,
// empty conversation. The earlier fix only helps when a batch-mate fails the shared statement
// and the run is redone alone with a fresh snapshot; a run committing alone, or a batch whose
// other runs are fine, still commits the stale reply.
func TestOldReplyNeverLandsInARecreatedConversation(t *testing.T) {
	for _, mode := range []string{"alone", "batch"} {
		t.Run(mode, func(t *testing.T) {
			ctx := context.Background()
			db, s, ca, cb := claimedPair(t, hostile2RunA, hostile2RunB)
			require.Len(t, ca.ids, 1)

			reset := resetConversation(t, db, "a")
			res := make(chan []error, 1)
			go func() {
				reqs := []finishReq{{conversationID: "a", runID: hostile2RunA, ids: ca.ids,
					outcome: outcome{role: "assistant", content: "reply to the old conversation"}}}
				if mode == "batch" {
					reqs = append(reqs, finishReq{conversationID: "b", runID: hostile2RunB, ids: cb.ids,
						outcome: outcome{role: "assistant", content: "re b"}})
				}
				errs, err := s.finishMany(ctx, reqs)
				if err != nil {
					errs = []error{err}
				}
				res <- errs
			}()
			waitFinishBlocked(t, db)
			require.NoError(t, reset.Commit(ctx))
			errs := <-res
			t.Logf("finish errors: %v", errs)
			t.Logf("messages of the new conversation a: %v", testsvc.Query[string](t, db,
				`SELECT role || ': ' || content FROM messages WHERE conversation_id = 'a'`))
			t.Logf("outbox rows of a: %d", scalar[int](t, db, `SELECT count(*) FROM agent_outbox WHERE conversation_id = 'a'`))
			require.Zero(t, scalar[int](t, db, `SELECT count(*) FROM messages WHERE conversation_id = 'a'`),
				"the reset conversation received a reply to a message it never had")
			require.Error(t, errs[0], "run A's rows went with the old conversation: its commit must fail")
		})
	}
}

// Was: A claim whose answer never comes back in time (a half-open connection: the
// server got the claim and committed it, the client gave up when its context ended) is not
// handed back: unclaim runs with the caller's context, which has already ended, so it does
// nothing. The rows stay processing under a run nobody runs until the lease ends, and the
// attempt is spent (repeated, a request that never ran ends as "attempts exhausted").
func TestClaimAnswerLostToATimeoutIsHandedBack(t *testing.T) {
	ctx := context.Background()
	db, s := storeFixture(t)
	conversations(t, db, "warm")
	send(t, db, "warm", "w1")
	send(t, db, "c", "m1")
	pool, proxy := viaProxy(t, db)
	s.pool = pool
	claimOne(t, s, "warm", "00000000-0000-4000-8000-0000000002c0") // prepares the statements

	// The request reaches the server after 300ms and is committed; the answer would reach
	// the client after 600ms, but the client gives up after 450ms.
	proxy.SetLatency(300 * time.Millisecond)
	cctx, cancel := context.WithTimeout(ctx, 450*time.Millisecond)
	const run = "00000000-0000-4000-8000-0000000002c1"
	_, err := s.claimMany(cctx, []claimReq{{"c", run}})
	cancel()
	require.Error(t, err)
	proxy.SetLatency(0)
	require.Eventually(t, func() bool {
		return testsvc.Query[string](t, db, `SELECT status || ' ' || attempts FROM agent_outbox WHERE conversation_id = 'c'`)[0] == "pending 0"
	}, 10*time.Second, 10*time.Millisecond, "the claim committed but nobody runs it: the rows wait for the lease, an attempt spent")
}

// Was: After a shared claim whose answer was lost, unclaim hands the rows back and the
// batch is claimed conversation by conversation, but with the same run ids: agent_runs
// already holds each of them (the released record), so every per-conversation claim fails
// with a duplicate key and claims nothing. The fallback can never help after a lost answer.
func TestFallbackAfterALostClaimAnswerClaims(t *testing.T) {
	ctx := context.Background()
	db, s := storeFixture(t)
	conversations(t, db, "warm", "d")
	send(t, db, "warm", "w1")
	send(t, db, "c", "m1")
	send(t, db, "d", "d1")
	pool, proxy := viaProxy(t, db)
	s.pool = pool
	claimOne(t, s, "warm", "00000000-0000-4000-8000-0000000002d0")

	fired := proxy.DropNextResponse()
	out, err := s.claimMany(ctx, []claimReq{{"c", "00000000-0000-4000-8000-0000000002d1"},
		{"d", "00000000-0000-4000-8000-0000000002d2"}})
	select {
	case <-fired:
	case <-time.After(10 * time.Second):
		t.Fatal("the fault never fired")
	}
	require.NoError(t, err)
	t.Logf("claims: c=%+v d=%+v", out[0], out[1])
	t.Logf("rows: %v", testsvc.Query[string](t, db,
		`SELECT conversation_id || ':' || status FROM agent_outbox WHERE conversation_id IN ('c','d') ORDER BY 1`))
	_, again := s.claimAll(ctx, []claimReq{{"c", "00000000-0000-4000-8000-0000000002d1"}})
	t.Logf("claiming c again with the same run id, as the fallback does: %v", again)
	require.NotEmpty(t, out[0].ids, "the per-conversation claim of c took nothing")
	require.NotEmpty(t, out[1].ids, "the per-conversation claim of d took nothing")
}

// Was: recoverRun's "already done?" check after a transient failure looks the run up
// by run.runID, which is "" for processing rows that name no run: the lookup fails with
// invalid input syntax for type uuid (not transient), so a connection blip during such a
// recovery makes it give up with a confusing error instead of retrying (or, if its commit did
// happen, report the recovery as failed).
func TestRecoveryOfRunlessRowsSurvivesATransientFault(t *testing.T) {
	ctx := context.Background()
	db, s := storeFixture(t)
	conversations(t, db, "weird")
	send(t, db, "weird", "w1")
	_, err := db.Pool.Exec(ctx, `UPDATE agent_outbox SET status = 'processing', run_id = NULL,
		lease_expires_at = now() - interval '1 hour' WHERE conversation_id = 'weird'`)
	require.NoError(t, err)
	pool, proxy := viaProxy(t, db)
	s.pool = pool
	_, err = pool.Exec(ctx, `SELECT 1`) // the one connection exists before the fault
	require.NoError(t, err)

	fired := proxy.DropNextResponse()
	r, err := s.recoverRun(ctx, expiredRun{runID: "", conversationID: "weird"})
	select {
	case <-fired:
	case <-time.After(10 * time.Second):
		t.Fatal("the fault never fired")
	}
	t.Logf("recoverRun: %+v, %v", r, err)
	require.NoError(t, err, "a transient fault during recovery is retried like any other")
	require.Equal(t, []string{"pending"}, testsvc.Query[string](t, db,
		`SELECT status FROM agent_outbox WHERE conversation_id = 'weird'`))
}

// Was: Invariant 10: one request's failure never fails another's. A final-commit
// batch that includes conversations whose rows another transaction holds waits lock_timeout
// once for the shared statement, then once more per held run while it redoes the runs one by
// one, in batch order, all within the batcher's one deadline. With the defaults (5s lock
// timeout, 30s deadline) six held conversations in a batch of up to 32 make every run queued
// after them fail with "context deadline exceeded": their replies are discarded (rows left
// processing, retried after the lease; a turn that wrote ends as a visible failure). Scaled
// here: 200ms lock timeout, 1.2s deadline, seven held conversations.
func TestHeldConversationsDoNotFailTheirBatchMatesCommits(t *testing.T) {
	ctx := context.Background()
	db, s := storeFixture(t)
	s.lockTimeout = 200 * time.Millisecond
	const held = 7
	var reqs []finishReq
	app, err := db.Pool.Begin(ctx)
	require.NoError(t, err)
	defer func() { _ = app.Rollback(ctx) }()
	for i := 0; i <= held; i++ {
		conv := fmt.Sprintf("h%d", i)
		if i == held {
			conv = "free"
		}
		conversations(t, db, conv)
		send(t, db, conv, conv+"-m1")
		run := fmt.Sprintf("00000000-0000-4000-8000-0000000003%02d", i)
		c := claimOne(t, s, conv, run)
		reqs = append(reqs, finishReq{conversationID: conv, runID: run, ids: c.ids,
			outcome: outcome{role: "assistant", content: "re " + conv}})
		if i < held {
			_, err := app.Exec(ctx, `SELECT 1 FROM conversations WHERE id = $1 FOR UPDATE`, conv)
			require.NoError(t, err)
		}
	}
	fctx, cancel := context.WithTimeout(ctx, 6*s.lockTimeout) // the batcher's deadline, scaled (30s / 5s)
	defer cancel()
	start := time.Now()
	errs, err := s.finishMany(fctx, reqs)
	t.Logf("finishMany took %v: err=%v", time.Since(start), err)
	require.NoError(t, err)
	t.Logf("error of the free conversation's run: %v", errs[held])
	require.NoError(t, errs[held], "nothing was wrong with this run; its batch-mates' held rows failed it")
	require.Equal(t, []string{"done"}, testsvc.Query[string](t, db,
		`SELECT status FROM agent_outbox WHERE conversation_id = 'free'`))
}

// Was: Invariant 6: a processing row whose lease_expires_at is 'infinity' (any role
// that may update the outbox can write it; Baton never does) is never recovered: recovery
// looks only for leases before now(), the claim finds the conversation busy, and the polling
// sweep leaves busy conversations out. Every later message of the conversation waits forever,
// with no visible failure. (The first review fixed the same class for available_at and
// run_id; lease_expires_at was left out.)
func TestInfiniteLeaseIsRecovered(t *testing.T) {
	ctx := context.Background()
	db, _ := storeFixture(t)
	send(t, db, "c", "m1")
	_, err := db.Pool.Exec(ctx, `UPDATE agent_outbox SET status = 'processing', attempts = 1,
		run_id = gen_random_uuid(), lease_expires_at = 'infinity'`)
	require.NoError(t, err)
	send(t, db, "c", "m2")

	w, err := New(Config{Pool: db.RolePool(t, testsvc.RoleWorker), PollInterval: 20 * time.Millisecond, Debounce: time.Millisecond,
		RecoveryInterval: 50 * time.Millisecond,
		Handler:          func(context.Context, *Turn) (Reply, error) { return Reply{Content: "ok"}, nil }})
	require.NoError(t, err)
	runWorker(t, w)
	require.Eventually(t, func() bool {
		return scalar[int](t, db, `SELECT count(*) FROM agent_outbox WHERE status IN ('pending', 'processing')`) == 0
	}, 10*time.Second, 20*time.Millisecond, "the conversation is stuck: %v", testsvc.Query[string](t, db,
		`SELECT id || ':' || status || ' lease=' || coalesce(lease_expires_at::text, '-') FROM agent_outbox ORDER BY id`))
}

// Was: runTurn stops renewing the lease (the keeper ends) before the final commit,
// and the commit then waits its turn in the one finish runner. When that runner is stalled
// (a batch waiting lock_timeout on a conversation row another transaction holds, redone run
// by run; a final commit retrying a lost connection up to the 30s deadline), a completed turn
// queued behind it can outlive its lease: recovery takes its rows, and since the turn called
// a write tool it ends as a visible failure ("Sorry ...") although the handler succeeded and
// nothing was wrong with its conversation. Without a write tool the turn is run twice.
// Scaled: 1s lease, 3s lock timeout (defaults: 30s lease, 5s lock timeout, so it takes a
// queue of several stalled batches or a retried connection loss).
func TestCompletedTurnKeepsItsLeaseWaitingForItsCommit(t *testing.T) {
	ctx := context.Background()
	db, _ := storeFixture(t)
	conversations(t, db, "h", "b")
	hStarted, hRelease := make(chan struct{}), make(chan struct{})
	var bCalls atomic.Int32
	w, err := New(Config{Pool: db.RolePool(t, testsvc.RoleWorker), PollInterval: 20 * time.Millisecond, Debounce: time.Millisecond,
		Lease: time.Second, RecoveryInterval: 100 * time.Millisecond,
		Handler: func(ctx context.Context, t *Turn) (Reply, error) {
			if t.ConversationID == "h" {
				close(hStarted)
				<-hRelease
				return Reply{Content: "re h"}, nil
			}
			bCalls.Add(1)
			if _, err := t.Tool(ctx, "send_email", Write, nil, func(context.Context) (any, error) { return "sent", nil }); err != nil {
				return Reply{}, err
			}
			return Reply{Content: "re b"}, nil
		}})
	require.NoError(t, err)
	w.store.lockTimeout = 3 * time.Second
	runWorker(t, w)

	send(t, db, "h", "h-m1")
	<-hStarted
	// An application transaction holds h's conversation row for a while.
	app := holdOpen(t, db, `SELECT 1 FROM conversations WHERE id = 'h' FOR UPDATE`)
	close(hRelease) // h's final commit now waits for the row
	waitFinishBlocked(t, db)

	send(t, db, "b", "b-m1") // b's turn runs and completes at once; its commit queues behind h's
	require.Eventually(t, func() bool {
		return scalar[int](t, db, `SELECT count(*) FROM agent_outbox WHERE conversation_id = 'b' AND status IN ('done', 'error')`) == 1
	}, 15*time.Second, 20*time.Millisecond)
	require.NoError(t, app.Rollback(ctx))
	t.Logf("b handler calls: %d; b's messages: %v", bCalls.Load(), testsvc.Query[string](t, db,
		`SELECT role || ': ' || content FROM messages WHERE conversation_id = 'b' ORDER BY created_at`))
	t.Logf("b's runs: %v", testsvc.Query[string](t, db,
		`SELECT outcome || ' ' || coalesce(error, '') FROM agent_runs WHERE conversation_id = 'b'`))
	require.Equal(t, []string{"done"}, testsvc.Query[string](t, db, `SELECT status FROM agent_outbox WHERE conversation_id = 'b'`),
		"b's turn succeeded, but its rows were recovered while its commit waited behind h's")
}
