package consumer

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/batonhq/baton/internal/testsvc"
	"github.com/batonhq/baton/producer"
)

// expire makes every processing row's lease run out.
func expire(t *testing.T, db *testsvc.Database) {
	t.Helper()
	_, err := db.Pool.Exec(context.Background(), `UPDATE agent_outbox SET lease_expires_at = now() - interval '1 second'
		WHERE status = 'processing'`)
	require.NoError(t, err)
}

// operation records a tool call of run directly, in the given status.
func operation(t *testing.T, db *testsvc.Database, run, conv, effect, status string) {
	t.Helper()
	_, err := db.Pool.Exec(context.Background(), `INSERT INTO operations (run_id, conversation_id, tool, effect, status)
		VALUES ($1, $2, 'tool', $3, $4)`, run, conv, effect, status)
	require.NoError(t, err)
}

// A write operation row, whatever its status, means the effect may have happened:
// recovery never puts such a turn back to pending. A write recorded as error (the tool was
// cancelled mid-call, or failed after its effect; or an earlier recovery marked it interrupted
// and then failed to commit the visible failure) is a side effect too.
func TestRecoveryNeverReplaysAfterAWriteOperation(t *testing.T) {
	ctx := context.Background()
	for _, status := range []string{"running", "done", "error"} {
		t.Run(status, func(t *testing.T) {
			db, s := storeFixture(t)
			send(t, db, "c", "m1")
			const run = "00000000-0000-4000-8000-000000000011"
			c := claimOne(t, s, "c", run)
			require.Len(t, c.ids, 1)
			operation(t, db, run, "c", "write", status)
			expire(t, db)

			r, err := s.recoverRun(ctx, expiredRun{run, "c"})
			require.NoError(t, err)
			require.NotEmpty(t, r.failed, "a turn with a write operation (%s) must end as a visible failure", status)
			require.Equal(t, []string{"error"}, testsvc.Query[string](t, db, `SELECT status FROM agent_outbox`))
			require.Len(t, testsvc.Query[string](t, db, `SELECT id FROM messages WHERE role = 'error'`), 1)
		})
	}
}

// The tool check sees every claimed row of the run or refuses. A run that lost one
// of its rows (taken by a recovery that saw only part of the run) must not start a tool.
func TestToolRefusedWhenTheRunLostAnyRow(t *testing.T) {
	ctx := context.Background()
	db, s := storeFixture(t)
	w, err := New(Config{Pool: db.RolePool(t, testsvc.RoleWorker), Handler: func(context.Context, *Turn) (Reply, error) { return Reply{}, nil }})
	require.NoError(t, err)
	w.store = s
	send(t, db, "c", "m1", "m2")
	const run = "00000000-0000-4000-8000-000000000012"
	c := claimOne(t, s, "c", run)
	require.Len(t, c.ids, 2)
	_, err = db.Pool.Exec(ctx, `UPDATE agent_outbox SET status = 'pending', run_id = NULL, lease_expires_at = NULL
		WHERE id = $1`, c.ids[1])
	require.NoError(t, err)

	turn := &Turn{ConversationID: "c", RunID: run, OutboxIDs: c.ids, w: w}
	ran := false
	_, err = turn.Tool(ctx, "send_email", Write, "q", func(context.Context) (any, error) { ran = true; return nil, nil })
	require.ErrorIs(t, err, errLeaseLost)
	require.False(t, ran, "the tool must not run")
	require.Empty(t, testsvc.Query[string](t, db, `SELECT tool FROM operations`))
}

// Renewal succeeds only while the run holds every claimed row.
func TestRenewFailsWhenTheRunLostAnyRow(t *testing.T) {
	ctx := context.Background()
	db, s := storeFixture(t)
	send(t, db, "c", "m1", "m2")
	const run = "00000000-0000-4000-8000-000000000013"
	c := claimOne(t, s, "c", run)
	require.Len(t, c.ids, 2)
	ok, err := s.renew(ctx, "c", run, c.ids)
	require.NoError(t, err)
	require.True(t, ok)

	_, err = db.Pool.Exec(ctx, `UPDATE agent_outbox SET status = 'pending', run_id = NULL WHERE id = $1`, c.ids[0])
	require.NoError(t, err)
	ok, err = s.renew(ctx, "c", run, c.ids)
	require.NoError(t, err)
	require.False(t, ok, "a run that lost one of its rows lost its turn")
}

