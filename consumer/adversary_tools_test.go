package consumer

// Adversarial tests of how a turn records its tool calls: the operation row committed before
// the call, the call's end carried to the turn's next statement (the next record, or the
// final commit).

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgconn"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/batonhq/baton/internal/testsvc"
)

// loneSurrogate is JSON that Go accepts (encoding/json validates and passes it through as a
// json.RawMessage, e.g. a tool that hands on an upstream API's answer, cut inside an emoji) and
// that Postgres's jsonb refuses: "Unicode low surrogate must follow a high surrogate" (22P02).
// Its end is carried to the turn's next statement, which Postgres then refuses.
var loneSurrogate = json.RawMessage(`{"text":"\ud83d"}`)

// A tool call returned and the handler replied, but the call's output is one jsonb refuses:
// the turn still commits its reply, and the operation is done, its output left out and its
// error saying why. The final commit carrying that end was refused whole, and the fallback
// endOperations carried the same end and failed too: the reply was discarded, the rows stayed
// processing until the lease ran out, and the turn was replayed (a Read tool).
func TestAdvToolsRefusedOutputDoesNotCostTheReply(t *testing.T) {
	t.Parallel()
	db, _ := storeFixture(t)
	var mu sync.Mutex
	var toolErrs []error
	w, err := New(Config{Pool: db.RolePool(t, testsvc.RoleWorker), PollInterval: 20 * time.Millisecond, Debounce: time.Millisecond,
		Lease: time.Minute, RecoveryInterval: time.Minute,
		Handler: func(ctx context.Context, t *Turn) (Reply, error) {
			_, err := t.Tool(ctx, "fetch_page", Read, map[string]string{"url": "x"}, func(context.Context) (any, error) {
				return loneSurrogate, nil
			})
			mu.Lock()
			toolErrs = append(toolErrs, err)
			mu.Unlock()
			if err != nil {
				return Reply{Content: "the tool failed, answering without it"}, nil
			}
			return Reply{Content: "answer"}, nil
		}})
	require.NoError(t, err)
	runWorker(t, w)
	send(t, db, "c", "m1")
	require.Eventually(t, func() bool {
		mu.Lock()
		defer mu.Unlock()
		return len(toolErrs) > 0
	}, 10*time.Second, 10*time.Millisecond)
	terminal := func() bool {
		return scalar[int](t, db, `SELECT count(*) FROM agent_outbox WHERE status IN ('done', 'error')`) == 1
	}
	advEventually(t, terminal, 10*time.Second, func() string {
		mu.Lock()
		defer mu.Unlock()
		return fmt.Sprintf("the tool call returned (err=%v) and the handler replied, yet the turn did not commit: rows %v, operations %v, runs %v",
			toolErrs, testsvc.Query[string](t, db, `SELECT status FROM agent_outbox`),
			testsvc.Query[string](t, db, `SELECT status || ' ' || coalesce(error, '') FROM operations`),
			testsvc.Query[string](t, db, `SELECT coalesce(outcome, 'unfinished') FROM agent_runs`))
	})
	require.Equal(t, []string{"done"}, testsvc.Query[string](t, db, `SELECT status FROM agent_outbox`))
	require.Equal(t, "done - output not stored: the database refused it: invalid input syntax for type json (SQLSTATE 22P02)",
		scalar[string](t, db, `SELECT status || ' ' || coalesce(output::text, '-') || ' ' || error FROM operations`))
}

