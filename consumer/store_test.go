package consumer

import (
	"context"
	"fmt"
	"os"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/batonhq/baton/internal/testsvc"
	"github.com/batonhq/baton/producer"
)

// storeFixture is a test database with one conversation and a store on it, logged in as
// roles.sql's worker role, as deployed (db.Pool is the owner's, for setting up and observing).
func storeFixture(t *testing.T) (*testsvc.Database, *store) {
	t.Helper()
	db := testsvc.NewDatabase(t)
	_, err := db.Pool.Exec(context.Background(), `INSERT INTO conversations (id) VALUES ('c')`)
	require.NoError(t, err)
	return db, testStore(db.RolePool(t, testsvc.RoleWorker))
}

// testStore is the store the tests use on pool: one-minute leases, three attempts, no backoff.
func testStore(pool *pgxpool.Pool) *store {
	return &store{pool: pool, lease: time.Minute, maxAttempts: 3,
		backoff: func(int) time.Duration { return 0 }, worker: "test",
		maxRows: 100, maxBytes: 8 << 20, failureMessage: DefaultFailureMessage}
}

func send(t *testing.T, db *testsvc.Database, conv string, ids ...string) {
	t.Helper()
	p, err := producer.New(producer.Config{})
	require.NoError(t, err)
	for _, id := range ids {
		_, err := p.Send(context.Background(), db.Pool, producer.Message{ConversationID: conv, ID: id, Content: "hi " + id})
		require.NoError(t, err)
	}
}

// claimOne claims conversation conv for run.
func claimOne(t *testing.T, s *store, conv, run string) claim {
	t.Helper()
	cs, err := s.claimMany(context.Background(), []claimReq{{conv, run}})
	require.NoError(t, err)
	return cs[0]
}

func scalar[T any](t *testing.T, db *testsvc.Database, sql string, args ...any) T {
	t.Helper()
	var v T
	require.NoError(t, db.Pool.QueryRow(context.Background(), sql, args...).Scan(&v))
	return v
}

// A run whose rows are no longer all its own commits nothing: not the reply, not the
// conversation's metadata, not its run record, not the rows it still holds.
func TestFinishIsFencedByRunID(t *testing.T) {
	ctx := context.Background()
	for _, lost := range []string{"all rows", "one row"} {
		t.Run(lost, func(t *testing.T) {
			db, s := storeFixture(t)
			send(t, db, "c", "m1", "m2")
			const run = "00000000-0000-4000-8000-000000000001"
			c := claimOne(t, s, "c", run)
			require.Len(t, c.ids, 2)

			// Recovery took the rows of the expired run and another run claimed them.
			where := "run_id = $1"
			if lost == "one row" {
				where += fmt.Sprintf(" AND id = %d", c.ids[1])
			}
			_, err := db.Pool.Exec(ctx, `UPDATE agent_outbox SET run_id = gen_random_uuid() WHERE `+where, run)
			require.NoError(t, err)

			err = s.finishOne(ctx, finishReq{conversationID: "c", runID: run, ids: c.ids, outcome: outcome{role: "assistant", content: "late"}})
			require.ErrorIs(t, err, errLeaseLost)
			require.Zero(t, scalar[int](t, db, `SELECT count(*) FROM messages WHERE role <> 'user'`), "no reply committed")
			require.Zero(t, scalar[int](t, db, `SELECT count(*) FROM agent_outbox WHERE status <> 'processing'`), "rows untouched")
			require.Zero(t, scalar[int](t, db, `SELECT unread_count FROM conversations WHERE id = 'c'`))
			require.Zero(t, scalar[int](t, db, `SELECT count(*) FROM agent_runs WHERE finished_at IS NOT NULL`))
		})
	}
}

// A conversation deleted during the turn is a cancellation, told apart from a lost lease,
// and nothing is recreated.
func TestFinishAfterConversationDeleted(t *testing.T) {
	ctx := context.Background()
	db, s := storeFixture(t)
	send(t, db, "c", "m1")
	const run = "00000000-0000-4000-8000-000000000002"
	c := claimOne(t, s, "c", run)
	_, err := db.Pool.Exec(ctx, `DELETE FROM conversations WHERE id = 'c'`)
	require.NoError(t, err)

	err = s.finishOne(ctx, finishReq{conversationID: "c", runID: run, ids: c.ids, outcome: outcome{role: "assistant", content: "late"}})
	require.ErrorIs(t, err, errConversationGone)
	require.Zero(t, scalar[int](t, db, `SELECT count(*) FROM conversations`))
	require.Zero(t, scalar[int](t, db, `SELECT count(*) FROM messages`))
}

