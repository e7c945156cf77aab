package consumer

import (
	"context"
	"fmt"
	"os"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/batonhq/baton/internal/testsvc"
)

// BenchmarkTurnStatements measures what a worker's turns cost PostgreSQL: the CPU time of the
// worker's one backend (what the other processes of a shared machine move least), read from the
// server's /proc/<pid>/schedstat around the loop (so the server must run on this machine, as
// the throwaway cluster does). Each iteration is one batch of turns, one conversation and one
// message each, run through the store as the worker's batchers run it: the claim, for "tools"
// a read and a write tool record (the first call's end carried by the second record, the
// second's by the final commit), and the final commit. Batches of 1, 8 and 28 conversations
// (28: what one worker's statements share at full load in baton bench turns; 8: what each of 4
// workers' share) tell a statement's fixed cost from its cost per turn.
//
// Reported: pg-µs/turn, the backend's CPU per turn. The machine's other work still moves it
// by a tenth or more between runs: compare medians of interleaved runs. Run it with
//
//	go test -run '^$' -bench TurnStatements -benchtime 200x ./consumer
func BenchmarkTurnStatements(b *testing.B) {
	for _, tools := range []bool{false, true} {
		for _, k := range []int{1, 8, 28} {
			name := "no-tools"
			if tools {
				name = "tools"
			}
			b.Run(fmt.Sprintf("%s/batch=%d", name, k), func(b *testing.B) { benchTurnStatements(b, k, tools) })
		}
	}
}

func benchTurnStatements(b *testing.B, k int, tools bool) {
	ctx := context.Background()
	db, s, pool := oneBackendStore(b)
	n := b.N * k
	preloadTurns(b, db, n)
	var pid int
	if err := pool.QueryRow(ctx, `SELECT pg_backend_pid()`).Scan(&pid); err != nil {
		b.Fatal(err)
	}
	cpu0 := backendCPU(b, pid)
	b.ResetTimer()
	for i := range b.N {
		if err := turnBatch(ctx, s, i*k+1, k, tools); err != nil {
			b.Fatal(err)
		}
	}
	b.StopTimer()
	cpu := backendCPU(b, pid) - cpu0
	b.ReportMetric(float64(cpu.Microseconds())/float64(n), "pg-µs/turn")
	var done int
	if err := db.Pool.QueryRow(ctx, `SELECT count(*) FROM agent_outbox WHERE status = 'done'`).Scan(&done); err != nil {
		b.Fatal(err)
	}
	if done != n {
		b.Fatalf("%d of %d turns done", done, n)
	}
}