// A tool call whose output jsonb refuses does not fail the turn's later calls. It did: the next
// Tool call's record carried that end, Postgres refused the record, Tool kept the end and
// returned an error without running fn, and so on for every call after it; the good ends
// carried alongside were never written either.
func TestAdvToolsRefusedOutputDoesNotFailLaterCalls(t *testing.T) {
	t.Parallel()
	db, _ := storeFixture(t)
	var mu sync.Mutex
	var firstErr, secondErr error
	secondRan := false
	done := make(chan struct{})
	w, err := New(Config{Pool: db.RolePool(t, testsvc.RoleWorker), PollInterval: 20 * time.Millisecond, Debounce: time.Millisecond,
		Lease: time.Minute, RecoveryInterval: time.Minute, MaxAttempts: 1,
		Handler: func(ctx context.Context, t *Turn) (Reply, error) {
			_, e1 := t.Tool(ctx, "fetch_page", Read, nil, func(context.Context) (any, error) { return loneSurrogate, nil })
			_, e2 := t.Tool(ctx, "lookup", Read, nil, func(context.Context) (any, error) {
				mu.Lock()
				secondRan = true
				mu.Unlock()
				return "ok", nil
			})
			mu.Lock()
			firstErr, secondErr = e1, e2
			mu.Unlock()
			select {
			case <-done:
			default:
				close(done)
			}
			return Reply{Content: "answer"}, nil
		}})
	require.NoError(t, err)
	runWorker(t, w)
	send(t, db, "c", "m1")
	select {
	case <-done:
	case <-time.After(15 * time.Second):
		t.Fatal("the handler never finished")
	}
	mu.Lock()
	defer mu.Unlock()
	t.Logf("first call: %v; second call: %v", firstErr, secondErr)
	require.True(t, firstErr != nil || (secondErr == nil && secondRan),
		"the second, healthy tool call failed (%v, fn ran: %v) because the first call's output, returned without error, was carried into its record",
		secondErr, secondRan)
}

// A turn's first tool call carries no ends, and recordOperation sent recordOperationSQL alone,
// without genericPlansSQL: no lock_timeout. Its FOR SHARE on the run's outbox rows waited for
// as long as another transaction held one of them (an application or operator updating the
// outbox in a long transaction), where every other claim, record and final commit fails with
// 55P03 after lock_timeout. In a worker this record runs in the one records runner (a batch of
// one, or the one-by-one redo after a shared record failed on that lock), which then stalled
// every turn's tool calls up to the batch deadline (30 s).
func TestAdvToolsFirstRecordHonoursLockTimeout(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db, s := storeFixture(t)
	s.lockTimeout = 200 * time.Millisecond
	send(t, db, "c", "m1")
	const run = "00000000-0000-4000-8000-00000000ad01"
	c := claimOne(t, s, "c", run)
	require.Len(t, c.ids, 1)

	holdOpen(t, db, `UPDATE agent_outbox SET last_error = last_error WHERE id = $1`, c.ids[0])

	// The turn's first call, which carries no end, fails after lock_timeout.
	rctx, cancel := context.WithTimeout(ctx, 20*s.lockTimeout)
	defer cancel()
	_, err := s.recordOperation(rctx, recordReq{runID: run, conversationID: "c", ids: c.ids, tool: "first",
		effect: Read, input: []byte(`{}`)})
	var pgErr *pgconn.PgError
	require.True(t, errors.As(err, &pgErr) && pgErr.Code == "55P03",
		"a turn's first tool record waited past lock_timeout (%v) for a held outbox row; got %v", s.lockTimeout, err)
}

// A tool call that returned, but whose output encoding/json cannot encode (a NaN in a result
// struct), records its end: done, no output, the error saying why. Tool returned an error
// without keeping an end, and the final commit marked the operation "interrupted: the turn
// ended before the tool call did", though the call had ended (a Write tool's effect happened).
func TestAdvToolsUnencodableOutputStillRecordsTheEnd(t *testing.T) {
	t.Parallel()
	db, _ := storeFixture(t)
	w, err := New(Config{Pool: db.RolePool(t, testsvc.RoleWorker), PollInterval: 20 * time.Millisecond, Debounce: time.Millisecond,
		Lease: time.Minute, RecoveryInterval: time.Minute,
		Handler: func(ctx context.Context, t *Turn) (Reply, error) {
			_, err := t.Tool(ctx, "charge", Write, nil, func(context.Context) (any, error) {
				return map[string]float64{"amount": math.NaN()}, nil
			})
			if err != nil {
				return Reply{Content: "charged, but the receipt could not be read"}, nil
			}
			return Reply{Content: "charged"}, nil
		}})
	require.NoError(t, err)
	runWorker(t, w)
	send(t, db, "c", "m1")
	require.Eventually(t, func() bool {
		return scalar[int](t, db, `SELECT count(*) FROM agent_outbox WHERE status IN ('done', 'error')`) == 1
	}, 10*time.Second, 20*time.Millisecond)
	got := scalar[string](t, db, `SELECT status || ': ' || coalesce(error, '') FROM operations`)
	require.NotContains(t, got, "interrupted",
		"the tool call returned (its effect happened); its operation must record that end, not an interruption")
	require.Equal(t, "done: output not stored: cannot encode it as JSON: json: unsupported value: NaN", got)
}

