package deploytest

import (
	"context"
	"encoding/json"
	"errors"
	"io"
	"net"
	"net/http"
	"net/url"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/batonhq/baton/consumer"
	"github.com/batonhq/baton/internal/console"
)

// Texts a worker writes where the console never shows them: a tool's input, output and error,
// the run's error and the outbox row's last_error.
const (
	secretInput  = "secret-tool-input"
	secretOutput = "secret-tool-output"
	secretError  = "secret-tool-error"
)

// secretToolHandler calls one tool per turn with secretInput; in conversation "fails" the tool
// fails with secretError (so the run's error and the row's last_error hold it too), elsewhere
// it answers secretOutput.
func secretToolHandler(ctx context.Context, t *consumer.Turn) (consumer.Reply, error) {
	_, err := t.Tool(ctx, "lookup", consumer.Read, map[string]string{"q": secretInput},
		func(context.Context) (any, error) {
			if t.ConversationID == "fails" {
				return nil, errors.New(secretError)
			}
			return map[string]string{"a": secretOutput}, nil
		})
	if err != nil {
		return consumer.Reply{}, err
	}
	return consumer.Reply{Content: "echo: " + t.Messages[0].Content}, nil
}

// consoleShows are the columns of agent_outbox, operations and agent_runs that the console's
// queries read (internal/console/store.go, the status report it shows, and producer.Send's
// read-back of a retried message): all baton_console may read of these tables.
var consoleShows = []string{
	"agent_outbox.attempts", "agent_outbox.available_at", "agent_outbox.conversation_id",
	"agent_outbox.created_at", "agent_outbox.id", "agent_outbox.lease_expires_at",
	"agent_outbox.message_id", "agent_outbox.processed_at", "agent_outbox.reply_id",
	"agent_outbox.run_id", "agent_outbox.status",
	"agent_runs.conversation_id", "agent_runs.finished_at", "agent_runs.outbox_ids",
	"agent_runs.outcome", "agent_runs.run_id", "agent_runs.started_at", "agent_runs.worker",
	"operations.conversation_id", "operations.effect", "operations.finished_at", "operations.id",
	"operations.run_id", "operations.started_at", "operations.status", "operations.tool",
}