// Every statement on a run's rows finds them by key, whatever the planner believes about how
// many rows are processing: with 5,000 processing rows of other runs and 5,000 operations of
// theirs (statistics taken when there were none) the generic plans (what prepared statements
// get after a few runs) of the claim, the final commit, the renewal and the tool check read
// only their own rows.
func TestRunStatementsReadOnlyTheirRows(t *testing.T) {
	ctx := context.Background()
	db, s := storeFixture(t)
	_, err := db.Pool.Exec(ctx, `
		WITH c AS (INSERT INTO conversations (id) SELECT 'o' || g FROM generate_series(1, 5000) g RETURNING id),
		     m AS (INSERT INTO messages (id, conversation_id, role, content) SELECT id, id, 'user', 'x' FROM c RETURNING id)
		INSERT INTO agent_outbox (conversation_id, message_id, status) SELECT id, id, 'done' FROM m`)
	require.NoError(t, err)
	_, err = db.Pool.Exec(ctx, `ANALYZE`)
	require.NoError(t, err)
	_, err = db.Pool.Exec(ctx, `UPDATE agent_outbox SET status = 'processing', run_id = gen_random_uuid(),
		lease_expires_at = now() + interval '1 hour'`)
	require.NoError(t, err)
	_, err = db.Pool.Exec(ctx, `INSERT INTO operations (run_id, conversation_id, tool, effect)
		SELECT run_id, conversation_id, 'lookup', 'read' FROM agent_outbox`)
	require.NoError(t, err)
	send(t, db, "c", "m1")
	const run = "00000000-0000-4000-8000-000000000003"

	// plan runs sql as a prepared statement with its generic plan under EXPLAIN ANALYZE (in a
	// transaction it rolls back, after the statements in before) and returns the plan.
	plan := func(types, sql, args string, before ...string) string {
		t.Helper()
		tx, err := db.Pool.Begin(ctx)
		require.NoError(t, err)
		defer func() { _ = tx.Rollback(ctx) }()
		for _, b := range append([]string{`SET LOCAL plan_cache_mode = force_generic_plan`}, before...) {
			_, err := tx.Exec(ctx, b)
			require.NoError(t, err)
		}
		lines, err := explainPrepared(ctx, tx, types, sql, args)
		require.NoError(t, err)
		return strings.Join(lines, "\n")
	}
	// narrow fails when a plan node read more than a few rows, or threw more than a few away.
	readRows := regexp.MustCompile(`(?:actual rows=|Rows Removed by Filter: )(\d+)`)
	narrow := func(name, plan string) {
		t.Helper()
		for _, m := range readRows.FindAllStringSubmatch(plan, -1) {
			n, _ := strconv.Atoi(m[1])
			require.LessOrEqual(t, n, 10, "%s reads other runs' rows:\n%s", name, plan)
		}
	}

	claimPlan := plan(`text[], uuid[], bigint, text, int, int`, claimSQL, fmt.Sprintf(`'{c}', '{%s}', 60000, 'w', 100, 8388608`, run),
		`SELECT set_config('baton.claim_locked', '["c"]', true)`)
	narrow("claim", claimPlan)

	c := claimOne(t, s, "c", run)
	require.Len(t, c.ids, 1)
	held := plan(`text, uuid, bigint[], bigint`, renewSQL, fmt.Sprintf(`'c', '%s', '{%d}', 60000`, run, c.ids[0]))
	require.Contains(t, held, "agent_outbox_running", held)
	narrow("renew", held)
	tool := plan(`uuid, text, text, text, jsonb, bigint[]`, recordOperationSQL,
		fmt.Sprintf(`'%s', 'c', 'tool', 'read', '{}', '{%d}'`, run, c.ids[0]))
	narrow("tool check", tool)
	finishPlan := plan(finishTypes, finishSQL,
		fmt.Sprintf(`'{c}', '{%s}', '{done}', '{reply:x}', '{assistant}', '{ok}', '{NULL}', '{"{}"}', '{%d}', 'baton.answers', '{1}', '{NULL}', '{1}', '{done}', '{NULL}', '{NULL}', '{0}', '{%s}', '{reply:x}'`, run, c.ids[0], run),
		strings.Replace(genericPlansSQL, "$1", "'5000ms'", 1))
	narrow("final commit", finishPlan)

	err = s.finishOne(ctx, finishReq{conversationID: "c", runID: run, ids: c.ids, outcome: outcome{role: "assistant", content: "ok"}})
	require.NoError(t, err)
	require.Equal(t, "done", scalar[string](t, db, `SELECT status FROM agent_outbox WHERE conversation_id = 'c'`))
}

