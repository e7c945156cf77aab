package migrations_test

import (
	"bytes"
	"context"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/batonhq/baton/internal/testsvc"
	"github.com/batonhq/baton/migrations"
)

// hostileIDs are conversation ids a shard predicate must place like any other: one byte,
// spaces, quotes, SQL, unicode, and the longest id the schema allows.
func hostileIDs() []string {
	return []string{"a", " ", "'", `"`, "\\", "~", "%", "_", "0", "-1", "c0000", "'; DROP TABLE agent_outbox; --",
		"ünïcödé", "会話", "🙂🙃", "\u200b", "\t\n", strings.Repeat("x", 200), strings.Repeat("é", 100),
		strings.Repeat("🙂", 50), "NULL", "9223372036854775807", "-9223372036854775808"}
}

// A shard predicate puts every conversation id, hostile ones included, in exactly one shard,
// by the SQL the publications use, evaluated by Postgres (which also shows it never raises).
func TestShardPredicateExactlyOne(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	db := testsvc.NewDatabase(t)
	ids := hostileIDs()
	for i := range 500 { // and enough ordinary ones to reach every shard of 4
		ids = append(ids, "conv-"+strings.Repeat("z", i%7)+string(rune('a'+i%26))+strings.Repeat("9", i%5)+"-"+string(rune(0x4e00+i)))
	}
	for _, n := range []int{1, 2, 3, 4, 7, migrations.MaxShards} {
		matched := map[string][]int{}
		used := map[int]bool{}
		for k := range n {
			rows, err := db.Pool.Query(ctx, `SELECT conversation_id FROM unnest($1::text[]) AS conversation_id WHERE `+
				migrations.ShardPredicate(n, k), ids)
			require.NoError(t, err)
			got, err := pgx.CollectRows(rows, pgx.RowTo[string])
			require.NoError(t, err)
			for _, id := range got {
				matched[id] = append(matched[id], k)
				used[k] = true
			}
		}
		for _, id := range ids {
			require.Len(t, matched[id], 1, "id %q with %d shards: shards %v", id, n, matched[id])
		}
		if n <= 4 {
			require.Len(t, used, n, "with %d shards every shard gets conversations", n)
		}
	}
}

func TestParseShard(t *testing.T) {
	t.Parallel()
	for _, tt := range []struct {
		in   string
		k, n int
		bad  string
	}{
		{in: "0/2", k: 0, n: 2},
		{in: "3/4", k: 3, n: 4},
		{in: " 0/1 ", k: 0, n: 1},
		{in: "255/256", k: 255, n: 256},
		{in: "2/2", bad: "out of 0…1"},
		{in: "-1/2", bad: "out of 0…1"},
		{in: "0/0", bad: "out of 1…256"},
		{in: "0/257", bad: "out of 1…256"},
		{in: "1", bad: "not K/N"},
		{in: "a/b", bad: "not K/N"},
		{in: "", bad: "not K/N"},
	} {
		k, n, err := migrations.ParseShard(tt.in)
		if tt.bad != "" {
			require.ErrorIs(t, err, migrations.ErrShards, tt.in)
			require.ErrorContains(t, err, tt.bad, tt.in)
			continue
		}
		require.NoError(t, err, tt.in)
		require.Equal(t, []int{tt.k, tt.n}, []int{k, n}, tt.in)
	}
}

func TestSameFilter(t *testing.T) {
	t.Parallel()
	// As PostgreSQL 15 prints them back in pg_publication_tables.rowfilter.
	pg := "(((hashtextextended(conversation_id, (0)::bigint) & '9223372036854775807'::bigint) % (2)::bigint) = 1)"
	require.True(t, migrations.SameFilter(pg, migrations.ShardPredicate(2, 1)))
	require.False(t, migrations.SameFilter(pg, migrations.ShardPredicate(2, 0)))
	require.False(t, migrations.SameFilter(pg, migrations.ShardPredicate(4, 1)))
	require.False(t, migrations.SameFilter(pg, migrations.ShardPredicate(12, 1)))
	require.False(t, migrations.SameFilter(pg, migrations.ShardPredicate(2, 11)))
}

// pubFilters returns the row filters of publication name by table.
func pubFilters(t *testing.T, ctx context.Context, db *testsvc.Database, name string) map[string]string {
	t.Helper()
	rows, err := db.Pool.Query(ctx, `SELECT tablename::text, coalesce(rowfilter, '') FROM pg_publication_tables WHERE pubname = $1`, name)
	require.NoError(t, err)
	out := map[string]string{}
	for rows.Next() {
		var table, f string
		require.NoError(t, rows.Scan(&table, &f))
		out[table] = f
	}
	require.NoError(t, rows.Err())
	return out
}

func shardPubs(t *testing.T, ctx context.Context, db *testsvc.Database, base string) []string {
	t.Helper()
	rows, err := db.Pool.Query(ctx, `SELECT pubname::text FROM pg_publication WHERE pubname LIKE $1 || '\_%' ORDER BY pubname`, base)
	require.NoError(t, err)
	names, err := pgx.CollectRows(rows, pgx.RowTo[string])
	require.NoError(t, err)
	return names
}

