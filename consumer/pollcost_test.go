package consumer

// What one polling pass costs Postgres, counted in buffers (shared blocks hit or read, temp
// blocks read or written) under EXPLAIN (ANALYZE, BUFFERS): deterministic for given data and
// plan, unlike wall time on a shared machine.

import (
	"context"
	"encoding/json"
	"fmt"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/batonhq/baton/internal/testsvc"
)

// pollLimit is the page a polling pass asks for with the default MaxConcurrentTurns.
const pollLimit = 4 * DefaultMaxConcurrentTurns

// backlogLayout says which conversation each pending row of a test backlog belongs to.
type backlogLayout int

const (
	// interleaved: row g belongs to conversation g mod convs, as when many users write at once.
	interleaved backlogLayout = iota
	// contiguous: each conversation's rows come one after the other, as after a bulk import.
	contiguous
)

// loadBacklog fills a new database with convs conversations and rows pending outbox rows (and
// their messages) laid out as layout, the oldest first; busy of the conversations also hold a
// processing row (a run is on them). Autovacuum is off for the outbox, and the tables are
// analyzed, so that what a poll reads depends on the data alone: no page is all-visible.
func loadBacklog(t testing.TB, convs, rows, busy int, layout backlogLayout) *testsvc.Database {
	t.Helper()
	ctx := context.Background()
	db := testsvc.NewDatabase(t)
	conv := `'conv-' || (g % $1)`
	if layout == contiguous {
		conv = `'conv-' || (g::bigint * $1 / $2)`
	}
	for _, q := range []struct {
		sql  string
		args []any
	}{
		{`ALTER TABLE agent_outbox SET (autovacuum_enabled = false)`, nil},
		{`ALTER TABLE messages SET (autovacuum_enabled = false)`, nil},
		{`INSERT INTO conversations (id) SELECT 'conv-' || g FROM generate_series(0, $1 - 1) g`, []any{convs}},
		{`INSERT INTO messages (id, conversation_id, role, content, created_at)
		 SELECT 'm-' || g, ` + conv + `, 'user', 'hello', now() - interval '1 hour' + g * interval '1 microsecond'
		 FROM generate_series(0, $2 - 1) g`, []any{convs, rows}},
		{`INSERT INTO agent_outbox (conversation_id, message_id, created_at)
		 SELECT ` + conv + `, 'm-' || g, now() - interval '1 hour' + g * interval '1 microsecond'
		 FROM generate_series(0, $2 - 1) g ORDER BY g`, []any{convs, rows}},
	} {
		_, err := db.Pool.Exec(ctx, q.sql, q.args...)
		require.NoError(t, err, q.sql)
	}
	if busy > 0 {
		_, err := db.Pool.Exec(ctx, `
			WITH c AS (SELECT 'conv-' || g AS id FROM generate_series(0, $1 - 1) g),
			     m AS (INSERT INTO messages (id, conversation_id, role, content, created_at)
			           SELECT 'busy-' || id, id, 'user', 'hello', now() - interval '2 hours' FROM c RETURNING id, conversation_id)
			INSERT INTO agent_outbox (conversation_id, message_id, status, attempts, run_id, lease_expires_at, created_at)
			SELECT conversation_id, id, 'processing', 1, gen_random_uuid(), now() + interval '1 hour', now() - interval '2 hours' FROM m`, busy)
		require.NoError(t, err)
	}
	_, err := db.Pool.Exec(ctx, `ANALYZE conversations, messages, agent_outbox`)
	require.NoError(t, err)
	return db
}

// pollStatement is one statement of a polling pass, with its parameters' types and values.
type pollStatement struct {
	name, types, sql, args string
}

// pollStatements are the statements a polling pass (Worker.sweep with minAge 0) runs.
func pollStatements() []pollStatement {
	return []pollStatement{
		{"pendingConversations", "bigint, int", pendingConversationsSQL, fmt.Sprintf("0, %d", pollLimit)},
		{"oldestPending", "", oldestPendingSQL, ""},
	}
}