// One claim statement serves many conversations: each gets its own run, a conversation held by
// a concurrent claimer is reported not locked, a busy one busy, and neither is claimed.
func TestClaimManyConversations(t *testing.T) {
	ctx := context.Background()
	db, s := storeFixture(t)
	_, err := db.Pool.Exec(ctx, `INSERT INTO conversations (id) VALUES ('held'), ('busy'), ('empty')`)
	require.NoError(t, err)
	send(t, db, "c", "c1", "c2")
	send(t, db, "held", "h1")
	send(t, db, "busy", "b1")
	claimOne(t, s, "busy", "00000000-0000-4000-8000-0000000000b0")
	send(t, db, "busy", "b2")

	// Another claimer holds "held" for the length of our claim.
	tx, err := db.Pool.Begin(ctx)
	require.NoError(t, err)
	defer func() { _ = tx.Rollback(ctx) }()
	_, err = tx.Exec(ctx, `SELECT 1 FROM conversations WHERE id = 'held' FOR NO KEY UPDATE`)
	require.NoError(t, err)

	runs := []string{"00000000-0000-4000-8000-0000000000c1", "00000000-0000-4000-8000-0000000000c2",
		"00000000-0000-4000-8000-0000000000c3", "00000000-0000-4000-8000-0000000000c4", "00000000-0000-4000-8000-0000000000c5"}
	got, err := s.claimMany(ctx, []claimReq{{"c", runs[0]}, {"held", runs[1]}, {"busy", runs[2]}, {"empty", runs[3]}, {"gone", runs[4]}})
	require.NoError(t, err)
	require.Len(t, got, 5)
	require.True(t, got[0].locked)
	require.Len(t, got[0].ids, 2)
	require.Equal(t, []string{"c1", "c2"}, []string{got[0].messages[0].ID, got[0].messages[1].ID})
	require.False(t, got[1].locked, "held by another claimer")
	require.Empty(t, got[1].ids)
	require.True(t, got[2].locked)
	require.True(t, got[2].busy, "a run holds it")
	require.Empty(t, got[2].ids)
	require.True(t, got[3].locked)
	require.Empty(t, got[3].ids)
	require.False(t, got[4].locked, "no such conversation")
	require.Equal(t, runs[0], scalar[string](t, db, `SELECT run_id::text FROM agent_runs WHERE conversation_id = 'c'`))
	require.Equal(t, 1, scalar[int](t, db, `SELECT count(*) FROM agent_runs WHERE conversation_id <> 'busy'`), "one run: the claimed conversation's")
}

// The claim statement claims only conversations that the lock statement before it locked in
// the same transaction. Locking on its own, it could take a lock freed after its snapshot was
// taken, not see the claim that just committed, and claim the conversation a second time.
func TestClaimStatementTakesOnlyLockedConversations(t *testing.T) {
	ctx := context.Background()
	db, s := storeFixture(t)
	send(t, db, "c", "m1")
	tx, err := db.Pool.Begin(ctx)
	require.NoError(t, err)
	defer func() { _ = tx.Rollback(ctx) }()
	_, err = tx.Exec(ctx, `SELECT set_config('baton.claim_locked', '[]', true)`) // the lock statement got nothing
	require.NoError(t, err)
	var conv string
	var locked, busy bool
	var ids []int64
	var attempts int
	var raw []byte
	var oversize bool
	var wait *time.Time
	var traces []string
	require.NoError(t, tx.QueryRow(ctx, claimSQL, []string{"c"}, []string{"00000000-0000-4000-8000-000000000004"},
		s.lease.Milliseconds(), s.worker, s.maxRows, s.maxBytes).Scan(&conv, &locked, &busy, &ids, &attempts, &raw, &oversize, &wait, &traces))
	require.False(t, locked)
	require.Empty(t, ids)
	require.NoError(t, tx.Rollback(ctx))
	require.Equal(t, "pending", scalar[string](t, db, `SELECT status FROM agent_outbox`))
}

// Runs ending together share one statement; when one of them lost its lease or its
// conversation, the others still commit and each gets its own error.
func TestFinishManyIsolatesFailedRuns(t *testing.T) {
	ctx := context.Background()
	db, s := storeFixture(t)
	_, err := db.Pool.Exec(ctx, `INSERT INTO conversations (id) VALUES ('lost'), ('gone'), ('d')`)
	require.NoError(t, err)
	var reqs []finishReq
	for i, conv := range []string{"c", "lost", "gone", "d"} {
		send(t, db, conv, conv+"-m")
		run := fmt.Sprintf("00000000-0000-4000-8000-%012d", 100+i)
		c := claimOne(t, s, conv, run)
		require.Len(t, c.ids, 1)
		reqs = append(reqs, finishReq{conversationID: conv, runID: run, ids: c.ids, outcome: outcome{role: "assistant", content: "re " + conv}})
	}
	_, err = db.Pool.Exec(ctx, `UPDATE agent_outbox SET run_id = gen_random_uuid() WHERE conversation_id = 'lost'`)
	require.NoError(t, err)
	_, err = db.Pool.Exec(ctx, `DELETE FROM conversations WHERE id = 'gone'`)
	require.NoError(t, err)

	errs, err := s.finishMany(ctx, reqs)
	require.NoError(t, err)
	require.NoError(t, errs[0])
	require.ErrorIs(t, errs[1], errLeaseLost)
	require.ErrorIs(t, errs[2], errConversationGone)
	require.NoError(t, errs[3])
	require.Equal(t, []string{"c", "d"}, testsvc.Query[string](t, db, `SELECT conversation_id FROM agent_outbox WHERE status = 'done' ORDER BY 1`))
	require.Equal(t, []string{"re c", "re d"}, testsvc.Query[string](t, db, `SELECT content FROM messages WHERE role = 'assistant' ORDER BY 1`))

	// All good: one statement ends them all.
	var more []finishReq
	for i, conv := range []string{"e1", "e2", "e3"} {
		_, err := db.Pool.Exec(ctx, `INSERT INTO conversations (id) VALUES ($1)`, conv)
		require.NoError(t, err)
		send(t, db, conv, conv+"-m")
		run := fmt.Sprintf("00000000-0000-4000-8000-%012d", 200+i)
		c := claimOne(t, s, conv, run)
		more = append(more, finishReq{conversationID: conv, runID: run, ids: c.ids, outcome: outcome{role: "error", content: "failed " + conv, reason: "r"}})
	}
	errs, err = s.finishMany(ctx, more)
	require.NoError(t, err)
	require.Equal(t, []error{nil, nil, nil}, errs)
	require.Equal(t, 3, scalar[int](t, db, `SELECT count(*) FROM agent_outbox WHERE status = 'error' AND last_error = 'r'`))
	require.Equal(t, 3, scalar[int](t, db, `SELECT count(*) FROM agent_runs WHERE outcome = 'error'`))
}

