package migrations_test

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/batonhq/baton/internal/testsvc"
	"github.com/batonhq/baton/migrations"
)

// Two Baton installations in one database (BATON_SCHEMA): A in public with publication baton,
// B in schema tenant_b with publication baton_2 and a slot of another name. Sharding A must
// leave B's publication alone.
func TestEnsureShardsLeavesAnotherInstallationsPublication(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	db := testsvc.NewDatabase(t)
	_, err := migrations.UpWith(ctx, db.Pool, migrations.Options{Schema: "tenant_b", Publication: "baton_2"})
	require.NoError(t, err)
	schemas := func() []string {
		var s []string
		require.NoError(t, db.Pool.QueryRow(ctx, `SELECT coalesce(array_agg(DISTINCT schemaname::text), '{}')
			FROM pg_publication_tables WHERE pubname = 'baton_2'`).Scan(&s))
		return s
	}
	require.Equal(t, []string{"tenant_b"}, schemas())

	// 3 would redefine baton_2: refused, naming it. 2 would drop it (a shard past N−1): left alone.
	_, err = migrations.EnsureShards(ctx, db.Pool, migrations.ShardOptions{}, 3)
	require.ErrorIs(t, err, migrations.ErrShards)
	require.ErrorContains(t, err, "publication baton_2 exists and publishes tenant_b.")
	require.Equal(t, []string{"tenant_b"}, schemas(), "installation B's publication baton_2 was taken over by A's shards")
	res, err := migrations.EnsureShards(ctx, db.Pool, migrations.ShardOptions{}, 2)
	require.NoError(t, err)
	require.Equal(t, []string{"baton_0", "baton_1"}, res.Created)
	require.Empty(t, res.Dropped)
	require.Equal(t, []string{"tenant_b"}, schemas(), "installation B's publication baton_2 was dropped by A's shards")
}

// A filter changed by hand to another grouping is another shard: (h & (M % 3)) = 1 is h & 1 = 1,
// half of all conversations, not a third. Failed when SameFilter dropped every parenthesis.
func TestSameFilterTellsGroupingApart(t *testing.T) {
	t.Parallel()
	regrouped := "(hashtextextended(conversation_id, (0)::bigint) & ('9223372036854775807'::bigint % (3)::bigint)) = 1"
	require.False(t, migrations.SameFilter(regrouped, migrations.ShardPredicate(3, 1)))
}