// TestRolesConsoleReadsOnlyWhatItShows: baton_console may read of agent_outbox, operations and
// agent_runs exactly the columns its pages show. The outbox row's last_error, the tools'
// inputs, outputs and errors and the runs' errors (internal text a worker wrote) are refused
// with SQLSTATE 42501, while the console itself, logged in as that role, serves every page:
// chat, events, timelines of a message and of a reply, and the system view's status, workers
// and chart.
func TestRolesConsoleReadsOnlyWhatItShows(t *testing.T) {
	t.Parallel()
	db, rs := setupRoles(t)
	db.AllowPrivilegeErrors() // it requires the roles' refusals
	ctx := context.Background()
	pool := rs.pool(t, roleConsole)

	// The console, as baton_console, with a worker (as baton_worker) answering.
	base := serveConsole(t, pool)
	startSecretWorker(t, rs.pool(t, roleWorker))
	for _, conv := range []string{"works", "fails"} {
		code, body := call(t, http.MethodPost, base+"/api/conversations", `{"id":"`+conv+`"}`)
		require.Equal(t, http.StatusCreated, code, body)
		code, body = call(t, http.MethodPost, base+"/api/conversations/"+conv+"/messages", `{"id":"`+conv+`-1","content":"hello"}`)
		require.Equal(t, http.StatusOK, code, body)
	}
	require.EventuallyWithT(t, func(c *assert.CollectT) {
		for id, want := range map[string][2]string{"works-1": {"done", "assistant"}, "fails-1": {"error", "error"}} {
			status, role, err := outboxState(db.Pool, id)
			assert.NoError(c, err)
			assert.Equal(c, want[0], status, id)
			assert.Equal(c, want[1], role, id)
		}
	}, 30*time.Second, 20*time.Millisecond)
	var withSecrets int
	require.NoError(t, db.Pool.QueryRow(ctx, `SELECT
		(SELECT count(*) FROM agent_outbox WHERE last_error LIKE '%'||$1||'%')
		+ (SELECT count(*) FROM agent_runs WHERE error LIKE '%'||$1||'%')
		+ (SELECT count(*) FROM operations WHERE input::text LIKE '%'||$2||'%')
		+ (SELECT count(*) FROM operations WHERE output::text LIKE '%'||$3||'%')
		+ (SELECT count(*) FROM operations WHERE error LIKE '%'||$1||'%')`,
		secretError, secretInput, secretOutput).Scan(&withSecrets))
	require.GreaterOrEqual(t, withSecrets, 5, "every hidden column holds a secret")

	// Every page's reads work as the role, and show none of it.
	var pages []string
	for _, p := range []string{
		"/api/conversations",
		"/api/conversations/works/messages",
		"/api/conversations/fails/messages",
		"/api/messages/works-1",
		"/api/messages/fails-1",
		"/api/messages/" + url.PathEscape(replyID(t, db.Pool, "works-1")),
		"/api/messages/" + url.PathEscape(replyID(t, db.Pool, "fails-1")),
		"/api/status",
	} {
		code, body := call(t, http.MethodGet, base+p, "")
		require.Equal(t, http.StatusOK, code, "%s: %s", p, body)
		require.NotContains(t, body, "permission denied", p)
		pages = append(pages, body)
	}
	var tl console.Timeline
	require.NoError(t, json.Unmarshal([]byte(pages[4]), &tl))
	require.Len(t, tl.Ops, 2, "the failed message's two attempts each called the tool")
	require.NotNil(t, tl.Reply)
	require.NoError(t, json.Unmarshal([]byte(pages[6]), &tl))
	require.NotNil(t, tl.Outbox, "a reply's timeline finds the row it answered")
	var st console.Status
	require.NoError(t, json.Unmarshal([]byte(pages[7]), &st))
	require.Empty(t, st.Outbox.Error)
	require.Empty(t, st.Schema.Error)
	require.Empty(t, st.Console.WorkerError)
	require.Empty(t, st.Console.SeriesError)
	require.Len(t, st.Console.Workers, 1)
	require.NotEmpty(t, st.Console.Series)
	events := firstEvent(t, base, "fails")
	require.Contains(t, events, `"fails-1"`)
	for _, body := range append(pages, events) {
		for _, s := range []string{secretInput, secretOutput, secretError} {
			require.NotContains(t, body, s)
		}
	}

	// What it does not show, it may not read.
	refusals(t, pool, map[string]string{
		"outbox last_error":        `SELECT last_error FROM agent_outbox`,
		"outbox last_error filter": `SELECT count(*) FROM agent_outbox WHERE last_error IS NOT NULL`,
		"outbox trace_context":     `SELECT trace_context FROM agent_outbox`,
		"outbox message_role":      `SELECT message_role FROM agent_outbox`,
		"outbox whole rows":        `SELECT * FROM agent_outbox`,
		"outbox row values":        `SELECT o FROM agent_outbox o`,
		"operation input":          `SELECT input FROM operations`,
		"operation output":         `SELECT output FROM operations`,
		"operation error":          `SELECT error FROM operations`,
		"operation message_id":     `SELECT message_id FROM operations`,
		"operations whole rows":    `SELECT * FROM operations`,
		"operation row values":     `SELECT to_jsonb(p) FROM operations p`,
		"run error":                `SELECT error FROM agent_runs`,
		"run error filter":         `SELECT run_id FROM agent_runs WHERE error LIKE 'secret%'`,
		"runs whole rows":          `SELECT * FROM agent_runs`,
		"run row values":           `SELECT r FROM agent_runs r`,
	})

	// Nothing more: the columns it may read, as Postgres answers for the role.
	rows, err := db.Pool.Query(ctx, `SELECT c.relname || '.' || a.attname FROM pg_class c
		JOIN pg_attribute a ON a.attrelid = c.oid
		WHERE c.relnamespace = 'public'::regnamespace AND c.relname IN ('agent_outbox', 'operations', 'agent_runs')
		  AND a.attnum > 0 AND NOT a.attisdropped AND has_column_privilege($1, c.oid, a.attnum, 'SELECT')
		ORDER BY 1`, rs.name(roleConsole))
	require.NoError(t, err)
	readable, err := pgx.CollectRows(rows, pgx.RowTo[string])
	require.NoError(t, err)
	require.Equal(t, consoleShows, readable)
}