// The worker-level cost of a record without lock_timeout: a turn whose first tool call waits
// on its held outbox row holds the one records runner, and another conversation's first tool
// call, with nothing held, waited behind it until the batch deadline (30 s). Scaled lock
// timeout: 200ms; b's call must be answered well within the 10 s bound.
func TestAdvToolsHeldRowDoesNotStallOtherTurnsTools(t *testing.T) {
	t.Parallel()
	db, _ := storeFixture(t)
	conversations(t, db, "h", "b")
	hClaimed, hGo := make(chan struct{}), make(chan struct{})
	bDone := make(chan error, 1)
	var hCalled atomic.Bool // h's tool call returned: its record's wait is over
	w, err := New(Config{Pool: db.RolePool(t, testsvc.RoleWorker), PollInterval: 20 * time.Millisecond, Debounce: time.Millisecond,
		Lease: time.Minute, RecoveryInterval: time.Minute,
		Handler: func(ctx context.Context, t *Turn) (Reply, error) {
			if t.ConversationID == "h" {
				close(hClaimed)
				<-hGo
			}
			_, err := t.Tool(ctx, "lookup", Read, nil, func(context.Context) (any, error) { return "ok", nil })
			if t.ConversationID == "b" {
				bDone <- err
			} else {
				hCalled.Store(true)
			}
			return Reply{Content: "re " + t.ConversationID}, nil
		}})
	require.NoError(t, err)
	w.store.lockTimeout = 200 * time.Millisecond
	runWorker(t, w)

	send(t, db, "h", "h-m1")
	<-hClaimed
	// An application transaction updates h's outbox row and stays open.
	holdOpen(t, db, `UPDATE agent_outbox SET last_error = last_error WHERE conversation_id = 'h'`)
	close(hGo)
	awaitLockWait(t, db, "INSERT INTO operations", "h's tool record never waited on the row", hCalled.Load)

	send(t, db, "b", "b-m1")
	select {
	case err := <-bDone:
		require.NoError(t, err)
	case <-time.After(10 * time.Second):
		t.Fatalf("b's first tool call, with nothing of b held, is still waiting behind h's record (lock_timeout %v)",
			w.store.lockTimeout)
	}
}

