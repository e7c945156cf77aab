package main

import (
	"context"
	"encoding/json"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/batonhq/baton/internal/statusreport"
	"github.com/batonhq/baton/internal/testsvc"
	"github.com/batonhq/baton/migrations"
)

// `baton migrate --shards N` creates the shard publications once, changes nothing when run
// again, and refuses another N while a shard slot exists; --print adds their SQL.
func TestMigrateShards(t *testing.T) {
	t.Parallel()
	db := testsvc.NewDatabase(t)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	slot := "ms_" + db.Name

	r := runBaton(t, "migrate", "--database-url", db.URL, "--slot", slot, "--shards", "2", "--log-level", "info")
	require.Equal(t, 0, r.code, r.stderr)
	require.Contains(t, r.stdout, "2 shard publications baton_0 … baton_1\n")
	require.Contains(t, r.stderr, `msg="shard publication created" publication=baton_0 shards=2`)
	require.Contains(t, r.stderr, `msg="shard publication created" publication=baton_1 shards=2`)

	r = runBaton(t, "migrate", "--database-url", db.URL, "--slot", slot, "--shards", "2", "--log-level", "info")
	require.Equal(t, 0, r.code, r.stderr)
	require.Contains(t, r.stderr, `msg="shard publications already current" shards=2`)
	require.NotContains(t, r.stderr, "shard publication created")

	_, err := db.Pool.Exec(ctx, `SELECT pg_create_logical_replication_slot($1, 'pgoutput')`, slot+"_0")
	require.NoError(t, err)
	r = runBaton(t, "migrate", "--database-url", db.URL, "--slot", slot, "--shards", "3")
	require.Equal(t, 1, r.code, r.stderr)
	require.Contains(t, r.stderr, "shard slots "+slot+"_0 exist")
	require.Contains(t, r.stderr, "Resharding")

	r = runBaton(t, "migrate", "--print", "--shards", "2", "--publication", "pub")
	require.Equal(t, 0, r.code, r.stderr)
	require.Contains(t, r.stdout, "CREATE PUBLICATION \"pub\"\n")
	require.Contains(t, r.stdout, `CREATE PUBLICATION "pub_1" FOR TABLE "public"."agent_outbox" WHERE (`+migrations.ShardPredicate(2, 1)+`)`)
	r = runBaton(t, "migrate", "--print", "--publication", "pub")
	require.Equal(t, 0, r.code, r.stderr)
	require.NotContains(t, r.stdout, "pub_0")

	for _, bad := range []string{"-1", "257"} {
		r = runBaton(t, "migrate", "--print", "--shards", bad)
		require.Equal(t, 2, r.code, bad)
		require.Contains(t, r.stderr, "--shards:", bad)
	}
	r = runBaton(t, "migrate", "--print", "--shards", "10", "--publication", strings.Repeat("p", 62))
	require.Equal(t, 1, r.code)
	require.Contains(t, r.stderr, "longer than 63 bytes")

	r = runBaton(t, "help", "migrate")
	require.Contains(t, r.stdout+r.stderr, "-shards")
}

func TestRelayShardUsage(t *testing.T) {
	t.Parallel()
	for _, bad := range []string{"2/2", "1", "x/2", "0/0", "0/300"} {
		r := runBaton(t, "relay", "--shard", bad, "--database-url", "postgres:///x", "--nats-url", "nats://127.0.0.1:1")
		require.Equal(t, 2, r.code, "%s: %s", bad, r.stderr)
		require.Contains(t, r.stderr, "--shard: ", bad)
	}
	r := runBaton(t, "relay", "-h")
	require.Contains(t, r.stderr, "-shard K/N")
}

// `baton status` finds the shard publications and shows each shard's slot: missing ones need
// attention, an inactive one is a warning, one past the shard count is a warning; the main
// slot, unused with shards, is not required.
func TestStatusShowsShardSlots(t *testing.T) {
	t.Parallel()
	db := testsvc.NewDatabase(t)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	slot := "st_" + db.Name
	status := func(args ...string) result {
		return runBaton(t, append([]string{"status", "--database-url", db.URL, "--slot", slot}, args...)...)
	}
	r := status("--json")
	var rep statusreport.Report
	require.NoError(t, json.Unmarshal([]byte(r.stdout), &rep), r.stdout+r.stderr)
	require.Nil(t, rep.Shards, "no shard publications, no shards")
	// Another installation's publication named like a shard (schema tenant_b, publication
	// baton_2) is not one of this installation's shards.
	r = runBaton(t, "migrate", "--database-url", db.URL, "--schema", "tenant_b", "--publication", "baton_2")
	require.Equal(t, 0, r.code, r.stderr)
	r = status("--json")
	require.NoError(t, json.Unmarshal([]byte(r.stdout), &rep), r.stdout+r.stderr)
	require.Nil(t, rep.Shards, "another schema's publication baton_2 counted as a shard")

	r = runBaton(t, "migrate", "--database-url", db.URL, "--slot", slot, "--shards", "2")
	require.Equal(t, 0, r.code, r.stderr)
	r = status("--json")
	require.Equal(t, 1, r.code, r.stdout+r.stderr)
	require.NoError(t, json.Unmarshal([]byte(r.stdout), &rep), r.stdout)
	require.NotNil(t, rep.Shards)
	require.Equal(t, 2, rep.Shards.Count)
	require.Len(t, rep.Shards.Slots, 2)
	require.Len(t, rep.Attention, 2, "%q", rep.Attention)
	require.Contains(t, rep.Attention[0], `replication slot "`+slot+`_0" does not exist`)
	require.Contains(t, rep.Attention[1], "`baton relay --shard 1/2`")

	for _, s := range []string{slot + "_0", slot + "_1", slot + "_7"} {
		_, err := db.Pool.Exec(ctx, `SELECT pg_create_logical_replication_slot($1, 'pgoutput')`, s)
		require.NoError(t, err)
	}
	r = status()
	require.Equal(t, 0, r.code, r.stdout+r.stderr)
	require.Regexp(t, `(?m)^  0/2 +`+slot+`_0 +no +reserved +[0-9A-F]+/[0-9A-F]+ +[0-9.]+ [KMG]?i?B`, r.stdout)
	require.Regexp(t, `(?m)^  stray +`+slot+`_7 +no`, r.stdout)
	require.Contains(t, r.stdout, `slot "`+slot+`_1" is inactive`)
	require.Contains(t, r.stdout, `replication slot "`+slot+`_7" is not one of the 2 shards'`)
	require.Contains(t, r.stdout, "ok: nothing needs attention")
	require.NotContains(t, r.stdout, `replication slot "`+slot+`" does not exist`, "the main slot is not needed with shards")
}
