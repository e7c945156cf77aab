package deploytest

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/stretchr/testify/require"

	"github.com/batonhq/baton/internal/testsvc"
	"github.com/batonhq/baton/migrations"
)

// Baton installed with another schema and publication (BATON_SCHEMA, BATON_PUBLICATION) and
// sharded (baton migrate --shards 2): roles.sql, given both names as the settings baton.schema
// and baton.publication, grants on that schema and hands the publication and its shard
// publications to the migrator, and a shard relay logged in as baton_relay streams from it.
// Failed when roles.sql named public and the publication baton (the relay's role could not
// read its slot record in that schema).
func TestRolesWithAnotherSchemaAndPublication(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	db := testsvc.NewDatabase(t)
	const schema, publication = "agents", "agents_pub"
	o := migrations.Options{Schema: schema, Publication: publication}
	_, err := migrations.UpWith(ctx, db.Pool, o)
	require.NoError(t, err)
	_, err = migrations.EnsureShards(ctx, db.Pool, migrations.ShardOptions{Options: o, Slot: db.Name}, 2)
	require.NoError(t, err)

	rs := newRoleSet(t, db, db.URL)
	rs.sql = fmt.Sprintf("SET baton.schema = '%s'; SET baton.publication = '%s';\n", schema, publication) + rs.sql
	rs.apply(t)
	var owners []string
	rows, err := db.Pool.Query(ctx, `SELECT pubname || ' ' || pg_get_userbyid(pubowner) FROM pg_publication
		WHERE pubname LIKE 'agents_pub%' ORDER BY pubname`)
	require.NoError(t, err)
	for rows.Next() {
		var s string
		require.NoError(t, rows.Scan(&s))
		owners = append(owners, s)
	}
	require.NoError(t, rows.Err())
	migrator := rs.name(roleMigrator)
	require.Equal(t, []string{"agents_pub " + migrator, "agents_pub_0 " + migrator, "agents_pub_1 " + migrator}, owners)

	w := &leaderWorld{rs: rs, nats: testsvc.StartNATS(t), slot: db.Name, prefix: "agent"}
	p := testsvc.StartProcess(t, "relay shard 0", binary(t, "baton"), []string{
		"BATON_DATABASE_URL=" + rs.url(t, roleRelay), "BATON_NATS_URL=" + w.nats.URL(),
		"BATON_SLOT=" + w.slot, "BATON_SCHEMA=" + schema, "BATON_PUBLICATION=" + publication, "BATON_LOG_LEVEL=info",
	}, "relay", "--shard", "0/2")
	p.WaitLog(t, `msg=streaming`, time.Minute)

	// As the application: conversations in both shards, one message each; shard 0's arrive.
	app := rs.pool(t, roleApp)
	var inShard0 int
	for i := range 8 {
		conv := fmt.Sprintf("c%d", i)
		_, err := app.Exec(ctx, `INSERT INTO agents.conversations (id) VALUES ($1)`, conv)
		require.NoError(t, err)
		_, err = app.Exec(ctx, `WITH m AS (INSERT INTO agents.messages (id, conversation_id, role, content)
				VALUES ($1, $2, 'user', 'hello') RETURNING id, conversation_id)
			INSERT INTO agents.agent_outbox (conversation_id, message_id) SELECT conversation_id, id FROM m`, "m-"+conv, conv)
		require.NoError(t, err)
		var zero bool
		require.NoError(t, db.Pool.QueryRow(ctx, `SELECT `+migrations.ShardPredicate(2, 0)+` FROM (SELECT $1::text AS conversation_id) c`, conv).Scan(&zero))
		if zero {
			inShard0++
		}
	}
	require.Positive(t, inShard0, "no conversation of the eight falls in shard 0")
	nc, err := nats.Connect(w.nats.URL())
	require.NoError(t, err)
	defer nc.Close()
	w.js, err = jetstream.New(nc)
	require.NoError(t, err)
	require.Len(t, w.turns(t, inShard0), inShard0)
}
