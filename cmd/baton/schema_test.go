package main

import (
	"context"
	"encoding/json"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/batonhq/baton/internal/testsvc"
	"github.com/batonhq/baton/migrations"
)

// The end-to-end path runs with every Baton object in a schema of the user's choice: migrate
// creates it, the demo's producer, relay and workers carry 200 messages through it to their
// replies, and status reads it. The database's public schema holds tables of the same names
// (here Baton's own, as an application's would clash), which nothing touches.
func TestEverythingRunsInACustomSchema(t *testing.T) {
	t.Parallel()
	db := testsvc.NewDatabase(t) // public already holds tables named like Baton's
	ns := testsvc.StartNATS(t)
	ctx := context.Background()
	custom := []string{"--database-url", db.URL, "--schema", "baton_custom", "--publication", "baton_custom"}

	r := runBaton(t, append([]string{"migrate"}, custom...)...)
	require.Equal(t, 0, r.code, "stdout:\n%s\nstderr:\n%s", r.stdout, r.stderr)
	require.NoError(t, migrations.CheckIn(ctx, db.Pool, "baton_custom"))

	r = runBaton(t, append([]string{"demo", "--nats-url", ns.URL(), "--slot", db.Name, "--subject-prefix", db.Name,
		"--messages", "200", "--conversations", "5", "--rate", "0"}, custom...)...)
	require.Equal(t, 0, r.code, "stdout:\n%s\nstderr:\n%s", r.stdout, r.stderr)
	for _, want := range []string{"relayed: 200 of 200 accepted messages", "replied: 200 (", "lost: 0\n", "duplicates: 0 (", "result: OK"} {
		require.Contains(t, r.stdout, want)
	}

	var done, replies, publicRows int
	require.NoError(t, db.Pool.QueryRow(ctx, `SELECT
		(SELECT count(*) FROM baton_custom.agent_outbox WHERE status = 'done'),
		(SELECT count(*) FROM baton_custom.messages WHERE role = 'assistant'),
		(SELECT count(*) FROM public.agent_outbox) + (SELECT count(*) FROM public.messages)
			+ (SELECT count(*) FROM public.conversations) + (SELECT count(*) FROM public.baton_relay_slots)`).
		Scan(&done, &replies, &publicRows))
	require.Equal(t, 200, done)
	require.Positive(t, replies)
	require.Zero(t, publicRows, "nothing was written to the public schema's tables")
	var pubTables []string
	rows, err := db.Pool.Query(ctx, `SELECT schemaname || '.' || tablename FROM pg_publication_tables WHERE pubname = 'baton_custom' ORDER BY 1`)
	require.NoError(t, err)
	for rows.Next() {
		var s string
		require.NoError(t, rows.Scan(&s))
		pubTables = append(pubTables, s)
	}
	require.NoError(t, rows.Err())
	require.Equal(t, []string{"baton_custom.agent_outbox", "baton_custom.messages"}, pubTables)

	r = runBaton(t, "status", "--json", "--database-url", db.URL, "--schema", "baton_custom", "--slot", db.Name)
	var rep struct {
		Schema struct {
			Version int    `json:"version"`
			Error   string `json:"error"`
		} `json:"schema"`
	}
	require.NoError(t, json.Unmarshal([]byte(r.stdout), &rep), "stdout:\n%s\nstderr:\n%s", r.stdout, r.stderr)
	require.Empty(t, rep.Schema.Error)
	require.Equal(t, migrations.Latest(), rep.Schema.Version)
}

// migrate --print writes the script without a database, with the schema and publication given.
func TestMigratePrint(t *testing.T) {
	t.Parallel()
	r := runBaton(t, "migrate", "--print", "--schema", "app_baton", "--publication", "app_pub")
	require.Equal(t, 0, r.code, "stderr:\n%s", r.stderr)
	require.Contains(t, r.stdout, `CREATE SCHEMA IF NOT EXISTS "app_baton";`)
	require.Contains(t, r.stdout, `SET LOCAL search_path TO "app_baton";`)
	require.Contains(t, r.stdout, `CREATE PUBLICATION "app_pub"`)
	require.NotContains(t, r.stdout, `:"publication"`)
	r = runBaton(t, "migrate", "--print", "--schema", "pg_nope")
	require.Equal(t, 1, r.code, "stdout:\n%s\nstderr:\n%s", r.stdout, r.stderr)
	require.Contains(t, r.stderr, `--schema: "pg_nope" is reserved by PostgreSQL`)
}
