package consumer

// Second round of adversarial tests of tool-call ends carried to the turn's next statement,
// of the refused-end fallbacks (endOperations, recordOperation, finishOne) and of the
// lock_timeout now set on runs' ends and recoveries.

import (
	"context"
	"errors"
	"fmt"
	"sync/atomic"
	"testing"
	"time"

	dto "github.com/prometheus/client_model/go"
	"github.com/stretchr/testify/require"

	"github.com/batonhq/baton/internal/testsvc"
)

// A class 22 refusal that is not about any end: the conversation's unread_count, which any
// role can write, is at integer's maximum, and finishSQL's "unread_count + 1" failed (22003).
// finishOne took it for a refused end, wrote the ends apart and committed again: refused again.
// The run's rows stayed processing; recovery requeued them (the turn replayed and failed the
// same way) until the last attempt, whose visible failure (endHeld → finishIn) updated the
// same counter and failed the same way at every sweep. The conversation was busy for ever.
// Now the counter stays at its maximum.
func TestAdvTools2CounterAtItsMaximumDoesNotHoldTheConversation(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db, s := storeFixture(t)
	s.maxAttempts = 1 // the last attempt (with three, the first two replay the turn and fail the same way)
	send(t, db, "c", "m1")
	const run = "00000000-0000-4000-8000-0000000bd001"
	c := claimOne(t, s, "c", run)
	require.Len(t, c.ids, 1)
	op, err := s.recordOperation(ctx, recordReq{runID: run, conversationID: "c", ids: c.ids, tool: "lookup",
		effect: Read, input: []byte(`{}`)})
	require.NoError(t, err)
	_, err = db.Pool.Exec(ctx, `UPDATE conversations SET unread_count = 2147483647 WHERE id = 'c'`)
	require.NoError(t, err)

	ferr := s.finishOne(ctx, finishReq{conversationID: "c", runID: run, ids: c.ids,
		outcome: outcome{role: "assistant", content: "answer"},
		ends:    []opEnd{{id: op, status: "done", output: []byte(`{"ok":true}`), took: time.Millisecond}}})
	t.Logf("final commit: %v", ferr)
	// The worker's run has ended (commit failed); its lease runs out and recovery takes over.
	expire(t, db)
	var rerr error
	for range 3 { // three sweeps
		_, rerr = s.recoverRun(ctx, expiredRun{runID: run, conversationID: "c"})
	}
	status := scalar[string](t, db, `SELECT status FROM agent_outbox WHERE id = $1`, c.ids[0])
	require.Contains(t, []string{"done", "error"}, status,
		"a value an application wrote in conversations (unread_count = max int) keeps the request processing for ever: "+
			"final commit failed with %v, and every recovery with %v", ferr, rerr)
}

// A turn that ran a Write tool and then failed ends by endRun (a visible failure). endRun now
// gives up after lock_timeout on an outbox row an application holds: the run's end fails
// (commit failed), its rows stay processing. Once the lock is gone and the lease has run out,
// recovery ends it as the same visible failure; the turn is never replayed. Covers endRun's
// lock_timeout, which no other test reaches (passes).
func TestAdvTools2EndRunLockTimeoutThenRecoveryNeverReplaysAWrite(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db, _ := storeFixture(t)
	var calls, charges atomic.Int32
	atBlock, goOn := make(chan struct{}, 1), make(chan struct{})
	w, err := New(Config{Pool: db.RolePool(t, testsvc.RoleWorker), PollInterval: 20 * time.Millisecond, Debounce: time.Millisecond,
		Lease: time.Minute, RecoveryInterval: 50 * time.Millisecond, MaxAttempts: 3,
		Handler: func(ctx context.Context, t *Turn) (Reply, error) {
			calls.Add(1)
			if _, err := t.Tool(ctx, "charge", Write, nil, func(context.Context) (any, error) {
				charges.Add(1)
				return "charged", nil
			}); err != nil {
				return Reply{}, err
			}
			atBlock <- struct{}{}
			<-goOn
			return Reply{}, errors.New("model failed after the charge")
		}})
	require.NoError(t, err)
	w.store.lockTimeout = 200 * time.Millisecond
	runWorker(t, w)
	send(t, db, "c", "m1")
	select {
	case <-atBlock:
	case <-time.After(10 * time.Second):
		t.Fatal("the handler never reached its tool call")
	}
	app := holdOpen(t, db, `UPDATE agent_outbox SET last_error = last_error WHERE conversation_id = 'c'`)
	close(goOn)
	// endRun waits on the held outbox row (lockRunSQL), then gives up after lock_timeout
	// (without it, only the end's 30 s deadline would stop the wait).
	require.Eventually(t, func() bool {
		var m dto.Metric
		require.NoError(t, w.m.turns.WithLabelValues(resultCommitFailed).Write(&m))
		return m.GetCounter().GetValue() == 1
	}, 10*time.Second, 10*time.Millisecond, "the run's end did not give up on the held outbox row")
	require.Equal(t, "processing", scalar[string](t, db, `SELECT status FROM agent_outbox`))
	require.NoError(t, app.Rollback(ctx))
	expire(t, db)
	advEventually(t, func() bool {
		return scalar[int](t, db, `SELECT count(*) FROM agent_outbox WHERE status IN ('done', 'error')`) == 1
	}, 10*time.Second, func() string {
		return fmt.Sprintf("the run was never ended: %v", testsvc.Query[string](t, db, `SELECT status FROM agent_outbox`))
	})
	require.Equal(t, "error", scalar[string](t, db, `SELECT status FROM agent_outbox`))
	require.Equal(t, 1, scalar[int](t, db, `SELECT count(*) FROM messages WHERE role = 'error'`))
	require.EqualValues(t, 1, calls.Load(), "a turn whose Write tool ran was replayed")
	require.EqualValues(t, 1, charges.Load())
	require.Equal(t, "done", scalar[string](t, db, `SELECT status FROM operations`),
		"the charge's end, written before the run's end, was lost")
}