// The final commit attaches the run's operations to its reply and writes, in the same update,
// the ends of tool calls no statement carried yet: a call ended earlier keeps its end, a call
// whose end comes with the commit gets it (finished_at is its start plus the time it took), a
// call still running is marked interrupted. Each operation row is updated once.
func TestFinishWritesTheToolEndsItCarriesWithTheAttachment(t *testing.T) {
	ctx := context.Background()
	db, s := storeFixture(t)
	send(t, db, "c", "m1")
	const run = "00000000-0000-4000-8000-0000000000e1"
	c := claimOne(t, s, "c", run)
	record := func(tool string, ends ...opEnd) int64 {
		id, err := s.recordOperation(ctx, recordReq{runID: run, conversationID: "c", ids: c.ids, tool: tool, effect: Read,
			input: []byte(`{}`), ends: ends})
		require.NoError(t, err)
		return id
	}
	earlier := record("earlier")
	carried := record("carried", opEnd{id: earlier, status: "done", output: []byte(`{"n":1}`), took: time.Millisecond})
	record("running")
	failed := record("failed")

	tx, err := db.Pool.Begin(ctx)
	require.NoError(t, err)
	defer func() { _ = tx.Rollback(ctx) }()
	// The counts of the connection's earlier transactions may not be flushed yet (PostgreSQL
	// 15 flushes them at most once a second): the count is taken before and after.
	updates := func() (n int64) {
		require.NoError(t, tx.QueryRow(ctx, `SELECT coalesce(sum(n_tup_upd), 0) FROM pg_stat_xact_user_tables WHERE relname = 'operations'`).Scan(&n))
		return n
	}
	before := updates()
	require.NoError(t, s.finishIn(ctx, tx, []finishReq{{conversationID: "c", runID: run, ids: c.ids,
		outcome: outcome{role: "assistant", content: "re"}, replyID: "baton:reply:e1",
		ends: []opEnd{
			{id: carried, status: "done", output: []byte(`{"n":2}`), took: 1500 * time.Millisecond},
			{id: failed, status: "error", errText: "timeout", took: 2 * time.Second},
		}}}))
	require.EqualValues(t, 4, updates()-before, "one update per operation: its end and its attachment together")
	require.NoError(t, tx.Commit(ctx))

	type op struct {
		Tool, Status, Message string
		Output, Error         *string
		Took                  *float64
	}
	rows, err := db.Pool.Query(ctx, `SELECT tool, status, message_id, output::text, error,
		extract(epoch FROM finished_at - started_at)::float8 FROM operations ORDER BY id`)
	require.NoError(t, err)
	ops, err := pgx.CollectRows(rows, pgx.RowToStructByPos[op])
	require.NoError(t, err)
	require.Len(t, ops, 4)
	str := func(s string) *string { return &s }
	require.Equal(t, "earlier done baton:reply:e1", ops[0].Tool+" "+ops[0].Status+" "+ops[0].Message)
	require.Equal(t, str(`{"n": 1}`), ops[0].Output, "an end written earlier stays")
	require.Equal(t, "carried done baton:reply:e1", ops[1].Tool+" "+ops[1].Status+" "+ops[1].Message)
	require.Equal(t, str(`{"n": 2}`), ops[1].Output)
	require.Equal(t, 1.5, *ops[1].Took, "finished_at is the start plus the time the call took")
	require.Equal(t, "running error baton:reply:e1", ops[2].Tool+" "+ops[2].Status+" "+ops[2].Message)
	require.Equal(t, str("interrupted: the turn ended before the tool call did"), ops[2].Error)
	require.NotNil(t, ops[2].Took)
	require.Equal(t, "failed error baton:reply:e1", ops[3].Tool+" "+ops[3].Status+" "+ops[3].Message)
	require.Equal(t, str("timeout"), ops[3].Error)
	require.Nil(t, ops[3].Output)
	require.Equal(t, 2.0, *ops[3].Took)
}

// finishTypes are the types of finishSQL's parameters.
const finishTypes = `text[], uuid[], text[], text[], text[], text[], text[], text[], bigint[], text, int[], text[], bigint[], text[], text[], text[], bigint[], uuid[], text[]`