// EnsureShards creates the shard publications once, checks them on every later call, and
// changes the shard count only while no shard slot exists.
func TestEnsureShards(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	db := testsvc.NewDatabase(t)
	o := migrations.ShardOptions{Options: migrations.Options{Publication: "baton"}, Slot: "es_" + db.Name[len(db.Name)-8:]}

	res, err := migrations.EnsureShards(ctx, db.Pool, o, 2)
	require.NoError(t, err)
	require.Equal(t, []string{"baton_0", "baton_1"}, res.Created)
	require.True(t, res.Changed())
	for k := range 2 {
		f := pubFilters(t, ctx, db, migrations.ShardName("baton", k))
		require.Len(t, f, 2)
		for table, want := range migrations.ShardFilters(2, k) {
			require.True(t, migrations.SameFilter(f[table], want), "%s: %s", table, f[table])
		}
	}
	var insertOnly bool
	require.NoError(t, db.Pool.QueryRow(ctx, `SELECT pubinsert AND NOT pubupdate AND NOT pubdelete FROM pg_publication WHERE pubname = 'baton_1'`).Scan(&insertOnly))
	require.True(t, insertOnly)

	res, err = migrations.EnsureShards(ctx, db.Pool, o, 2)
	require.NoError(t, err)
	require.False(t, res.Changed(), "%+v", res)

	// A filter changed by hand is put back.
	_, err = db.Pool.Exec(ctx, `ALTER PUBLICATION baton_1 SET TABLE agent_outbox`)
	require.NoError(t, err)
	res, err = migrations.EnsureShards(ctx, db.Pool, o, 2)
	require.NoError(t, err)
	require.Equal(t, []string{"baton_1"}, res.Altered)

	// Another count while a shard slot exists is refused, and nothing changes.
	_, err = db.Pool.Exec(ctx, `SELECT pg_create_logical_replication_slot($1, 'pgoutput')`, migrations.ShardName(o.Slot, 1))
	require.NoError(t, err)
	_, err = migrations.EnsureShards(ctx, db.Pool, o, 4)
	require.ErrorIs(t, err, migrations.ErrShards)
	require.ErrorContains(t, err, migrations.ShardName(o.Slot, 1))
	require.Equal(t, []string{"baton_0", "baton_1"}, shardPubs(t, ctx, db, "baton"))
	require.True(t, migrations.SameFilter(pubFilters(t, ctx, db, "baton_1")["agent_outbox"], migrations.ShardPredicate(2, 1)))

	// Without it, 4 shards: two redefined, two created; then back to 3: one dropped.
	_, err = db.Pool.Exec(ctx, `SELECT pg_drop_replication_slot($1)`, migrations.ShardName(o.Slot, 1))
	require.NoError(t, err)
	res, err = migrations.EnsureShards(ctx, db.Pool, o, 4)
	require.NoError(t, err)
	require.Equal(t, []string{"baton_0", "baton_1"}, res.Altered)
	require.Equal(t, []string{"baton_2", "baton_3"}, res.Created)
	require.True(t, migrations.SameFilter(pubFilters(t, ctx, db, "baton_3")["messages"], migrations.ShardFilters(4, 3)["messages"]))
	res, err = migrations.EnsureShards(ctx, db.Pool, o, 3)
	require.NoError(t, err)
	require.Equal(t, []string{"baton_3"}, res.Dropped)
	require.Equal(t, []string{"baton_0", "baton_1", "baton_2"}, shardPubs(t, ctx, db, "baton"))

	// Bounds and names.
	_, err = migrations.EnsureShards(ctx, db.Pool, o, 0)
	require.ErrorIs(t, err, migrations.ErrShards)
	_, err = migrations.EnsureShards(ctx, db.Pool, o, migrations.MaxShards+1)
	require.ErrorIs(t, err, migrations.ErrShards)
	long := o
	long.Publication = strings.Repeat("p", 62)
	_, err = migrations.EnsureShards(ctx, db.Pool, long, 10)
	require.ErrorContains(t, err, "longer than 63")
}

func TestPrintShards(t *testing.T) {
	t.Parallel()
	var b bytes.Buffer
	require.NoError(t, migrations.PrintShards(&b, migrations.ShardOptions{Options: migrations.Options{Schema: "app", Publication: "pub"}}, 2))
	out := b.String()
	require.Contains(t, out, `CREATE PUBLICATION "pub_0" FOR TABLE "app"."agent_outbox" WHERE (`+migrations.ShardPredicate(2, 0)+`)`)
	require.Contains(t, out, `CREATE PUBLICATION "pub_1"`)
	require.NotContains(t, out, "pub_2")
	require.ErrorIs(t, migrations.PrintShards(&b, migrations.ShardOptions{}, 0), migrations.ErrShards)
}