// Many tool calls of one turn run at once from several goroutines: every call is recorded,
// every end that returned is written once, with its own output, whichever statement carried
// it (another goroutine's record or the final commit). Covers concurrent Tool calls of one
// turn, which no other test makes.
func TestAdvToolsConcurrentCallsOfOneTurnAllEnd(t *testing.T) {
	t.Parallel()
	db, _ := storeFixture(t)
	const calls = 40
	w, err := New(Config{Pool: db.RolePool(t, testsvc.RoleWorker), PollInterval: 20 * time.Millisecond, Debounce: time.Millisecond,
		Lease: time.Minute, RecoveryInterval: time.Minute,
		Handler: func(ctx context.Context, t *Turn) (Reply, error) {
			var wg sync.WaitGroup
			errs := make(chan error, calls)
			for i := range calls {
				wg.Go(func() {
					effect := Read
					if i%5 == 0 {
						effect = Write
					}
					_, err := t.Tool(ctx, "call", effect, map[string]int{"i": i}, func(context.Context) (any, error) {
						if i%7 == 0 {
							return nil, errors.New("tool error")
						}
						return map[string]int{"i": i}, nil
					})
					if err != nil && !errors.Is(err, ErrToolFailed) {
						errs <- err
					}
				})
			}
			wg.Wait()
			close(errs)
			for err := range errs {
				return Reply{}, err
			}
			return Reply{Content: "all"}, nil
		}})
	require.NoError(t, err)
	runWorker(t, w)
	send(t, db, "c", "m1")
	require.Eventually(t, func() bool {
		return scalar[int](t, db, `SELECT count(*) FROM agent_outbox WHERE status IN ('done', 'error')`) == 1
	}, 20*time.Second, 20*time.Millisecond)
	require.Equal(t, []string{"done"}, testsvc.Query[string](t, db, `SELECT status FROM agent_outbox`))
	require.Equal(t, calls, scalar[int](t, db, `SELECT count(*) FROM operations`))
	bad := testsvc.Query[string](t, db, `SELECT id || ' ' || status || ' ' || coalesce(output::text, '-') || ' ' || coalesce(error, '-')
		FROM operations
		WHERE message_id IS NULL OR finished_at IS NULL
		   OR NOT ((input->>'i')::int % 7 = 0 AND status = 'error' AND error LIKE '%tool error%'
		        OR (input->>'i')::int % 7 <> 0 AND status = 'done' AND output = input)`)
	require.Empty(t, bad, "operations whose end was lost or mixed up")
}

// Shared statements and bad ends: one run's carried end is refused by Postgres (its output) and
// another's names an operation an operator deleted. Every run's call is recorded, its end
// written (the refused one without its output), its reply committed. Covers refused and orphan
// ends in recordMany's and finishMany's one-by-one redo (other tests refuse an input or a
// reply, never a carried end).
func TestAdvToolsBadEndInASharedStatementFailsAlone(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db, s := storeFixture(t)
	convs := []string{"bad", "orphan", "good"}
	conversations(t, db, convs...)
	runs := map[string]string{}
	claims := map[string]claim{}
	first := map[string]int64{}
	for i, conv := range convs {
		send(t, db, conv, conv+"-m1")
		runs[conv] = "00000000-0000-4000-8000-0000000ad0" + string(rune('a'+i)) + "1"
		claims[conv] = claimOne(t, s, conv, runs[conv])
		id, err := s.recordOperation(ctx, recordReq{runID: runs[conv], conversationID: conv, ids: claims[conv].ids,
			tool: "first", effect: Read, input: []byte(`{}`)})
		require.NoError(t, err)
		first[conv] = id
	}
	_, err := db.Pool.Exec(ctx, `DELETE FROM operations WHERE id = $1`, first["orphan"])
	require.NoError(t, err)
	end := func(conv string) opEnd {
		out := []byte(`{"ok":true}`)
		if conv == "bad" {
			out = loneSurrogate
		}
		return opEnd{id: first[conv], status: "done", output: out, took: time.Millisecond}
	}
	var reqs []recordReq
	for _, conv := range convs {
		reqs = append(reqs, recordReq{runID: runs[conv], conversationID: conv, ids: claims[conv].ids, tool: "second",
			effect: Write, input: []byte(`{}`), ends: []opEnd{end(conv)}})
	}
	got, err := s.recordMany(ctx, reqs)
	require.NoError(t, err)
	require.NoError(t, got[0].err, "the record carrying a refused end is recorded, its end without the output")
	require.NoError(t, got[1].err, "an end whose operation is gone is nothing to fail for")
	require.NoError(t, got[2].err)
	require.Equal(t, `done {"ok": true}`, scalar[string](t, db,
		`SELECT status || ' ' || output::text FROM operations WHERE id = $1`, first["good"]))
	require.Equal(t, "done - output not stored: the database refused it: invalid input syntax for type json (SQLSTATE 22P02)",
		scalar[string](t, db, `SELECT status || ' ' || coalesce(output::text, '-') || ' ' || error FROM operations WHERE id = $1`, first["bad"]))

	var fins []finishReq
	for i, conv := range convs[1:] {
		fins = append(fins, finishReq{conversationID: conv, runID: runs[conv], ids: claims[conv].ids,
			outcome: outcome{role: "assistant", content: "re " + conv},
			ends:    []opEnd{{id: got[i+1].id, status: "done", output: []byte(`{"sent":true}`), took: time.Millisecond}}})
	}
	// The bad run's final commit carries the refused end again (Tool kept it).
	fins = append(fins, finishReq{conversationID: "bad", runID: runs["bad"], ids: claims["bad"].ids,
		outcome: outcome{role: "assistant", content: "re bad"}, ends: []opEnd{end("bad")}})
	errs, err := s.finishMany(ctx, fins)
	require.NoError(t, err)
	require.NoError(t, errs[0])
	require.NoError(t, errs[1])
	require.NoError(t, errs[2])
	require.Equal(t, []string{"bad:done", "good:done", "orphan:done"}, testsvc.Query[string](t, db,
		`SELECT conversation_id || ':' || status FROM agent_outbox WHERE conversation_id <> 'c' ORDER BY 1`))
	require.Equal(t, []string{`second done {"sent": true}`, `second done {"sent": true}`}, testsvc.Query[string](t, db,
		`SELECT tool || ' ' || status || ' ' || output::text FROM operations WHERE conversation_id IN ('good', 'orphan') AND tool = 'second'`))
}