// The final commit finds each carried end by key, whatever the planner believes: with
// statistics taken while the tables were nearly empty (a new database), its generic plan once
// joined every operation of the batch with every end (a nested loop over the ends, 10 million
// rows thrown away for 32 runs of 100 ended calls). The plan may throw away at most as many
// rows as the batch's runs times their operations, which attaching them by run already does.
func TestFinishFindsTheEndsItCarriesByKey(t *testing.T) {
	ctx := context.Background()
	db, s := storeFixture(t)
	_, err := db.Pool.Exec(ctx, `ANALYZE`)
	require.NoError(t, err)
	const runsN, opsPerRun = 4, 50
	var reqs []finishReq
	for i := range runsN {
		conv := fmt.Sprintf("k%d", i)
		_, err := db.Pool.Exec(ctx, `INSERT INTO conversations (id) VALUES ($1)`, conv)
		require.NoError(t, err)
		send(t, db, conv, conv+"-m")
		run := fmt.Sprintf("00000000-0000-4000-8000-%012d", 700+i)
		c := claimOne(t, s, conv, run)
		ops := testsvc.Query[int64](t, db, `INSERT INTO operations (run_id, conversation_id, tool, effect)
			SELECT $1, $2, 't' || g, 'read' FROM generate_series(1, $3::int) g RETURNING id`, run, conv, opsPerRun)
		r := finishReq{conversationID: conv, runID: run, ids: c.ids, outcome: outcome{role: "assistant", content: "re"},
			replyID: "baton:reply:" + conv}
		for _, id := range ops {
			r.ends = append(r.ends, opEnd{id: id, status: "done", output: []byte(`{"n":1}`), took: time.Millisecond})
		}
		reqs = append(reqs, r)
	}

	// The commit's own statement, its generic plan under EXPLAIN ANALYZE: finishIn with every
	// parameter written out, in a transaction that rolls back.
	// (finishIn's first statement, genericPlansSQL, asks for the generic plan.)
	tx, err := db.Pool.Begin(ctx)
	require.NoError(t, err)
	defer func() { _ = tx.Rollback(ctx) }()
	var explained []string
	err = s.finishIn(ctx, explainBatch{tx: tx, types: finishTypes, plan: &explained}, reqs)
	require.NoError(t, err)
	plan := strings.Join(explained, "\n")
	require.Contains(t, plan, "operations_pkey", plan)
	removed := regexp.MustCompile(`Rows Removed by (?:Join )?Filter: (\d+)`)
	for _, m := range removed.FindAllStringSubmatch(plan, -1) {
		n, _ := strconv.Atoi(m[1])
		require.LessOrEqual(t, n, runsN*runsN*opsPerRun, "the final commit compares operations with every end:\n%s", plan)
	}
	var attached int
	require.NoError(t, tx.QueryRow(ctx, `SELECT count(*) FROM operations
		WHERE status = 'done' AND output = '{"n": 1}' AND message_id LIKE 'baton:reply:k%'`).Scan(&attached))
	require.Equal(t, runsN*opsPerRun, attached)
}

// explainPrepared prepares sql with parameters of types on tx and returns the plan of its
// execution with args (literals) under EXPLAIN ANALYZE: the generic plan when tx's
// plan_cache_mode asks for it. The prepared statement is deallocated again.
func explainPrepared(ctx context.Context, tx pgx.Tx, types, sql, args string) ([]string, error) {
	if _, err := tx.Exec(ctx, `PREPARE explained(`+types+`) AS `+sql); err != nil {
		return nil, err
	}
	rows, err := tx.Query(ctx, `EXPLAIN (ANALYZE, SUMMARY OFF, TIMING OFF) EXECUTE explained(`+args+`)`)
	if err != nil {
		return nil, err
	}
	lines, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		return nil, err
	}
	_, err = tx.Exec(ctx, `DEALLOCATE explained`)
	return lines, err
}

// explainBatch runs a batch's last statement, prepared with its generic plan, under EXPLAIN
// ANALYZE on tx (its parameters written out as literals of types), and the statements before
// it as they are. The plan's lines go to plan.
type explainBatch struct {
	tx    pgx.Tx
	types string // of the last statement's parameters, comma-separated
	plan  *[]string
}

func (e explainBatch) SendBatch(ctx context.Context, b *pgx.Batch) pgx.BatchResults {
	last := b.QueuedQueries[len(b.QueuedQueries)-1]
	for _, q := range b.QueuedQueries[:len(b.QueuedQueries)-1] {
		if _, err := e.tx.Exec(ctx, q.SQL, q.Arguments...); err != nil {
			return failedBatch{err: err}
		}
	}
	types := strings.Split(e.types, ", ")
	lits := make([]string, len(last.Arguments))
	for i, a := range last.Arguments {
		if err := e.tx.QueryRow(ctx, `SELECT quote_nullable($1::`+types[i]+`::text)`, a).Scan(&lits[i]); err != nil {
			return failedBatch{err: err}
		}
		lits[i] += "::" + types[i]
	}
	plan, err := explainPrepared(ctx, e.tx, e.types, last.SQL, strings.Join(lits, ", "))
	*e.plan = plan
	return failedBatch{err: err}
}

// failedBatch is the BatchResults of explainBatch: its Close returns err, which is all
// finishIn asks of it.
type failedBatch struct {
	pgx.BatchResults
	err error
}

func (f failedBatch) Close() error { return f.err }