// Recovery takes every row of an expired run or none. While another transaction
// holds one of the rows (a tool check or a renewal in flight), recovery leaves the whole run
// alone; once it is free, recovery takes the run whole.
func TestRecoveryTakesAllOfARunOrNothing(t *testing.T) {
	ctx := context.Background()
	db, s := storeFixture(t)
	send(t, db, "c", "m1", "m2")
	const run = "00000000-0000-4000-8000-000000000014"
	c := claimOne(t, s, "c", run)
	require.Len(t, c.ids, 2)
	expire(t, db)

	tx, err := db.Pool.Begin(ctx)
	require.NoError(t, err)
	defer func() { _ = tx.Rollback(ctx) }()
	_, err = tx.Exec(ctx, `SELECT 1 FROM agent_outbox WHERE id = $1 FOR SHARE`, c.ids[0])
	require.NoError(t, err)

	r, err := s.recoverRun(ctx, expiredRun{run, "c"})
	require.NoError(t, err)
	require.Empty(t, r.ids, "recovery took part of a run")
	require.Equal(t, []string{"processing", "processing"},
		testsvc.Query[string](t, db, `SELECT status FROM agent_outbox WHERE run_id = $1 ORDER BY id`, run))

	require.NoError(t, tx.Rollback(ctx))
	r, err = s.recoverRun(ctx, expiredRun{run, "c"})
	require.NoError(t, err)
	require.Equal(t, c.ids, r.ids)
	require.Equal(t, []string{"pending", "pending"}, testsvc.Query[string](t, db, `SELECT status FROM agent_outbox ORDER BY id`))
}

// One run's bad text never fails its batch-mates. Reasons are sanitized (valid
// UTF-8, no NUL, bounded), and a run whose commit fails for a reason of its own is isolated.
func TestFinishManyIsolatesAnyFailingRun(t *testing.T) {
	ctx := context.Background()
	db, s := storeFixture(t)
	var reqs []finishReq
	for i, conv := range []string{"a", "b", "c2", "d"} {
		_, err := db.Pool.Exec(ctx, `INSERT INTO conversations (id) VALUES ($1)`, conv)
		require.NoError(t, err)
		send(t, db, conv, conv+"-m")
		run := fmt.Sprintf("00000000-0000-4000-8000-%012d", 300+i)
		c := claimOne(t, s, conv, run)
		reqs = append(reqs, finishReq{conversationID: conv, runID: run, ids: c.ids,
			outcome: outcome{role: "assistant", content: "re " + conv}})
	}
	// A failure whose detail holds a NUL byte and invalid UTF-8, and a reason far too long.
	reqs[1].outcome = outcome{role: "error", content: "failed", reason: "bad \x00 byte \xff\xfe"}
	reqs[3].outcome = outcome{role: "error", content: "failed", reason: strings.Repeat("x", 1<<20)}
	// A reply Postgres refuses for a reason of its own.
	reqs[2].outcome = outcome{role: "assistant", content: "nul \x00 in a reply"}

	errs, err := s.finishMany(ctx, reqs)
	require.NoError(t, err)
	require.NoError(t, errs[0])
	require.NoError(t, errs[1])
	require.Error(t, errs[2])
	require.NoError(t, errs[3])
	require.Equal(t, []string{"a:done", "b:error", "c2:processing", "d:error"},
		testsvc.Query[string](t, db, `SELECT conversation_id || ':' || status FROM agent_outbox WHERE conversation_id <> 'c' ORDER BY 1`))
	require.Equal(t, []string{"bad  byte \uFFFD"}, testsvc.Query[string](t, db, `SELECT last_error FROM agent_outbox WHERE conversation_id = 'b'`))
	require.LessOrEqual(t, len(testsvc.Query[string](t, db, `SELECT last_error FROM agent_outbox WHERE conversation_id = 'd'`)[0]), 8<<10)
}

// A claim is capped in messages and bytes; the rest goes to the next turn.
func TestClaimIsCapped(t *testing.T) {
	ctx := context.Background()
	t.Run("messages", func(t *testing.T) {
		db, s := storeFixture(t)
		ids := make([]string, 101)
		for i := range ids {
			ids[i] = fmt.Sprintf("m%03d", i)
		}
		send(t, db, "c", ids...)
		c := claimOne(t, s, "c", "00000000-0000-4000-8000-000000000021")
		require.Len(t, c.ids, 100, "the default cap is 100 messages")
		require.Equal(t, "m000", c.messages[0].ID)
		require.Equal(t, "m099", c.messages[99].ID)
		require.NoError(t, s.finishOne(ctx, finishReq{conversationID: "c", runID: "00000000-0000-4000-8000-000000000021",
			ids: c.ids, outcome: outcome{role: "assistant", content: "ok"}}))
		c = claimOne(t, s, "c", "00000000-0000-4000-8000-000000000022")
		require.Len(t, c.ids, 1)
		require.Equal(t, "m100", c.messages[0].ID)
	})
	t.Run("bytes", func(t *testing.T) {
		db, s := storeFixture(t)
		big := strings.Repeat("x", 5<<20)
		for _, id := range []string{"m1", "m2"} {
			_, err := db.Pool.Exec(ctx, `WITH m AS (INSERT INTO messages (id, conversation_id, role, content) VALUES ($1, 'c', 'user', $2) RETURNING id)
				INSERT INTO agent_outbox (conversation_id, message_id) SELECT 'c', id FROM m`, id, big)
			require.NoError(t, err)
		}
		c := claimOne(t, s, "c", "00000000-0000-4000-8000-000000000023")
		require.Len(t, c.ids, 1, "two 5 MiB messages exceed the default 8 MiB cap")
		require.Len(t, c.messages[0].Content, 5<<20)
	})
}