// oneBackendStore returns a test database and a store on a pool of one connection (so one
// backend runs all of its statements), logged in as the worker role, which it also returns.
func oneBackendStore(t testing.TB) (*testsvc.Database, *store, *pgxpool.Pool) {
	t.Helper()
	db := testsvc.NewDatabase(t)
	pcfg, err := pgxpool.ParseConfig(db.RoleURL(testsvc.RoleWorker))
	if err != nil {
		t.Fatal(err)
	}
	pcfg.MinConns, pcfg.MaxConns = 1, 1
	pool, err := pgxpool.NewWithConfig(context.Background(), pcfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	return db, testStore(pool), pool
}

// preloadTurns writes conversations c1 … c<n>, each with one pending message, as producers
// write them (a message and its outbox row), then analyzes the tables as autovacuum would.
func preloadTurns(t testing.TB, db *testsvc.Database, n int) {
	t.Helper()
	ctx := context.Background()
	if _, err := db.Pool.Exec(ctx, `
		WITH c AS (INSERT INTO conversations (id) SELECT 'c' || g FROM generate_series(1, $1::int) g RETURNING id),
		     m AS (INSERT INTO messages (id, conversation_id, role, content) SELECT 'm' || id, id, 'user', 'hello' FROM c RETURNING id, conversation_id)
		INSERT INTO agent_outbox (conversation_id, message_id) SELECT conversation_id, id FROM m`, n); err != nil {
		t.Fatal(err)
	}
	if _, err := db.Pool.Exec(ctx, `ANALYZE`); err != nil {
		t.Fatal(err)
	}
}

// turnBatch runs the turns of conversations c<first> … c<first+k-1>, one pending message each,
// through s as a worker's batchers do: one claim of all, for tools a read and a write tool
// record of each (the first call's end carried by the second record, the second's by the
// final commit), and one final commit of all.
func turnBatch(ctx context.Context, s *store, first, k int, tools bool) error {
	claims := make([]claimReq, k)
	for j := range claims {
		claims[j] = claimReq{conversationID: "c" + strconv.Itoa(first+j), runID: newRunID()}
	}
	got, err := s.claimMany(ctx, claims)
	if err != nil {
		return err
	}
	finishes := make([]finishReq, k)
	for j, c := range got {
		if len(c.ids) != 1 {
			return fmt.Errorf("claim of %s: %d rows, want 1", claims[j].conversationID, len(c.ids))
		}
		finishes[j] = finishReq{conversationID: claims[j].conversationID, runID: claims[j].runID, ids: c.ids,
			outcome: outcome{role: "assistant", content: "echo: hello"}}
	}
	if tools {
		var ends []opEnd
		for _, effect := range []Effect{Read, Write} {
			recs := make([]recordReq, k)
			for j, f := range finishes {
				recs[j] = recordReq{runID: f.runID, conversationID: f.conversationID, ids: f.ids,
					tool: "echo_" + string(effect), effect: effect, input: []byte(`{"text":"hello"}`)}
				if ends != nil {
					recs[j].ends = ends[j : j+1]
				}
			}
			out, err := s.recordMany(ctx, recs)
			if err != nil {
				return err
			}
			ends = make([]opEnd, k)
			for j, r := range out {
				if r.err != nil {
					return r.err
				}
				ends[j] = opEnd{id: r.id, status: "done", output: []byte(`{"text":"hello"}`), took: time.Millisecond}
			}
		}
		for j := range finishes {
			finishes[j].ends = ends[j : j+1]
		}
	}
	errs, err := s.finishMany(ctx, finishes)
	if err != nil {
		return err
	}
	for _, err := range errs {
		if err != nil {
			return err
		}
	}
	return nil
}

// backendCPU is the CPU time the server process pid has used, from /proc/<pid>/schedstat.
func backendCPU(b *testing.B, pid int) time.Duration {
	b.Helper()
	raw, err := os.ReadFile(fmt.Sprintf("/proc/%d/schedstat", pid))
	if err != nil {
		b.Fatalf("read the backend's CPU time (the PostgreSQL server must run on this machine, as the throwaway cluster does): %v", err)
	}
	ns, err := strconv.ParseInt(strings.Fields(string(raw))[0], 10, 64)
	if err != nil {
		b.Fatalf("parse /proc/%d/schedstat: %v", pid, err)
	}
	return time.Duration(ns)
}

// No statement of a turn is planned afresh on every execution. Under Postgres's default
// plan_cache_mode a prepared statement gets a custom plan while custom plans look cheaper than
// its generic one, and for "id = ANY($1)" with a one-element array they always do: the claim's
// lock statement, which ran before its transaction asked for generic plans, was planned at
// every claim (66 µs, about half its cost; pg_stat_statements). Postgres makes five custom
// plans of any statement before it weighs the generic one, so more than five is the defect.
func TestTurnStatementsRunTheirCachedPlans(t *testing.T) {
	const batches = 20
	for _, tools := range []bool{false, true} {
		for _, k := range []int{1, 4} {
			t.Run(fmt.Sprintf("tools=%v/batch=%d", tools, k), func(t *testing.T) {
				ctx := context.Background()
				db, s, pool := oneBackendStore(t)
				// As many conversations as a busy outbox holds: on a small table the generic
				// plans look as cheap as custom ones.
				preloadTurns(t, db, 5000)
				for i := range batches {
					require.NoError(t, turnBatch(ctx, s, i*k+1, k, tools))
				}
				rows, err := pool.Query(ctx, `SELECT statement, generic_plans + custom_plans, custom_plans
					FROM pg_prepared_statements WHERE NOT from_sql`)
				require.NoError(t, err)
				type prepared struct {
					SQL           string
					Runs, Planned int64
				}
				stmts, err := pgx.CollectRows(rows, pgx.RowToStructByPos[prepared])
				require.NoError(t, err)
				require.NotEmpty(t, stmts)
				for _, st := range stmts {
					assert.LessOrEqual(t, st.Planned, int64(5), "planned at %d of its %d runs:\n%s", st.Planned, st.Runs, st.SQL)
				}
			})
		}
	}
}

// The rows a turn writes and then updates without changing an indexed column are updated in
// place (HOT: no new index entries): a run's record when the run ends, a tool call's operation
// when the call ends. Each is updated soon after it was inserted, when inserts had filled its
// page: with the default fillfactor (100) the new version often went to another page, and
// every index of the table got an entry for it (migration 10). Measured here before: 535 of 560
// runs' ends and 223 of 560 first calls' ends HOT; now 560 and 502.
func TestTurnUpdatesStayOnTheirPage(t *testing.T) {
	ctx := context.Background()
	db, s, pool := oneBackendStore(t)
	const batches, k = 20, 28
	preloadTurns(t, db, batches*k)
	for i := range batches {
		require.NoError(t, turnBatch(ctx, s, i*k+1, k, true))
	}
	_, err := pool.Exec(ctx, `SELECT pg_stat_force_next_flush()`)
	require.NoError(t, err)
	hot := func(table string, updates int64) int64 {
		var upd, hot int64
		require.Eventually(t, func() bool {
			err := db.Pool.QueryRow(ctx, `SELECT n_tup_upd, n_tup_hot_upd FROM pg_stat_user_tables WHERE relname = $1`,
				table).Scan(&upd, &hot)
			return err == nil && upd >= updates
		}, 10*time.Second, 20*time.Millisecond, "statistics of %s", table)
		require.Equal(t, updates, upd, table)
		return hot
	}
	const turns = batches * k
	// Each run's record is updated once, by its final commit.
	assert.GreaterOrEqual(t, hot("agent_runs", turns), int64(turns*99/100), "runs' ends updated in place")
	// Each turn's operations are updated three times: the first call's end (carried by the
	// second record), then both attached to the reply (message_id: never HOT), the second
	// call's end with its attachment.
	assert.GreaterOrEqual(t, hot("operations", 3*turns), int64(turns*80/100), "first calls' ends updated in place")
}