// A run that no longer holds its turn (recovered, reclaimed, or past its lease) cannot start a
// tool: the operation is not recorded and the tool does not run.
func TestToolRefusedAfterTheTurnIsLost(t *testing.T) {
	ctx := context.Background()
	for _, lost := range []string{"recovered", "lease expired"} {
		t.Run(lost, func(t *testing.T) {
			db, s := storeFixture(t)
			w, err := New(Config{Pool: db.RolePool(t, testsvc.RoleWorker), Handler: func(context.Context, *Turn) (Reply, error) { return Reply{}, nil }})
			require.NoError(t, err)
			w.store = s
			send(t, db, "c", "m1")
			const run = "00000000-0000-4000-8000-000000000005"
			c := claimOne(t, s, "c", run)
			turn := &Turn{ConversationID: "c", RunID: run, OutboxIDs: c.ids, w: w}

			// While the turn is held, tools run and are recorded.
			out, err := turn.Tool(ctx, "lookup", Read, "q", func(context.Context) (any, error) { return "a", nil })
			require.NoError(t, err)
			require.Equal(t, "a", out)

			if lost == "recovered" {
				_, err = db.Pool.Exec(ctx, `UPDATE agent_outbox SET status = 'pending', run_id = NULL, lease_expires_at = NULL`)
			} else {
				_, err = db.Pool.Exec(ctx, `UPDATE agent_outbox SET lease_expires_at = now() - interval '1 second'`)
			}
			require.NoError(t, err)
			ran := false
			_, err = turn.Tool(ctx, "send_email", Write, "q", func(context.Context) (any, error) { ran = true; return nil, nil })
			require.ErrorIs(t, err, errLeaseLost)
			require.False(t, ran, "the tool must not run")
			require.Equal(t, []string{"lookup"}, testsvc.Query[string](t, db, `SELECT tool FROM operations ORDER BY id`))
		})
	}
}

// Tool calls of several runs share one record statement, each with its run's fence: a run
// that lost its turn gets errLeaseLost and nothing recorded, two calls of one run get their
// own operations in their order, the ends the calls carry are written with them, and a call
// Postgres refuses fails alone.
func TestRecordManyOperations(t *testing.T) {
	ctx := context.Background()
	db, s := storeFixture(t)
	_, err := db.Pool.Exec(ctx, `INSERT INTO conversations (id) VALUES ('a'), ('b'), ('lost')`)
	require.NoError(t, err)
	runs := map[string]string{"a": "00000000-0000-4000-8000-0000000000a1", "b": "00000000-0000-4000-8000-0000000000b1",
		"lost": "00000000-0000-4000-8000-0000000000d1"}
	claims := map[string]claim{}
	for conv, run := range runs {
		send(t, db, conv, conv+"1", conv+"2")
		claims[conv] = claimOne(t, s, conv, run)
		require.Len(t, claims[conv].ids, 2)
	}
	_, err = db.Pool.Exec(ctx, `UPDATE agent_outbox SET lease_expires_at = now() - interval '1 second' WHERE conversation_id = 'lost'`)
	require.NoError(t, err)
	call := func(conv, tool string, ends ...opEnd) recordReq {
		return recordReq{runID: runs[conv], conversationID: conv, ids: claims[conv].ids, tool: tool, effect: Write,
			input: []byte(`{"q":"` + tool + `"}`), ends: ends}
	}
	first, err := s.recordOperation(ctx, call("b", "first"))
	require.NoError(t, err)

	got, err := s.recordMany(ctx, []recordReq{
		call("a", "a-one"),
		call("b", "b-two", opEnd{id: first, status: "done", output: []byte(`{"sent":true}`), took: time.Millisecond}),
		call("lost", "never"),
		call("a", "a-two"),
	})
	require.NoError(t, err)
	require.Len(t, got, 4)
	for _, i := range []int{0, 1, 3} {
		require.NoError(t, got[i].err)
	}
	require.ErrorIs(t, got[2].err, errLeaseLost)
	require.Less(t, got[0].id, got[3].id)
	for i, tool := range map[int]string{0: "a-one", 1: "b-two", 3: "a-two"} {
		require.Equal(t, tool, scalar[string](t, db, `SELECT tool FROM operations WHERE id = $1`, got[i].id))
	}
	require.Empty(t, testsvc.Query[string](t, db, `SELECT tool FROM operations WHERE conversation_id = 'lost'`),
		"a run that lost its turn records nothing")
	require.Equal(t, `done {"sent": true}`, scalar[string](t, db, `SELECT status || ' ' || output::text FROM operations WHERE id = $1`, first))
	require.True(t, scalar[bool](t, db, `SELECT finished_at >= started_at FROM operations WHERE id = $1`, first))

	// jsonb refuses NUL: that call fails alone, the others are recorded one by one.
	bad := call("a", "bad")
	bad.input = []byte(`{"q":"\u0000"}`)
	got, err = s.recordMany(ctx, []recordReq{call("b", "b-three"), bad, call("a", "a-three")})
	require.NoError(t, err)
	require.NoError(t, got[0].err)
	require.Error(t, got[1].err)
	require.NotErrorIs(t, got[1].err, errLeaseLost)
	require.NoError(t, got[2].err)
	require.Equal(t, []string{"a-one", "a-two", "a-three"},
		testsvc.Query[string](t, db, `SELECT tool FROM operations WHERE conversation_id = 'a' ORDER BY id`))
}