// Recovery closes a dead run's operations still running (closeOperationsSQL). It did so with
// no lock_timeout and the worker's own context: an operation row another transaction holds (an
// operator's update of operations, left open) stalled the worker's recovery loop on that run,
// and every expired run after it stayed processing ("expired leases are recovered" no longer
// held for this worker). Now it gives up on that run after lock_timeout and goes on.
func TestAdvToolsHeldOperationDoesNotStallRecovery(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db, s := storeFixture(t)
	conversations(t, db, "h", "b")
	send(t, db, "h", "h-m1")
	const runH, runB = "00000000-0000-4000-8000-0000000ad1a1", "00000000-0000-4000-8000-0000000ad1b1"
	require.Len(t, claimOne(t, s, "h", runH).ids, 1)
	operation(t, db, runH, "h", "read", "running")
	holdOpen(t, db, `UPDATE operations SET tool = tool WHERE run_id = $1`, runH)
	expire(t, db)

	w, err := New(Config{Pool: db.RolePool(t, testsvc.RoleWorker), PollInterval: 20 * time.Millisecond, Debounce: time.Millisecond,
		Lease: time.Minute, RecoveryInterval: 50 * time.Millisecond,
		Handler: func(context.Context, *Turn) (Reply, error) { return Reply{Content: "ok"}, nil }})
	require.NoError(t, err)
	w.store.lockTimeout = 200 * time.Millisecond
	runWorker(t, w)
	awaitLockWait(t, db, "UPDATE operations", "recovery never reached h's operation")

	// Another run dies, with nothing of it held: its row is written as a dead run leaves it.
	_, err = db.Pool.Exec(ctx, `WITH m AS (INSERT INTO messages (id, conversation_id, role, content)
		VALUES ('b-m1', 'b', 'user', 'hi') RETURNING id)
		INSERT INTO agent_outbox (conversation_id, message_id, status, run_id, attempts, lease_expires_at)
		SELECT 'b', id, 'processing', $1, 1, now() - interval '1 second' FROM m`, runB)
	require.NoError(t, err)
	advEventually(t, func() bool {
		return scalar[int](t, db, `SELECT count(*) FROM agent_outbox WHERE conversation_id = 'b' AND status IN ('done', 'error')`) == 1
	}, 10*time.Second, func() string {
		return fmt.Sprintf("b's expired run was never recovered: recovery waits on h's held operation row; b: %v",
			testsvc.Query[string](t, db, `SELECT status || ' ' || coalesce(run_id::text, '-') FROM agent_outbox WHERE conversation_id = 'b'`))
	})
}

