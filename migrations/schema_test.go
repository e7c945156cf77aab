package migrations_test

import (
	"bytes"
	"context"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/batonhq/baton/migrations"
)

// UpWith puts every Baton object into the schema it is given and names the publication as it
// is told, beside an application's own tables of the same names, which it leaves alone.
func TestUpWithSchemaAndPublication(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	pool := emptyDatabase(t)
	_, err := pool.Exec(ctx, `CREATE TABLE public.messages (body text)`) // the application's own
	require.NoError(t, err)
	o := migrations.Options{Schema: "baton_custom", Publication: "baton_custom_pub"}

	require.ErrorIs(t, migrations.CheckIn(ctx, pool, o.Schema), migrations.ErrSchemaBehind)
	applied, err := migrations.UpWith(ctx, pool, o)
	require.NoError(t, err)
	require.Len(t, applied, migrations.Latest())
	require.NoError(t, migrations.CheckIn(ctx, pool, o.Schema))
	require.ErrorIs(t, migrations.Check(ctx, pool), migrations.ErrSchemaBehind, "nothing went to public")

	var tables []string
	rows, err := pool.Query(ctx, `SELECT tablename FROM pg_tables WHERE schemaname = 'baton_custom' ORDER BY 1`)
	require.NoError(t, err)
	tables, err = pgx.CollectRows(rows, pgx.RowTo[string])
	require.NoError(t, err)
	require.Equal(t, []string{"agent_outbox", "agent_runs", "baton_relay_slots", "baton_schema_migrations",
		"conversations", "messages", "operations"}, tables)
	var publicTables []string
	rows, err = pool.Query(ctx, `SELECT tablename FROM pg_tables WHERE schemaname = 'public' ORDER BY 1`)
	require.NoError(t, err)
	publicTables, err = pgx.CollectRows(rows, pgx.RowTo[string])
	require.NoError(t, err)
	require.Equal(t, []string{"messages"}, publicTables)

	rows, err = pool.Query(ctx, `SELECT schemaname || '.' || tablename FROM pg_publication_tables WHERE pubname = $1 ORDER BY 1`, o.Publication)
	require.NoError(t, err)
	published, err := pgx.CollectRows(rows, pgx.RowTo[string])
	require.NoError(t, err)
	require.Equal(t, []string{"baton_custom.agent_outbox", "baton_custom.messages"}, published)
	var n int
	require.NoError(t, pool.QueryRow(ctx, `SELECT count(*) FROM pg_publication WHERE pubname = 'baton'`).Scan(&n))
	require.Zero(t, n)

	again, err := migrations.UpWith(ctx, pool, o)
	require.NoError(t, err)
	require.Empty(t, again)
}

// The script `baton migrate --print` writes applies the same schema as UpWith, and records
// its versions so that UpWith then finds nothing to do.
func TestPrintAppliesLikeUp(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	pool := emptyDatabase(t)
	o := migrations.Options{Schema: "baton_printed", Publication: "printed"}
	var script bytes.Buffer
	require.NoError(t, migrations.Print(&script, o))
	require.NotContains(t, script.String(), `:"publication"`)
	conn, err := pool.Acquire(ctx)
	require.NoError(t, err)
	defer conn.Release()
	_, err = conn.Conn().PgConn().Exec(ctx, script.String()).ReadAll()
	require.NoError(t, err)

	versions, err := migrations.AppliedIn(ctx, pool, o.Schema)
	require.NoError(t, err)
	require.Len(t, versions, migrations.Latest())
	applied, err := migrations.UpWith(ctx, pool, o)
	require.NoError(t, err)
	require.Empty(t, applied)
	var n int
	require.NoError(t, pool.QueryRow(ctx, `SELECT count(*) FROM pg_publication_tables WHERE pubname = 'printed' AND schemaname = 'baton_printed'`).Scan(&n))
	require.Equal(t, 2, n)
}