// Turns read their histories in one statement, each its own turn's; a read Postgres refuses
// fails alone. Turns claimed without a claim order (before migration 13) and messages that were
// never turns (an adopted history) come first, by created_at; then the claim-ordered turns,
// each message followed by its reply. Pending messages and the turn's own are never history.
func TestHistoryMany(t *testing.T) {
	ctx := context.Background()
	db, s := storeFixture(t)
	_, err := db.Pool.Exec(ctx, `INSERT INTO conversations (id) VALUES ('a'), ('b')`)
	require.NoError(t, err)
	// turn claims conv's pending rows and answers them ("re: " and the first message's id);
	// legacy turns lose their claim order, as runs of an earlier version have none.
	runs := 0
	turn := func(conv string, legacy bool) string {
		t.Helper()
		runs++
		run := fmt.Sprintf("00000000-0000-4000-8000-%012d", runs)
		c := claimOne(t, s, conv, run)
		require.NotEmpty(t, c.ids)
		if legacy {
			_, err := db.Pool.Exec(ctx, `UPDATE agent_runs SET claim_order = NULL WHERE run_id = $1`, run)
			require.NoError(t, err)
		}
		require.NoError(t, s.finishOne(ctx, finishReq{conversationID: conv, runID: run, ids: c.ids,
			outcome: outcome{role: "assistant", content: "re: " + c.messages[0].ID}}))
		return run
	}
	// An adopted greeting: no outbox row names it.
	_, err = db.Pool.Exec(ctx, `INSERT INTO messages (id, conversation_id, role, content, created_at)
		VALUES ('a0', 'a', 'assistant', 'hello', now() - interval '1 hour')`)
	require.NoError(t, err)
	send(t, db, "a", "a1", "a2")
	turn("a", true)
	send(t, db, "a", "a3")
	turn("a", false)
	send(t, db, "a", "a4", "a5")
	runA := "00000000-0000-4000-8000-000000000100"
	claimOne(t, s, "a", runA)
	send(t, db, "a", "a6") // pending at the claim

	send(t, db, "b", "b1")
	turn("b", false)
	send(t, db, "b", "b2")
	turn("b", false)
	send(t, db, "b", "b3")
	runB := "00000000-0000-4000-8000-000000000200"
	claimOne(t, s, "b", runB)
	// The claims record no claim order (nor did workers of earlier versions): the trigger
	// numbers them, as the worker role.
	require.Equal(t, []string{"1", "2", "3"}, testsvc.Query[string](t, db,
		`SELECT claim_order::text FROM agent_runs WHERE conversation_id = 'b' ORDER BY started_at`))

	contents := func(msgs []Message) []string {
		out := []string{}
		for _, m := range msgs {
			out = append(out, m.Role+":"+m.Content)
		}
		return out
	}
	a := []string{"assistant:hello", "user:hi a1", "user:hi a2", "assistant:re: a1", "user:hi a3", "assistant:re: a3"}
	b := []string{"user:hi b1", "assistant:re: b1", "user:hi b2", "assistant:re: b2"}
	// A run that is not found (its conversation deleted, perhaps created again) sees nothing.
	reqs := []historyReq{{"a", runA, 100}, {"b", runB, 100}, {"a", runA, 3}, {"a", runA, 1}, {"a", runA, 0},
		{"b", "00000000-0000-4000-8000-000000000999", 100}}
	got, err := s.historyMany(ctx, reqs)
	require.NoError(t, err)
	want := [][]string{a, b, a[3:], a[5:], {}, {}}
	for i := range reqs {
		require.NoError(t, got[i].err)
		require.Equal(t, want[i], contents(got[i].msgs), "request %d", i)
	}
	one, err := s.history(ctx, historyReq{"a", runA, 100})
	require.NoError(t, err)
	require.Equal(t, a, contents(one))

	got, err = s.historyMany(ctx, []historyReq{{"a", runA, 100}, {"b", runB, -1}})
	require.NoError(t, err)
	require.NoError(t, got[0].err)
	require.Equal(t, a, contents(got[0].msgs))
	require.Error(t, got[1].err)
}

// A history read costs its turn's messages, not the conversation's: it walks back from the
// turn's claim over indexes, whatever the conversation's length, and reads no other
// conversation. The part from before claim order was recorded is read only when the
// claim-ordered turns do not fill the history.
func TestHistoryReadsItsMessages(t *testing.T) { requireHistoryNarrow(t, 3000) }