// explainBuffers runs sql prepared, with a custom plan or its generic plan, under EXPLAIN
// (ANALYZE, BUFFERS) and returns the buffers its execution touched (planning left out):
// shared blocks hit or read, temp blocks read or written.
func explainBuffers(t testing.TB, db *testsvc.Database, st pollStatement, generic bool) int {
	t.Helper()
	ctx := context.Background()
	tx, err := db.Pool.Begin(ctx)
	require.NoError(t, err)
	defer func() { _ = tx.Rollback(ctx) }()
	mode := "force_custom_plan"
	if generic {
		mode = "force_generic_plan"
	}
	_, err = tx.Exec(ctx, `SET LOCAL plan_cache_mode = `+mode)
	require.NoError(t, err)
	prepare, execute := `PREPARE poll AS `+st.sql, `EXECUTE poll`
	if st.types != "" {
		prepare, execute = `PREPARE poll(`+st.types+`) AS `+st.sql, `EXECUTE poll(`+st.args+`)`
	}
	_, err = tx.Exec(ctx, prepare)
	require.NoError(t, err)
	defer func() { _, _ = tx.Exec(ctx, `DEALLOCATE poll`) }()
	var raw []byte
	require.NoError(t, tx.QueryRow(ctx, `EXPLAIN (ANALYZE, BUFFERS, TIMING OFF, SUMMARY OFF, FORMAT JSON) `+execute).Scan(&raw))
	var out []struct {
		Plan map[string]any `json:"Plan"`
	}
	require.NoError(t, json.Unmarshal(raw, &out))
	require.Len(t, out, 1)
	n := 0
	for _, k := range []string{"Shared Hit Blocks", "Shared Read Blocks", "Temp Read Blocks", "Temp Written Blocks"} {
		v, ok := out[0].Plan[k].(float64)
		require.True(t, ok, "%s: no %q in the plan", st.name, k)
		n += int(v)
	}
	return n
}

// pollCost returns the buffers one polling pass touches on db: the sum over its statements, each
// with the more costly of a custom and its generic plan (a prepared statement may run either).
func pollCost(t testing.TB, db *testsvc.Database) int {
	t.Helper()
	total := 0
	for _, st := range pollStatements() {
		custom, generic := explainBuffers(t, db, st, false), explainBuffers(t, db, st, true)
		t.Logf("  %s: %d buffers (custom plan), %d (generic plan)", st.name, custom, generic)
		total += max(custom, generic)
	}
	return total
}

// pollPage returns what a polling pass finds on db, with the store's statement.
func pollPage(t testing.TB, db *testsvc.Database) []pendingConversation {
	t.Helper()
	page, err := testStore(db.RolePool(t, testsvc.RoleWorker)).pendingConversations(context.Background(), 0, pollLimit)
	require.NoError(t, err)
	return page
}

// requirePollCostFlat loads two backlogs of small and large pending rows over convs
// conversations (busy of them busy) and requires a pass over the large one to touch at most
// twice the buffers of a pass over the small one, both finding the same page size.
func requirePollCostFlat(t *testing.T, convs, small, large, busy int, layout backlogLayout) {
	t.Helper()
	var costs, pages [2]int
	for i, rows := range []int{small, large} {
		start := time.Now()
		db := loadBacklog(t, convs, rows, busy, layout)
		t.Logf("%d pending rows over %d conversations (%d busy) loaded in %v", rows, convs, busy, time.Since(start).Round(time.Millisecond))
		costs[i] = pollCost(t, db)
		pages[i] = len(pollPage(t, db))
		t.Logf("%d pending rows: a pass touches %d buffers, finds %d conversations", rows, costs[i], pages[i])
	}
	require.Equal(t, pages[0], pages[1], "both backlogs fill the same page")
	require.LessOrEqual(t, costs[1], 2*costs[0],
		"a poll over %d pending rows touches %d buffers, over %d rows %d: the poll costs the backlog", large, costs[1], small, costs[0])
}

// Was: pendingConversationsSQL grouped every pending row before its LIMIT, and oldestPendingSQL
// read every pending row's entry, so a polling pass cost the whole backlog (≈150 ms at 100,000
// rows), and the polling source polls again 10 ms later while pages are full: a database core per
// polling worker during a backlog. At 10,000 conversations, a pass over 100,000 pending rows
// touches at most twice the buffers of a pass over 1,000 (TestLongPollCost: 1,000,000).
func TestPollCostDoesNotGrowWithTheBacklog(t *testing.T) {
	requirePollCostFlat(t, 10_000, 1_000, 100_000, 0, interleaved)
}

// The same when every conversation with pending rows is busy, so that no page can be full:
// 10 conversations with 10,000 or 100,000 pending rows between them, each held by a run. A pass
// costs what the conversations cost, not their rows.
func TestPollCostOverABusyBacklog(t *testing.T) {
	requirePollCostFlat(t, 10, 10_000, 100_000, 10, interleaved)
}
