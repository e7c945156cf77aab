package testsvc

import (
	"context"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"
)

func TestPrivilegeErrorUser(t *testing.T) {
	for _, tc := range []struct {
		line, db, user string
		ok             bool
	}{
		{`2026-12-03 13:00:00.000 UTC [42] 42501 baton_worker@shop ERROR:  permission denied for table agent_runs`, "shop", "baton_worker", true},
		{`2026-12-03 13:00:00.000 UTC [42] 42501 baton_worker@other ERROR:  permission denied for table agent_runs`, "shop", "baton_worker", false},
		{`2026-12-03 13:00:00.000 UTC [42] 23505 baton_worker@shop ERROR:  duplicate key`, "shop", "", false},
		{`2026-12-03 13:00:00.000 UTC [42] 00000 @ LOG:  checkpoint starting`, "shop", "", false},
	} {
		user, ok := privilegeErrorUser(tc.line, tc.db)
		require.Equal(t, tc.ok, ok, tc.line)
		if ok {
			require.Equal(t, tc.user, user)
		}
	}
	require.True(t, batonRoleRE.MatchString("baton_relay"))
	require.True(t, batonRoleRE.MatchString("baton_t_1_2_3_worker"))
	require.False(t, batonRoleRE.MatchString("postgres"))
	require.False(t, batonRoleRE.MatchString("shop_reports"))
}

// The check reads the real server's log: a Baton role's refused statement in the test's
// database is found there, another role's is not.
func TestPrivilegeErrorsAreFoundInTheServersLog(t *testing.T) {
	db := NewDatabase(t)
	db.AllowPrivilegeErrors() // this test reads them itself
	ctx := context.Background()
	for _, role := range []string{db.Name + "_worker", db.Name + "_reports"} {
		_, err := db.Pool.Exec(ctx, `CREATE ROLE `+role+` LOGIN`)
		require.NoError(t, err)
		t.Cleanup(func() { _, _ = db.Pool.Exec(context.Background(), `DROP OWNED BY `+role+`; DROP ROLE `+role) })
		conn, err := pgx.Connect(ctx, strings.Replace(db.URL, "postgres@", role+"@", 1)) // the log names the login role
		require.NoError(t, err)
		_, err = conn.Exec(ctx, `SELECT * FROM agent_runs`)
		require.Error(t, err, "the role may not read agent_runs")
		require.NoError(t, conn.Close(ctx))
	}
	require.NotNil(t, shared.pg, "this check needs the throwaway cluster's log (unset BATON_TEST_DATABASE_URL)")
	lines, err := privilegeErrors(shared.pg.LogPath(), db.Name)
	require.NoError(t, err)
	require.NotEmpty(t, lines)
	for _, l := range lines {
		require.Contains(t, l, db.Name+"_worker@", "only the Baton role's refusal: %s", l)
	}
}