// requireHistoryNarrow checks TestHistoryReadsItsMessages's plans with conversations of turns
// answered turns each (make test-long runs it with 200,000).
func requireHistoryNarrow(t *testing.T, turns int) {
	ctx := context.Background()
	db, s := storeFixture(t)
	// Conversation c: turns claim-ordered turns of one message each, answered; conversation l
	// the same without claim order (from before migration 13); others besides.
	_, err := db.Pool.Exec(ctx, `
		INSERT INTO conversations (id) VALUES ('l');
		INSERT INTO conversations (id) SELECT 'o' || g FROM generate_series(1, 1000) g;
		INSERT INTO messages (id, conversation_id, role, content, created_at)
		SELECT conv || ':' || kind || g, conv, CASE kind WHEN 'm' THEN 'user' ELSE 'assistant' END, 'x',
		       now() - interval '1 hour' + g * interval '1 ms' + CASE kind WHEN 'm' THEN interval '0' ELSE interval '100 us' END
		FROM generate_series(1, $1) g, unnest(ARRAY['c', 'l']) conv, unnest(ARRAY['m', 'r']) kind;
		INSERT INTO messages (id, conversation_id, role, content)
		SELECT 'o' || g, 'o' || g, 'user', 'x' FROM generate_series(1, 1000) g;
		INSERT INTO agent_runs (run_id, conversation_id, outbox_ids, worker, claim_order)
		SELECT md5(conv || g)::uuid, conv, '{}', 'w', CASE conv WHEN 'c' THEN g END
		FROM generate_series(1, $1) g, unnest(ARRAY['c', 'l']) conv;
		INSERT INTO agent_outbox (conversation_id, message_id, status, run_id, reply_id)
		SELECT conv, conv || ':m' || g, 'done', md5(conv || g)::uuid, conv || ':r' || g
		FROM generate_series(1, $1) g, unnest(ARRAY['c', 'l']) conv;
		UPDATE agent_runs r SET outbox_ids = ARRAY[o.id] FROM agent_outbox o WHERE o.run_id = r.run_id;
		UPDATE agent_runs SET claim_order = NULL WHERE conversation_id = 'l'; -- the trigger numbered them
		INSERT INTO agent_outbox (conversation_id, message_id, status) SELECT 'o' || g, 'o' || g, 'done' FROM generate_series(1, 1000) g;
		ANALYZE`, pgx.QueryExecModeSimpleProtocol, turns)
	require.NoError(t, err)
	send(t, db, "c", "now")
	send(t, db, "l", "now-l")
	runC, runL := "00000000-0000-4000-8000-00000000000c", "00000000-0000-4000-8000-00000000000d"
	claimOne(t, s, "c", runC)
	claimOne(t, s, "l", runL)
	// Conversation n: two answered turns, then a backlog of 2,000 messages; the turn claims the
	// first 100. Its history (4 messages) costs them, not the backlog.
	_, err = db.Pool.Exec(ctx, `INSERT INTO conversations (id) VALUES ('n')`)
	require.NoError(t, err)
	for i, id := range []string{"n1", "n2"} {
		send(t, db, "n", id)
		run := fmt.Sprintf("00000000-0000-4000-8000-%012d", 0xe0+i)
		c := claimOne(t, s, "n", run)
		require.NoError(t, s.finishOne(ctx, finishReq{conversationID: "n", runID: run, ids: c.ids,
			outcome: outcome{role: "assistant", content: "re: " + id}}))
	}
	_, err = db.Pool.Exec(ctx, `
		WITH m AS (INSERT INTO messages (id, conversation_id, role, content)
		           SELECT 'n:p' || g, 'n', 'user', 'x' FROM generate_series(1, 2000) g RETURNING id)
		INSERT INTO agent_outbox (conversation_id, message_id) SELECT 'n', id FROM m ORDER BY id`)
	require.NoError(t, err)
	runN := "00000000-0000-4000-8000-00000000000e"
	require.Len(t, claimOne(t, s, "n", runN).ids, 100)

	readRows := regexp.MustCompile(`(?:actual rows=|Rows Removed by Filter: )(\d+)`)
	for _, tc := range []struct{ conv, run, last string }{
		{"c", runC, fmt.Sprintf("c:r%d", turns)}, {"l", runL, fmt.Sprintf("l:r%d", turns)}, {"n", runN, ""},
	} {
		for _, generic := range []string{"auto", "force_generic_plan"} {
			tx, err := db.Pool.Begin(ctx)
			require.NoError(t, err)
			_, err = tx.Exec(ctx, `SELECT set_config('plan_cache_mode', $1, true)`, generic)
			require.NoError(t, err)
			lines, err := explainPrepared(ctx, tx, `text[], uuid[], int[], int[]`, historiesSQL,
				fmt.Sprintf(`'{%s}', '{%s}', '{10}', '{0}'`, tc.conv, tc.run))
			require.NoError(t, tx.Rollback(ctx))
			require.NoError(t, err)
			plan := strings.Join(lines, "\n")
			require.NotContains(t, plan, "Seq Scan", plan)
			if os.Getenv("BATON_TEST_PLANS") != "" {
				t.Logf("%s %s:\n%s", tc.conv, generic, plan)
			}
			for _, m := range readRows.FindAllStringSubmatch(plan, -1) {
				n, _ := strconv.Atoi(m[1])
				require.LessOrEqual(t, n, 40, "history of %s (%s) reads more than its messages:\n%s", tc.conv, generic, plan)
			}
		}
		h, err := s.history(ctx, historyReq{tc.conv, tc.run, 10})
		require.NoError(t, err)
		if tc.conv == "n" {
			require.Len(t, h, 4)
			continue
		}
		require.Len(t, h, 10)
		require.Equal(t, tc.last, h[9].ID)
	}
}
