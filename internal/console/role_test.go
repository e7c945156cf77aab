package console

import (
	"context"
	"encoding/json"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/batonhq/baton/internal/testsvc"
)

// TestConsoleRole: connected as baton_console with roles.sql's privileges, every page's data
// reads and sending works.
func TestConsoleRole(t *testing.T) {
	t.Parallel()
	e := &testEnv{db: testsvc.NewDatabase(t)}
	serve(t, e, Config{Pool: e.db.RolePool(t, testsvc.RoleConsole), PollInterval: 20 * time.Millisecond})

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

// Was: /api/status answered what Postgres said ("permission denied for table agent_runs
// (SQLSTATE 42501)"), where the message view answers "internal error (see the console's log)".
// With the console role's reads of the outbox and the runs revoked, the report says which part
// failed, and nothing of what Postgres said.
func TestStatusHidesDatabaseErrors(t *testing.T) {
	t.Parallel()
	e := &testEnv{db: testsvc.NewDatabase(t)}
	e.db.AllowPrivilegeErrors() // the refusals are the test
	role := pgx.Identifier{e.db.RoleName(testsvc.RoleConsole)}.Sanitize()
	_, err := e.db.Pool.Exec(context.Background(), "REVOKE ALL ON agent_outbox, agent_runs FROM "+role)
	require.NoError(t, err)
	serve(t, e, Config{Pool: e.db.RolePool(t, testsvc.RoleConsole), PollInterval: 20 * time.Millisecond})

	code, body := e.do(t, http.MethodGet, "/api/status", nil)
	require.Equal(t, http.StatusOK, code)
	var st struct {
		Outbox struct {
			Error string `json:"error"`
		} `json:"outbox"`
		Console struct {
			WorkerError string `json:"worker_error"`
			SeriesError string `json:"series_error"`
		} `json:"console"`
	}
	require.NoError(t, json.Unmarshal(body, &st), string(body))
	require.Equal(t, "internal error (see the console's log)", st.Outbox.Error, string(body))
	require.Equal(t, "internal error (see the console's log)", st.Console.WorkerError, string(body))
	for _, raw := range []string{"permission denied", "SQLSTATE", "42501", "agent_runs"} {
		require.NotContains(t, string(body), raw)
	}
}