// serveConsole serves a console on pool until the test ends, and returns its base URL.
func serveConsole(t *testing.T, pool *pgxpool.Pool) string {
	t.Helper()
	srv, err := console.New(console.Config{Pool: pool, PollInterval: 20 * time.Millisecond})
	require.NoError(t, err)
	var lc net.ListenConfig
	ln, err := lc.Listen(context.Background(), "tcp", "127.0.0.1:0")
	require.NoError(t, err)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 2)
	go func() { done <- srv.Serve(ctx, ln) }()
	go func() { done <- srv.Run(ctx) }()
	t.Cleanup(func() {
		cancel()
		for range 2 {
			select {
			case err := <-done:
				if err != nil {
					t.Errorf("console: %v", err)
				}
			case <-time.After(30 * time.Second):
				t.Error("console did not stop within 30s")
				return
			}
		}
	})
	return "http://" + ln.Addr().String()
}

// startSecretWorker runs a polling worker with secretToolHandler on pool until the test ends.
func startSecretWorker(t *testing.T, pool *pgxpool.Pool) {
	t.Helper()
	w, err := consumer.New(consumer.Config{
		Pool:             pool,
		Handler:          secretToolHandler,
		Name:             "deploytest-console",
		MaxAttempts:      2,
		BackoffBase:      10 * time.Millisecond,
		BackoffMax:       20 * time.Millisecond,
		PollInterval:     20 * time.Millisecond,
		RecoveryInterval: 50 * time.Millisecond,
		ShutdownGrace:    time.Second,
	})
	require.NoError(t, err)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- w.Run(ctx) }()
	t.Cleanup(func() {
		cancel()
		select {
		case err := <-done:
			if err != nil {
				t.Errorf("worker: %v", err)
			}
		case <-time.After(30 * time.Second):
			t.Error("worker did not stop within 30s")
		}
	})
}

// call sends a request with a JSON body (none when empty) and returns the status and body.
func call(t *testing.T, method, u, body string) (int, string) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	var r io.Reader
	if body != "" {
		r = strings.NewReader(body)
	}
	req, err := http.NewRequestWithContext(ctx, method, u, r)
	require.NoError(t, err)
	if body != "" {
		req.Header.Set("Content-Type", "application/json")
	}
	res, err := http.DefaultClient.Do(req)
	require.NoError(t, err)
	defer func() { _ = res.Body.Close() }()
	b, err := io.ReadAll(res.Body)
	require.NoError(t, err)
	return res.StatusCode, string(b)
}

// firstEvent opens a conversation's event stream and returns what it sent up to its first
// messages event.
func firstEvent(t *testing.T, base, conv string) string {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, base+"/api/conversations/"+conv+"/events", nil)
	require.NoError(t, err)
	res, err := http.DefaultClient.Do(req)
	require.NoError(t, err)
	defer func() { _ = res.Body.Close() }()
	require.Equal(t, http.StatusOK, res.StatusCode)
	var got strings.Builder
	buf := make([]byte, 4096)
	for !strings.Contains(got.String(), "event: messages\n") || !strings.HasSuffix(got.String(), "\n\n") {
		n, err := res.Body.Read(buf)
		got.Write(buf[:n])
		require.NoError(t, err, "event stream ended: %s", got.String())
	}
	return got.String()
}

// replyID returns the id of the reply to a message.
func replyID(t *testing.T, admin *pgxpool.Pool, messageID string) string {
	t.Helper()
	var id string
	require.NoError(t, admin.QueryRow(context.Background(),
		`SELECT reply_id FROM agent_outbox WHERE message_id = $1`, messageID).Scan(&id))
	return id
}
