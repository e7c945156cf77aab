package console

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"net/http"
	"net/url"
	"os"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/batonhq/baton/internal/testsvc"
)

// roleNameRE finds the role names in roles.sql; roles are cluster-wide, so the test renames
// them after its database, as deploy/deploytest does.
var roleNameRE = regexp.MustCompile(`\bbaton_(app|relay|worker|migrator|console)\b`)

// consolePool applies deploy/postgres/roles.sql to db under names of the test's own and
// returns a pool logged in as its baton_console.
func consolePool(t *testing.T, db *testsvc.Database) *pgxpool.Pool {
	t.Helper()
	ctx := context.Background()
	raw, err := os.ReadFile("../../deploy/postgres/roles.sql")
	require.NoError(t, err)
	prefix := db.Name
	sql := roleNameRE.ReplaceAllString(string(raw), prefix+"_$1")
	require.Contains(t, sql, prefix+"_console")
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		defer cancel()
		for _, r := range []string{"app", "relay", "worker", "migrator", "console"} {
			name := pgx.Identifier{prefix + "_" + r}.Sanitize()
			_, _ = db.Pool.Exec(ctx, "REASSIGN OWNED BY "+name+" TO CURRENT_USER; DROP OWNED BY "+name+"; DROP ROLE "+name)
		}
	})
	_, err = db.Pool.Exec(ctx, sql)
	require.NoError(t, err, "apply roles.sql")
	pw := make([]byte, 12)
	_, _ = rand.Read(pw)
	password := hex.EncodeToString(pw)
	role := prefix + "_console"
	_, err = db.Pool.Exec(ctx, "ALTER ROLE "+pgx.Identifier{role}.Sanitize()+" PASSWORD '"+password+"'")
	require.NoError(t, err)
	u, err := url.Parse(db.URL)
	require.NoError(t, err)
	u.User = url.UserPassword(role, password)
	pool, err := pgxpool.New(ctx, u.String())
	require.NoError(t, err)
	t.Cleanup(pool.Close)
	var user string
	require.NoError(t, pool.QueryRow(ctx, "SELECT current_user").Scan(&user))
	require.Equal(t, role, user)
	return pool
}

// TestConsoleRole: connected as baton_console with roles.sql's privileges, every page's data
// reads and sending works.
func TestConsoleRole(t *testing.T) {
	t.Parallel()
	e := &testEnv{db: testsvc.NewDatabase(t)}
	serve(t, e, Config{Pool: consolePool(t, e.db), PollInterval: 20 * time.Millisecond})

	e.createConversation(t, "conv-1")
	s := e.openStream(t, "conv-1")
	e.send(t, "conv-1", "m1", "hello")
	again := e.send(t, "conv-1", "m1", "hello")
	require.True(t, again.AlreadyAccepted)
	s.view(t, "m1", StateQueued)
	w := worker{t: t, e: e, conv: "conv-1", msgID: "m1", runID: "00000000-0000-4000-8000-000000000005", worker: "worker-a"}
	w.claim()
	s.view(t, "m1", StateRunning)
	w.reply("assistant", "echo: hello", "")
	require.Equal(t, "echo: hello", s.view(t, "m1", StateReplied).Reply, "the console reads the worker's reply (its SELECT policy)")

	code, body := e.do(t, http.MethodGet, "/api/messages/m1", nil)
	require.Equal(t, http.StatusOK, code, string(body))
	require.Contains(t, string(body), `"kind":"operation"`)
	require.Contains(t, string(body), `"kind":"replied"`)

	code, body = e.do(t, http.MethodGet, "/api/status", nil)
	require.Equal(t, http.StatusOK, code, string(body))
	var st Status
	require.NoError(t, json.Unmarshal(body, &st))
	require.Empty(t, st.Outbox.Error)
	require.Empty(t, st.Schema.Error)
	require.Empty(t, st.Slot.Error)
	require.Empty(t, st.Console.WorkerError)
	require.Empty(t, st.Console.SeriesError)
	require.Len(t, st.Console.Workers, 1)
	require.False(t, strings.Contains(string(body), "permission denied"), string(body))
}