// Several refused ends in one shared final commit: two of one run (a lone surrogate and a
// number beyond numeric's range) and one of another run, next to a healthy run. Every run
// commits its reply; each refused end is written done, without its output, saying why; the
// good end of the same run keeps its output. Covers endOperations' one-by-one loop with more
// than one refused end, reached from finishMany's redo (passes).
func TestAdvTools2SeveralRefusedEndsInASharedFinalCommit(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db, s := storeFixture(t)
	convs := []string{"a", "b", "g"}
	conversations(t, db, convs...)
	var reqs []finishReq
	ops := map[string][]int64{}
	for i, conv := range convs {
		send(t, db, conv, conv+"-m1")
		run := fmt.Sprintf("00000000-0000-4000-8000-0000000bd1%02d", i)
		c := claimOne(t, s, conv, run)
		for range 3 {
			id, err := s.recordOperation(ctx, recordReq{runID: run, conversationID: conv, ids: c.ids, tool: "t",
				effect: Write, input: []byte(`{}`)})
			require.NoError(t, err)
			ops[conv] = append(ops[conv], id)
		}
		outs := [][]byte{[]byte(`{"ok":1}`), []byte(`{"ok":2}`), []byte(`{"ok":3}`)}
		switch conv {
		case "a":
			outs[0], outs[2] = loneSurrogate, []byte(`{"n":1e1000000}`)
		case "b":
			outs[1] = []byte(`{"q":"\u0000"}`)
		}
		var ends []opEnd
		for k, id := range ops[conv] {
			ends = append(ends, opEnd{id: id, status: "done", output: outs[k], took: time.Millisecond})
		}
		reqs = append(reqs, finishReq{conversationID: conv, runID: run, ids: c.ids,
			outcome: outcome{role: "assistant", content: "re " + conv}, ends: ends})
	}
	errs, err := s.finishMany(ctx, reqs)
	require.NoError(t, err)
	for i := range errs {
		require.NoError(t, errs[i], convs[i])
	}
	require.Equal(t, []string{"a:done", "b:done", "g:done"}, testsvc.Query[string](t, db,
		`SELECT conversation_id || ':' || status FROM agent_outbox ORDER BY 1`))
	got := testsvc.Query[string](t, db, `SELECT conversation_id || ' ' || status || ' ' || coalesce(output::text, '-') || ' ' ||
		coalesce(error, '-') || ' ' || (message_id IS NOT NULL) FROM operations ORDER BY id`)
	require.Len(t, got, 9)
	for _, row := range got {
		t.Log(row)
		require.Contains(t, row, " done ")
		require.Contains(t, row, " true")
	}
	require.Contains(t, got[0], "output not stored: the database refused it")
	require.Contains(t, got[1], `{"ok": 2}`)
	require.Contains(t, got[2], "output not stored: the database refused it")
	require.Contains(t, got[4], "output not stored: the database refused it")
	require.Equal(t, `g done {"ok": 3} - true`, got[8])
}