// advEventually waits up to within for cond, and fails with msg(), evaluated then.
func advEventually(t *testing.T, cond func() bool, within time.Duration, msg func() string) {
	t.Helper()
	if !assert.Eventually(t, cond, within, 20*time.Millisecond) {
		t.Fatal(msg())
	}
}

// A record refused because the run lost its lease (errLeaseLost) still writes the ends it
// carries: Tool drops them then, trusting that. Covers both the single and the shared record
// statement on that path.
func TestAdvToolsLeaseLostRecordStillWritesItsEnds(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	for _, shared := range []bool{false, true} {
		t.Run(fmt.Sprintf("shared=%v", shared), func(t *testing.T) {
			db, s := storeFixture(t)
			conversations(t, db, "other")
			send(t, db, "c", "m1")
			send(t, db, "other", "o1")
			const run, other = "00000000-0000-4000-8000-0000000ad2a1", "00000000-0000-4000-8000-0000000ad2b1"
			c, o := claimOne(t, s, "c", run), claimOne(t, s, "other", other)
			id, err := s.recordOperation(ctx, recordReq{runID: run, conversationID: "c", ids: c.ids, tool: "first", effect: Write, input: []byte(`{}`)})
			require.NoError(t, err)
			_, err = db.Pool.Exec(ctx, `UPDATE agent_outbox SET lease_expires_at = now() - interval '1 second' WHERE conversation_id = 'c'`)
			require.NoError(t, err)
			req := recordReq{runID: run, conversationID: "c", ids: c.ids, tool: "second", effect: Write, input: []byte(`{}`),
				ends: []opEnd{{id: id, status: "done", output: []byte(`{"sent":true}`), took: time.Millisecond}}}
			if shared {
				got, err := s.recordMany(ctx, []recordReq{req, {runID: other, conversationID: "other", ids: o.ids, tool: "x", effect: Read, input: []byte(`{}`)}})
				require.NoError(t, err)
				require.ErrorIs(t, got[0].err, errLeaseLost)
				require.NoError(t, got[1].err)
			} else {
				_, err = s.recordOperation(ctx, req)
				require.ErrorIs(t, err, errLeaseLost)
			}
			require.Equal(t, []string{`first done {"sent": true}`}, testsvc.Query[string](t, db,
				`SELECT tool || ' ' || status || ' ' || coalesce(output::text, '-') FROM operations WHERE run_id = $1`, run))
		})
	}
}

// A call whose own input Postgres refuses fails, but the ends it carried are written on their
// own first, and the error says so, so that Tool does not carry them again.
func TestAdvToolsRefusedInputStillWritesTheEndsItCarried(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db, s := storeFixture(t)
	send(t, db, "c", "m1")
	const run = "00000000-0000-4000-8000-0000000ad3a1"
	c := claimOne(t, s, "c", run)
	first, err := s.recordOperation(ctx, recordReq{runID: run, conversationID: "c", ids: c.ids, tool: "first", effect: Write, input: []byte(`{}`)})
	require.NoError(t, err)
	_, err = s.recordOperation(ctx, recordReq{runID: run, conversationID: "c", ids: c.ids, tool: "second", effect: Read,
		input: []byte(`{"q":"\u0000"}`), ends: []opEnd{{id: first, status: "done", output: []byte(`{"sent":true}`), took: time.Millisecond}}})
	require.Error(t, err)
	require.NotErrorIs(t, err, errLeaseLost)
	require.ErrorAs(t, err, new(endsWrittenError))
	require.Equal(t, []string{`first done {"sent": true}`}, testsvc.Query[string](t, db,
		`SELECT tool || ' ' || status || ' ' || coalesce(output::text, '-') FROM operations WHERE run_id = $1`, run))
}