// A conversation's rows are claimed as an ordered prefix: while its oldest pending
// row waits out its backoff, nothing of the conversation is claimed.
func TestClaimWaitsForTheOldestRowsBackoff(t *testing.T) {
	ctx := context.Background()
	db, s := storeFixture(t)
	send(t, db, "c", "m1")
	_, err := db.Pool.Exec(ctx, `UPDATE agent_outbox SET available_at = now() + interval '1 hour', attempts = 1`)
	require.NoError(t, err)
	send(t, db, "c", "m2")
	c := claimOne(t, s, "c", "00000000-0000-4000-8000-000000000031")
	require.Empty(t, c.ids, "m2 claimed while m1 backs off: replies out of order")
	require.True(t, c.locked)
	require.WithinDuration(t, time.Now().Add(time.Hour), c.waitUntil, time.Minute, "the claim says when to look again")
}

// Reply ids cannot collide with a client's message ids.
func TestReplyIDsCannotCollideWithClientIDs(t *testing.T) {
	ctx := context.Background()
	db, s := storeFixture(t)
	send(t, db, "c", "m1")
	const run = "00000000-0000-4000-8000-000000000041"
	c := claimOne(t, s, "c", run)
	// A client who learned the run id sends messages with every id the old scheme derived from it.
	send(t, db, "c", "error:"+run, "reply:"+run)
	err := s.finishOne(ctx, finishReq{conversationID: "c", runID: run, ids: c.ids[:1],
		outcome: outcome{role: "error", content: "failed", reason: "r"}})
	require.NoError(t, err)
	require.Equal(t, []string{"error"}, testsvc.Query[string](t, db, `SELECT status FROM agent_outbox WHERE id = $1`, c.ids[0]))

	// Reply ids live in the namespace the producer refuses.
	require.Equal(t, producer.ReservedIDPrefix, replyIDPrefix)
	reply := testsvc.Query[string](t, db, `SELECT reply_id FROM agent_outbox WHERE id = $1`, c.ids[0])[0]
	require.Regexp(t, `^baton:error:[0-9a-f]{32}$`, reply)
	_, err = producer.New(producer.Config{})
	require.NoError(t, err)
}

// A final commit cut off by a transient error (here its backend is terminated while
// it waits for a lock: SQLSTATE 57P01, connection lost) is retried, fenced as before, and
// commits once.
func TestFinishRetriesATerminatedConnection(t *testing.T) {
	ctx := context.Background()
	db, s := storeFixture(t)
	send(t, db, "c", "m1")
	const run = "00000000-0000-4000-8000-000000000051"
	c := claimOne(t, s, "c", run)

	// Another transaction holds the conversation row, so the final commit waits on it.
	blocker, err := db.Pool.Begin(ctx)
	require.NoError(t, err)
	defer func() { _ = blocker.Rollback(ctx) }()
	_, err = blocker.Exec(ctx, `SELECT 1 FROM conversations WHERE id = 'c' FOR UPDATE`)
	require.NoError(t, err)

	done := make(chan error, 1)
	go func() {
		done <- s.finishOne(ctx, finishReq{conversationID: "c", runID: run, ids: c.ids,
			outcome: outcome{role: "assistant", content: "ok"}})
	}()
	waiting := func() []int {
		return testsvc.Query[int](t, db, `SELECT pid FROM pg_stat_activity
			WHERE datname = current_database() AND wait_event_type = 'Lock' AND query LIKE '%pg_logical_emit_message%'`)
	}
	require.Eventually(t, func() bool { return len(waiting()) == 1 }, 30*time.Second, 10*time.Millisecond)
	first := waiting()[0]
	_, err = db.Pool.Exec(ctx, `SELECT pg_terminate_backend($1)`, first)
	require.NoError(t, err)
	// The commit is tried again on another connection, and waits on the lock again.
	require.Eventually(t, func() bool { w := waiting(); return len(w) == 1 && w[0] != first }, 30*time.Second, 10*time.Millisecond)
	require.NoError(t, blocker.Rollback(ctx))
	select {
	case err := <-done:
		require.NoError(t, err)
	case <-time.After(30 * time.Second):
		t.Fatal("the final commit did not finish")
	}
	require.Equal(t, []string{"done"}, testsvc.Query[string](t, db, `SELECT status FROM agent_outbox`))
	require.Equal(t, []string{"ok"}, testsvc.Query[string](t, db, `SELECT content FROM messages WHERE role = 'assistant'`))
}
