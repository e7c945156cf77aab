package deploytest

import (
	"context"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/batonhq/baton/internal/testsvc"
	"github.com/batonhq/baton/producer"
)

// TestRolesExistingRolesLoseBypasses: roles.sql creates a role only when it is missing, so a
// role left by an earlier install, a colleague or a provider's defaults keeps its attributes
// and memberships. Row-level security means nothing to a role with BYPASSRLS (or SUPERUSER),
// and a member of baton_worker, baton_migrator or pg_write_all_data gets their privileges and
// policies: roles.sql takes these away, as it resets table privileges.
func TestRolesExistingRolesLoseBypasses(t *testing.T) {
	t.Parallel()
	db, rs := setupRolesWith(t, func(rs *roleSet) []string {
		q := func(r string) string { return pgx.Identifier{rs.name(r)}.Sanitize() }
		return []string{
			`CREATE ROLE ` + q(roleMigrator) + ` LOGIN`,
			`CREATE ROLE ` + q(roleWorker) + ` LOGIN CREATEDB`,
			`CREATE ROLE ` + q(roleApp) + ` LOGIN BYPASSRLS CREATEROLE REPLICATION`,
			`CREATE ROLE ` + q(roleRelay) + ` LOGIN SUPERUSER`,
			`GRANT ` + q(roleWorker) + ` TO ` + q(roleApp),
			`GRANT ` + q(roleMigrator) + ` TO ` + q(roleWorker),
			`GRANT pg_read_all_data TO ` + q(roleRelay),
			`GRANT pg_write_all_data TO ` + q(roleApp),
		}
	})
	db.AllowPrivilegeErrors() // it requires the roles' refusals
	ctx := context.Background()

	var attrs []string
	rows, err := db.Pool.Query(ctx, `SELECT rolname || ':' || rolsuper || rolbypassrls || rolcreaterole || rolcreatedb || rolreplication
		FROM pg_roles WHERE rolname = ANY($1) ORDER BY 1`, []string{rs.name(roleApp), rs.name(roleRelay), rs.name(roleWorker)})
	require.NoError(t, err)
	attrs, err = pgx.CollectRows(rows, pgx.RowTo[string])
	require.NoError(t, err)
	require.Equal(t, []string{
		rs.name(roleApp) + ":falsefalsefalsefalsefalse",
		rs.name(roleRelay) + ":falsefalsefalsefalsetrue", // REPLICATION is the relay's one attribute
		rs.name(roleWorker) + ":falsefalsefalsefalsefalse",
	}, attrs)

	var memberships int
	require.NoError(t, db.Pool.QueryRow(ctx, `SELECT count(*) FROM pg_auth_members a JOIN pg_roles m ON m.oid = a.member
		WHERE m.rolname = ANY($1)`, []string{rs.name(roleApp), rs.name(roleRelay), rs.name(roleWorker)}).Scan(&memberships))
	require.Zero(t, memberships, "Baton's roles are members of no role that widens them")

	app := rs.pool(t, roleApp)
	_, err = newProducer(t).CreateConversation(ctx, app, "conv-1")
	require.NoError(t, err)
	_, err = newProducer(t).Send(ctx, app, producer.Message{ConversationID: "conv-1", ID: "m1", Content: "hi"})
	require.NoError(t, err)
	refusalsWith(t, app, map[string]string{
		"insert assistant message": `INSERT INTO messages (id, conversation_id, role, content) VALUES ('forged', 'conv-1', 'assistant', 'x')`,
	}, requireRowSecurity)
	refusals(t, app, map[string]string{"update outbox": `UPDATE agent_outbox SET status = 'done'`})
	refusals(t, rs.pool(t, roleRelay), map[string]string{"read messages": `SELECT content FROM messages`})
	refusals(t, rs.pool(t, roleWorker), map[string]string{"drop table": `DROP TABLE agent_runs`})
}

// setupRolesWith is setupRoles with statements run as the admin before roles.sql (given the
// role set, for its names).
func setupRolesWith(t *testing.T, before func(rs *roleSet) []string) (*testsvc.Database, *roleSet) {
	t.Helper()
	db := testsvc.NewDatabase(t)
	rs := newRoleSet(t, db, db.URL)
	for _, stmt := range before(rs) {
		_, err := db.Pool.Exec(context.Background(), stmt)
		require.NoError(t, err, stmt)
	}
	rs.apply(t)
	first := privilegeState(t, db.Pool)
	rs.apply(t)
	require.Equal(t, first, privilegeState(t, db.Pool), "running roles.sql again changed privileges or policies")
	return db, rs
}
