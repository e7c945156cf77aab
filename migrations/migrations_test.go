package migrations_test

import (
	"context"
	"os"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/batonhq/baton/internal/testsvc"
	"github.com/batonhq/baton/migrations"
)

func TestMain(m *testing.M) { os.Exit(testsvc.Main(m)) }

// emptyDatabase returns a pool on a database with nothing in it: a fresh target for Up.
func emptyDatabase(t *testing.T) *pgxpool.Pool {
	t.Helper()
	ctx := context.Background()
	host := testsvc.NewDatabase(t)
	name := host.Name + "_empty"
	_, err := host.Pool.Exec(ctx, "CREATE DATABASE "+pgx.Identifier{name}.Sanitize()+" TEMPLATE template0")
	require.NoError(t, err)
	url := strings.Replace(host.URL, "/"+host.Name, "/"+name, 1)
	pool, err := pgxpool.New(ctx, url)
	require.NoError(t, err)
	t.Cleanup(func() {
		pool.Close()
		_, err := host.Pool.Exec(context.Background(), "DROP DATABASE "+pgx.Identifier{name}.Sanitize()+" WITH (FORCE)")
		require.NoError(t, err)
	})
	return pool
}

func TestAllIsOrderedAndComplete(t *testing.T) {
	all, err := migrations.All()
	require.NoError(t, err)
	require.NotEmpty(t, all)
	for i, m := range all {
		require.Equal(t, i+1, m.Version, "versions must be 1..N without gaps")
		require.NotEmpty(t, m.Name)
	}
	require.Equal(t, len(all), migrations.Latest())
}

func TestUpFreshThenNoop(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	pool := emptyDatabase(t)

	require.ErrorIs(t, migrations.Check(ctx, pool), migrations.ErrSchemaBehind)
	applied, err := migrations.Up(ctx, pool)
	require.NoError(t, err)
	require.Len(t, applied, migrations.Latest())
	require.NoError(t, migrations.Check(ctx, pool))

	again, err := migrations.Up(ctx, pool)
	require.NoError(t, err)
	require.Empty(t, again, "a second Up must apply nothing")
	versions, err := migrations.Applied(ctx, pool)
	require.NoError(t, err)
	require.Len(t, versions, migrations.Latest())

	assertSchema(ctx, t, pool)
}

func TestConcurrentUpAppliesOnce(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	pool := emptyDatabase(t)

	const n = 4
	results := make([][]int, n)
	errs := make([]error, n)
	var wg sync.WaitGroup
	start := make(chan struct{})
	for i := range n {
		wg.Go(func() {
			// Each migrator has its own connection, as separate processes would.
			conn, err := pgx.Connect(ctx, pool.Config().ConnString())
			if err != nil {
				errs[i] = err
				return
			}
			defer func() { _ = conn.Close(ctx) }()
			<-start
			results[i], errs[i] = migrations.Up(ctx, conn)
		})
	}
	close(start)
	wg.Wait()
	total := 0
	for i := range n {
		require.NoError(t, errs[i])
		total += len(results[i])
	}
	require.Equal(t, migrations.Latest(), total, "each version applied by exactly one migrator")
	var rows int
	require.NoError(t, pool.QueryRow(ctx, "SELECT count(*) FROM "+migrations.Table).Scan(&rows))
	require.Equal(t, migrations.Latest(), rows)
	assertSchema(ctx, t, pool)
}

func TestFailedVersionLeavesNothing(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	pool := emptyDatabase(t)
	// A table in the way makes version 1 fail halfway through.
	_, err := pool.Exec(ctx, "CREATE TABLE operations (x int)")
	require.NoError(t, err)
	_, err = migrations.Up(ctx, pool)
	require.ErrorContains(t, err, "migration 1")
	var conversations bool
	require.NoError(t, pool.QueryRow(ctx, "SELECT to_regclass('conversations') IS NOT NULL").Scan(&conversations))
	require.False(t, conversations, "the failed version must roll back whole")
	versions, err := migrations.Applied(ctx, pool)
	require.NoError(t, err)
	require.Empty(t, versions)
}

func assertSchema(ctx context.Context, t *testing.T, pool *pgxpool.Pool) {
	t.Helper()
	columns := map[string][]string{
		"conversations": {"id"},
		"messages":      {"id", "conversation_id", "role", "content", "created_at"},
		"agent_outbox": {"id", "conversation_id", "message_id", "status", "attempts", "created_at",
			"processed_at", "run_id", "lease_expires_at", "reply_id", "last_error"},
		"operations": {"id", "run_id", "conversation_id", "message_id", "tool", "effect", "status",
			"input", "output", "error", "started_at", "finished_at"},
	}
	for table, cols := range columns {
		rows, err := pool.Query(ctx, `SELECT column_name::text FROM information_schema.columns
			WHERE table_schema = 'public' AND table_name = $1`, table)
		require.NoError(t, err)
		have, err := pgx.CollectRows(rows, pgx.RowTo[string])
		require.NoError(t, err)
		require.Subset(t, have, cols, "columns of %s", table)
	}

	var indexDef string
	require.NoError(t, pool.QueryRow(ctx, `SELECT indexdef FROM pg_indexes WHERE indexname = 'agent_outbox_pending'`).Scan(&indexDef))
	require.Contains(t, indexDef, "(conversation_id, created_at)")
	require.Contains(t, indexDef, "WHERE (status = 'pending'::text)")

	var unique bool
	require.NoError(t, pool.QueryRow(ctx, `SELECT EXISTS (SELECT 1 FROM pg_indexes
		WHERE tablename = 'agent_outbox' AND indexdef LIKE 'CREATE UNIQUE INDEX % (message_id)')`).Scan(&unique))
	require.True(t, unique, "agent_outbox.message_id must be unique")

	// Foreign keys cascade from conversations.
	rows, err := pool.Query(ctx, `SELECT conrelid::regclass::text FROM pg_constraint
		WHERE contype = 'f' AND confrelid = 'conversations'::regclass AND confdeltype = 'c' ORDER BY 1`)
	require.NoError(t, err)
	cascading, err := pgx.CollectRows(rows, pgx.RowTo[string])
	require.NoError(t, err)
	require.Equal(t, []string{"agent_outbox", "agent_runs", "messages", "operations"}, cascading)

	// The publication: inserts only; the outbox whole, messages filtered to replies.
	var ins, upd, del bool
	require.NoError(t, pool.QueryRow(ctx, `SELECT pubinsert, pubupdate, pubdelete FROM pg_publication WHERE pubname = 'baton'`).Scan(&ins, &upd, &del))
	require.Equal(t, []bool{true, false, false}, []bool{ins, upd, del})
	rows, err = pool.Query(ctx, `SELECT tablename::text, coalesce(rowfilter, '') FROM pg_publication_tables WHERE pubname = 'baton' ORDER BY 1`)
	require.NoError(t, err)
	type pubTable struct {
		Table, Filter string
	}
	tables, err := pgx.CollectRows(rows, pgx.RowToStructByPos[pubTable])
	require.NoError(t, err)
	require.Equal(t, []pubTable{{"agent_outbox", ""}, {"messages", "(role <> 'user'::text)"}}, tables)
}
