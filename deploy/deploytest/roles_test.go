package deploytest

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"net/url"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"go.opentelemetry.io/otel/trace"

	"github.com/batonhq/baton/consumer"
	"github.com/batonhq/baton/internal/testsvc"
	"github.com/batonhq/baton/migrations"
	"github.com/batonhq/baton/producer"
	"github.com/batonhq/baton/relay"
	"github.com/batonhq/baton/wire"
)

// Baton's roles, as named in roles.sql.
const (
	roleApp      = "app"
	roleRelay    = "relay"
	roleWorker   = "worker"
	roleMigrator = "migrator"
	roleConsole  = "console"
)

// roleSet is roles.sql's roles under names of one test's own.
type roleSet struct {
	prefix   string
	password string
	dbURL    string // the database the roles work in, as the test's admin
	sql      string // roles.sql with this set's names
}

// newRoleSet prepares roles named after db (which must be the test's own) for a database
// reached as dbURL, and drops them when the test ends.
func newRoleSet(t *testing.T, db *testsvc.Database, dbURL string) *roleSet {
	t.Helper()
	pw := make([]byte, 12)
	_, _ = rand.Read(pw)
	rs := &roleSet{prefix: db.Name, password: hex.EncodeToString(pw), dbURL: dbURL}
	sql, err := testsvc.RolesSQL(rs.prefix)
	require.NoError(t, err)
	rs.sql = sql
	require.NotContains(t, rs.sql, "baton_app")
	require.Contains(t, rs.sql, "baton_relay_slots", "renaming roles must not rename tables")
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		defer cancel()
		for _, r := range []string{roleApp, roleRelay, roleWorker, roleMigrator, roleConsole} {
			name := pgx.Identifier{rs.name(r)}.Sanitize()
			var exists bool
			if err := db.Pool.QueryRow(ctx, `SELECT EXISTS (SELECT FROM pg_roles WHERE rolname = $1)`, rs.name(r)).Scan(&exists); err != nil {
				t.Errorf("look up role %s: %v", name, err)
				continue
			}
			if !exists {
				continue
			}
			// Objects the role owns in the test's database go back to the admin (the database
			// is dropped next); its privileges, also on the database itself, go away.
			if _, err := db.Pool.Exec(ctx, "REASSIGN OWNED BY "+name+" TO CURRENT_USER; DROP OWNED BY "+name+"; DROP ROLE "+name); err != nil {
				t.Errorf("drop role %s: %v", name, err)
			}
		}
	})
	return rs
}

// name returns the role's name in this set.
func (rs *roleSet) name(role string) string { return rs.prefix + "_" + role }

// apply runs roles.sql in the set's database as the admin, then gives every role the set's
// password (roles.sql never sets passwords: they are set separately, as here).
func (rs *roleSet) apply(t *testing.T) {
	t.Helper()
	ctx := context.Background()
	conn, err := pgx.Connect(ctx, rs.dbURL)
	require.NoError(t, err)
	defer func() { _ = conn.Close(ctx) }()
	_, err = conn.Exec(ctx, rs.sql)
	require.NoError(t, err, "apply roles.sql")
	for _, r := range []string{roleApp, roleRelay, roleWorker, roleMigrator, roleConsole} {
		_, err := conn.Exec(ctx, "ALTER ROLE "+pgx.Identifier{rs.name(r)}.Sanitize()+" PASSWORD "+quote(rs.password))
		require.NoError(t, err)
	}
}

func quote(s string) string { return "'" + strings.ReplaceAll(s, "'", "''") + "'" }

// url returns the set's database URL logging in as role.
func (rs *roleSet) url(t *testing.T, role string) string {
	t.Helper()
	u, err := url.Parse(rs.dbURL)
	require.NoError(t, err)
	u.User = url.UserPassword(rs.name(role), rs.password)
	return u.String()
}

// pool returns a pool logged in as role, closed when the test ends.
func (rs *roleSet) pool(t *testing.T, role string) *pgxpool.Pool {
	t.Helper()
	p, err := pgxpool.New(context.Background(), rs.url(t, role))
	require.NoError(t, err)
	t.Cleanup(p.Close)
	var user string
	require.NoError(t, p.QueryRow(context.Background(), "SELECT current_user").Scan(&user))
	require.Equal(t, rs.name(role), user)
	return p
}

// setupRoles gives the test its own migrated database with roles.sql applied, twice: running
// it again must change nothing.
//
// Before, PUBLIC gets CREATE on schema public, as in a cluster upgraded from PostgreSQL 14 or
// older: roles.sql must take it away, or every role could create objects in Baton's schema.
func setupRoles(t *testing.T) (*testsvc.Database, *roleSet) {
	t.Helper()
	db := testsvc.NewDatabase(t)
	_, err := db.Pool.Exec(context.Background(), `GRANT CREATE ON SCHEMA public TO PUBLIC`)
	require.NoError(t, err)
	rs := newRoleSet(t, db, db.URL)
	rs.apply(t)
	first := privilegeState(t, db.Pool)
	rs.apply(t)
	require.Equal(t, first, privilegeState(t, db.Pool), "running roles.sql again changed privileges or policies")
	return db, rs
}

// privilegeState describes every privilege and policy in the database's public schema: the
// ACLs of the schema, its tables, their columns and functions, and the row-level security
// policies, one line each, sorted.
func privilegeState(t *testing.T, pool *pgxpool.Pool) []string {
	t.Helper()
	rows, err := pool.Query(context.Background(), `
		SELECT 'schema ' || coalesce(nspacl::text, '') FROM pg_namespace WHERE nspname = 'public'
		UNION ALL
		SELECT 'table ' || relname || ' ' || coalesce(relacl::text, '') || ' rls=' || relrowsecurity
			|| ' force=' || relforcerowsecurity || ' owner=' || pg_get_userbyid(relowner)
		FROM pg_class WHERE relnamespace = 'public'::regnamespace AND relkind IN ('r', 'p', 'v', 'S')
		UNION ALL
		SELECT 'column ' || attrelid::regclass || '.' || attname || ' ' || attacl::text
		FROM pg_attribute WHERE attacl IS NOT NULL
			AND attrelid IN (SELECT oid FROM pg_class WHERE relnamespace = 'public'::regnamespace)
		UNION ALL
		SELECT 'function ' || oid::regprocedure || ' ' || coalesce(proacl::text, '')
		FROM pg_proc WHERE pronamespace = 'public'::regnamespace
		UNION ALL
		SELECT 'policy ' || tablename || ' ' || policyname || ' ' || cmd || ' ' || roles::text || ' '
			|| coalesce(qual, '') || ' ' || coalesce(with_check, '')
		FROM pg_policies WHERE schemaname = 'public'
		ORDER BY 1`)
	require.NoError(t, err)
	state, err := pgx.CollectRows(rows, pgx.RowTo[string])
	require.NoError(t, err)
	return state
}

// requireDenied asserts that err is Postgres refusing a privilege (SQLSTATE 42501).
func requireDenied(t *testing.T, err error, what string) {
	t.Helper()
	var pgErr *pgconn.PgError
	require.Error(t, err, "%s: should be refused", what)
	require.True(t, errors.As(err, &pgErr), "%s: %v", what, err)
	require.Equal(t, "42501", pgErr.Code, "%s: %v", what, err)
}

// refusals runs each statement as q and requires a privilege error; each runs in a
// transaction that is rolled back, so nothing it could do survives.
func refusals(t *testing.T, q *pgxpool.Pool, stmts map[string]string) {
	t.Helper()
	refusalsWith(t, q, stmts, requireDenied)
}

// refusalsWith is refusals with another check of the error.
func refusalsWith(t *testing.T, q *pgxpool.Pool, stmts map[string]string, check func(t *testing.T, err error, what string)) {
	t.Helper()
	ctx := context.Background()
	for what, stmt := range stmts {
		func() {
			tx, err := q.Begin(ctx)
			require.NoError(t, err)
			defer func() { _ = tx.Rollback(ctx) }() // also when the assertion fails
			_, err = tx.Exec(ctx, stmt)
			check(t, err, what)
		}()
	}
}

// requireRowSecurity asserts that err is a row-level security policy refusing a new row.
func requireRowSecurity(t *testing.T, err error, what string) {
	t.Helper()
	requireDenied(t, err, what)
	require.ErrorContains(t, err, "row-level security policy", what)
}

// requireConversationMismatch asserts that err is the foreign key that ties an outbox row to a
// user message of its conversation.
func requireConversationMismatch(t *testing.T, err error, what string) {
	t.Helper()
	var pgErr *pgconn.PgError
	require.Error(t, err, "%s: should be refused", what)
	require.True(t, errors.As(err, &pgErr), "%s: %v", what, err)
	require.Equal(t, "23503", pgErr.Code, "%s: %v", what, err)
	require.Equal(t, "agent_outbox_user_message_fkey", pgErr.ConstraintName, what)
}

func newProducer(t *testing.T) *producer.Producer {
	t.Helper()
	p, err := producer.New(producer.Config{})
	require.NoError(t, err)
	return p
}

func TestRolesApp(t *testing.T) {
	t.Parallel()
	db, rs := setupRoles(t)
	db.AllowPrivilegeErrors() // it requires the roles' refusals
	ctx := context.Background()
	app := rs.pool(t, roleApp)
	p := newProducer(t)

	created, err := p.CreateConversation(ctx, app, "conv-1")
	require.NoError(t, err)
	require.True(t, created)
	created, err = p.CreateConversation(ctx, app, "conv-1")
	require.NoError(t, err)
	require.False(t, created)

	msg := producer.Message{ConversationID: "conv-1", ID: "msg-1", Content: "hello"}
	res, err := p.Send(ctx, app, msg)
	require.NoError(t, err)
	require.False(t, res.AlreadyAccepted)
	again, err := p.Send(ctx, app, msg) // a retry reads the existing rows back
	require.NoError(t, err)
	require.True(t, again.AlreadyAccepted)
	require.Equal(t, res.OutboxID, again.OutboxID)
	_, err = p.Send(ctx, app, producer.Message{ConversationID: "conv-1", ID: "msg-1", Content: "other"})
	require.ErrorIs(t, err, producer.ErrConflict)
	_, err = p.Send(ctx, app, producer.Message{ConversationID: "missing", ID: "msg-x", Content: "hi"})
	require.ErrorIs(t, err, producer.ErrConversationNotFound)

	tx, err := app.Begin(ctx)
	require.NoError(t, err)
	// With the caller's span, which the app may store as the row's trace_context.
	traced := trace.ContextWithSpanContext(ctx, trace.NewSpanContext(trace.SpanContextConfig{
		TraceID: trace.TraceID{1}, SpanID: trace.SpanID{2}, TraceFlags: trace.FlagsSampled}))
	_, err = p.SendTx(traced, tx, producer.Message{ConversationID: "conv-1", ID: "msg-2", Content: "in a tx"})
	require.NoError(t, err)
	require.NoError(t, tx.Commit(ctx))
	var tc string
	require.NoError(t, app.QueryRow(ctx, `SELECT trace_context FROM agent_outbox WHERE message_id = 'msg-2'`).Scan(&tc))
	require.Equal(t, "00-01000000000000000000000000000000-0200000000000000-01", tc)

	// The app reads what it wrote, with the queue fields at their defaults.
	var status string
	var attempts int
	require.NoError(t, app.QueryRow(ctx, `SELECT status, attempts FROM agent_outbox WHERE id = $1`, res.OutboxID).
		Scan(&status, &attempts))
	require.Equal(t, "pending", status)
	require.Zero(t, attempts)

	// A user message without an outbox row, to aim outbox inserts at.
	_, err = app.Exec(ctx, `INSERT INTO messages (id, conversation_id, role, content) VALUES ('msg-3', 'conv-1', 'user', 'x')`)
	require.NoError(t, err)
	refusals(t, app, map[string]string{
		"insert with status":   `INSERT INTO agent_outbox (conversation_id, message_id, status) VALUES ('conv-1', 'msg-3', 'done')`,
		"insert with attempts": `INSERT INTO agent_outbox (conversation_id, message_id, attempts) VALUES ('conv-1', 'msg-3', 3)`,
		"insert with run_id":   `INSERT INTO agent_outbox (conversation_id, message_id, run_id) VALUES ('conv-1', 'msg-3', gen_random_uuid())`,
		"insert with lease":    `INSERT INTO agent_outbox (conversation_id, message_id, lease_expires_at) VALUES ('conv-1', 'msg-3', now())`,
		"insert with id":       `INSERT INTO agent_outbox (id, conversation_id, message_id) OVERRIDING SYSTEM VALUE VALUES (1000, 'conv-1', 'msg-3')`,
		"insert created_at":    `INSERT INTO messages (id, conversation_id, role, content, created_at) VALUES ('m9', 'conv-1', 'user', 'x', now())`,
		"insert message trace": `INSERT INTO messages (id, conversation_id, role, content, trace_context) VALUES ('m9', 'conv-1', 'user', 'x', 't')`,
		"update outbox":        `UPDATE agent_outbox SET status = 'done'`,
		"update message":       `UPDATE messages SET content = 'changed'`,
		"update conversation":  `UPDATE conversations SET unread_count = 0`,
		"delete outbox":        `DELETE FROM agent_outbox`,
		"delete messages":      `DELETE FROM messages`,
		"delete conversations": `DELETE FROM conversations`,
		"truncate":             `TRUNCATE agent_outbox`,
		"select operations":    `SELECT * FROM operations`,
		"select agent_runs":    `SELECT * FROM agent_runs`,
		"insert operations":    `INSERT INTO operations (run_id, conversation_id, tool, effect) VALUES (gen_random_uuid(), 'conv-1', 't', 'read')`,
		"select relay slots":   `SELECT * FROM baton_relay_slots`,
		"fence":                `SELECT baton_fence(true, 'x')`,
		"create table":         `CREATE TABLE app_table (id int)`,
		"drop table":           `DROP TABLE agent_outbox`,
	})
	// Forged outcomes: the app writes user messages only. A reply it inserted would be published
	// to subscribers as the agent's.
	refusalsWith(t, app, map[string]string{
		"insert assistant message": `INSERT INTO messages (id, conversation_id, role, content) VALUES ('forged', 'conv-1', 'assistant', 'x')`,
		"insert error message":     `INSERT INTO messages (id, conversation_id, role, content) VALUES ('forged', 'conv-1', 'error', 'x')`,
		"forged reply with an outbox row": `WITH m AS (INSERT INTO messages (id, conversation_id, role, content)
			VALUES ('forged', 'conv-1', 'assistant', 'x') RETURNING id, conversation_id)
			INSERT INTO agent_outbox (conversation_id, message_id) SELECT conversation_id, id FROM m`,
		"forged reply on conflict": `INSERT INTO messages (id, conversation_id, role, content) VALUES ('forged', 'conv-1', 'assistant', 'x')
			ON CONFLICT (id) DO NOTHING`,
	}, requireRowSecurity)
	// An outbox row of another conversation than its message's.
	_, err = p.CreateConversation(ctx, app, "conv-2")
	require.NoError(t, err)
	refusalsWith(t, app, map[string]string{
		"outbox row of another conversation": `INSERT INTO agent_outbox (conversation_id, message_id) VALUES ('conv-2', 'msg-3')`,
		"message and outbox row in one statement": `WITH m AS (INSERT INTO messages (id, conversation_id, role, content)
			VALUES ('msg-4', 'conv-1', 'user', 'x') RETURNING id)
			INSERT INTO agent_outbox (conversation_id, message_id) SELECT 'conv-2', id FROM m`,
	}, requireConversationMismatch)

	var n int
	require.NoError(t, db.Pool.QueryRow(ctx, `SELECT count(*) FROM agent_outbox WHERE status = 'pending' AND attempts = 0`).Scan(&n))
	require.Equal(t, 2, n, "the app's rows are pending with no attempts, and nothing else was written")
}

// TestRolesConsole: baton_console reads every table its pages show, including the worker's
// replies (its own SELECT policy on messages), sends exactly as baton_app does, and writes
// nothing else.
func TestRolesConsole(t *testing.T) {
	t.Parallel()
	db, rs := setupRoles(t)
	db.AllowPrivilegeErrors() // it requires the roles' refusals
	ctx := context.Background()
	console := rs.pool(t, roleConsole)
	p := newProducer(t)

	_, err := p.CreateConversation(ctx, console, "conv-1")
	require.NoError(t, err)
	msg := producer.Message{ConversationID: "conv-1", ID: "msg-1", Content: "hello"}
	res, err := p.Send(ctx, console, msg)
	require.NoError(t, err)
	again, err := p.Send(ctx, console, msg)
	require.NoError(t, err)
	require.True(t, again.AlreadyAccepted)
	require.Equal(t, res.OutboxID, again.OutboxID)

	// A reply written by the owner: the console sees it through its policy.
	_, err = db.Pool.Exec(ctx, `INSERT INTO messages (id, conversation_id, role, content) VALUES ('baton:reply:1', 'conv-1', 'assistant', 'hi')`)
	require.NoError(t, err)
	var n int
	require.NoError(t, console.QueryRow(ctx, `SELECT count(*) FROM messages`).Scan(&n))
	require.Equal(t, 2, n)
	for _, q := range []string{`SELECT count(*) FROM agent_outbox`, `SELECT count(*) FROM operations`,
		`SELECT count(*) FROM agent_runs`, `SELECT count(*) FROM conversations`, `SELECT count(*) FROM baton_schema_migrations`} {
		require.NoError(t, console.QueryRow(ctx, q).Scan(&n), q)
	}

	// It inserts exactly what the app may insert: the same columns of the same tables.
	insertable := func(role string) []string {
		rows, err := db.Pool.Query(ctx, `SELECT c.relname || '.' || a.attname FROM pg_class c
			JOIN pg_namespace n ON n.oid = c.relnamespace JOIN pg_attribute a ON a.attrelid = c.oid
			WHERE n.nspname = 'public' AND c.relkind = 'r' AND a.attnum > 0 AND NOT a.attisdropped
			  AND has_column_privilege($1, c.oid, a.attnum, 'INSERT') ORDER BY 1`, role)
		require.NoError(t, err)
		cols, err := pgx.CollectRows(rows, pgx.RowTo[string])
		require.NoError(t, err)
		require.NotEmpty(t, cols, role)
		return cols
	}
	require.Equal(t, insertable(rs.name(roleApp)), insertable(rs.name(roleConsole)), "the console's insert rights are the app's")

	_, err = console.Exec(ctx, `INSERT INTO messages (id, conversation_id, role, content) VALUES ('msg-3', 'conv-1', 'user', 'x')`)
	require.NoError(t, err)
	refusals(t, console, map[string]string{
		"insert with status":   `INSERT INTO agent_outbox (conversation_id, message_id, status) VALUES ('conv-1', 'msg-3', 'done')`,
		"update outbox":        `UPDATE agent_outbox SET status = 'done'`,
		"update message":       `UPDATE messages SET content = 'changed'`,
		"update conversation":  `UPDATE conversations SET unread_count = 0`,
		"delete outbox":        `DELETE FROM agent_outbox`,
		"delete messages":      `DELETE FROM messages`,
		"delete conversations": `DELETE FROM conversations`,
		"update runs":          `UPDATE agent_runs SET outcome = 'done'`,
		"insert operations":    `INSERT INTO operations (run_id, conversation_id, tool, effect) VALUES (gen_random_uuid(), 'conv-1', 't', 'read')`,
		"select relay slots":   `SELECT * FROM baton_relay_slots`,
		"fence":                `SELECT baton_fence(true, 'x')`,
		"create table":         `CREATE TABLE console_table (id int)`,
	})
	refusalsWith(t, console, map[string]string{
		"insert assistant message": `INSERT INTO messages (id, conversation_id, role, content) VALUES ('forged', 'conv-1', 'assistant', 'x')`,
		"insert error message":     `INSERT INTO messages (id, conversation_id, role, content) VALUES ('forged', 'conv-1', 'error', 'x')`,
	}, requireRowSecurity)
}

// echoHandler answers each turn with its messages, after a read tool call; turns of the
// conversation "fails" fail.
func echoHandler(ctx context.Context, t *consumer.Turn) (consumer.Reply, error) {
	if _, err := t.Tool(ctx, "history", consumer.Read, map[string]string{"conversation": t.ConversationID},
		func(ctx context.Context) (any, error) {
			h, err := t.History(ctx, 10)
			return len(h), err
		}); err != nil {
		return consumer.Reply{}, err
	}
	if t.ConversationID == "fails" {
		return consumer.Reply{}, errors.New("this conversation always fails")
	}
	parts := make([]string, len(t.Messages))
	for i, m := range t.Messages {
		parts[i] = m.Content
	}
	return consumer.Reply{Content: "echo: " + strings.Join(parts, " | ")}, nil
}

// startWorker runs a polling worker on pool until the test ends.
func startWorker(t *testing.T, pool *pgxpool.Pool) {
	t.Helper()
	w, err := consumer.New(consumer.Config{
		Pool:             pool,
		Handler:          echoHandler,
		Name:             "deploytest",
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

// outboxState returns the status of the outbox row of a message and the role of its reply.
func outboxState(admin *pgxpool.Pool, messageID string) (status, replyRole string, err error) {
	err = admin.QueryRow(context.Background(), `SELECT o.status, coalesce(r.role, '')
		FROM agent_outbox o LEFT JOIN messages r ON r.id = o.reply_id WHERE o.message_id = $1`, messageID).
		Scan(&status, &replyRole)
	return status, replyRole, err
}

// The app sends user messages, and an outbox row is a user message's turn: an outbox row the
// app points at a reply (or an error message) would have a worker run a turn whose request is
// the agent's own words, as if the user had sent them. (Found by an adversarial review.)
func TestRolesAppCannotQueueAReply(t *testing.T) {
	t.Parallel()
	db, rs := setupRoles(t)
	db.AllowPrivilegeErrors() // it requires the roles' refusals
	ctx := context.Background()
	app := rs.pool(t, roleApp)
	p := newProducer(t)
	_, err := p.CreateConversation(ctx, app, "conv-1")
	require.NoError(t, err)
	_, err = db.Pool.Exec(ctx, `INSERT INTO messages (id, conversation_id, role, content)
		VALUES ('reply-1', 'conv-1', 'assistant', 'a reply'), ('error-1', 'conv-1', 'error', 'a failure')`)
	require.NoError(t, err)
	refusalsWith(t, app, map[string]string{
		"outbox row of a reply":            `INSERT INTO agent_outbox (conversation_id, message_id) VALUES ('conv-1', 'reply-1')`,
		"outbox row of an error message":   `INSERT INTO agent_outbox (conversation_id, message_id) VALUES ('conv-1', 'error-1')`,
		"outbox row of a reply via select": `INSERT INTO agent_outbox (conversation_id, message_id) SELECT conversation_id, id FROM messages WHERE role <> 'user'`,
	}, requireConversationMismatch)
	refusalsWith(t, app, map[string]string{
		"outbox row naming its message's role": `INSERT INTO agent_outbox (conversation_id, message_id, message_role) VALUES ('conv-1', 'reply-1', 'assistant')`,
	}, requireDenied)
}

func TestRolesWorker(t *testing.T) {
	t.Parallel()
	db, rs := setupRoles(t)
	db.AllowPrivilegeErrors() // it requires the roles' refusals
	ctx := context.Background()
	app := rs.pool(t, roleApp)
	p := newProducer(t)
	for _, c := range []string{"works", "fails", "lost"} {
		_, err := p.CreateConversation(ctx, app, c)
		require.NoError(t, err)
	}
	for _, m := range []producer.Message{
		{ConversationID: "works", ID: "w1", Content: "hello"},
		{ConversationID: "fails", ID: "f1", Content: "hello"},
		{ConversationID: "lost", ID: "l1", Content: "hello"},
	} {
		_, err := p.Send(ctx, app, m)
		require.NoError(t, err)
	}
	// "lost" was claimed by a worker that died: its lease expired, so the worker recovers it
	// at start and runs it again.
	_, err := db.Pool.Exec(ctx, `WITH o AS (
			UPDATE agent_outbox SET status = 'processing', attempts = 1, run_id = gen_random_uuid(),
				lease_expires_at = now() - interval '1 minute'
			WHERE message_id = 'l1' RETURNING id, conversation_id, run_id)
		INSERT INTO agent_runs (run_id, conversation_id, outbox_ids, worker)
		SELECT run_id, conversation_id, ARRAY[id], 'dead' FROM o`)
	require.NoError(t, err)

	worker := rs.pool(t, roleWorker)
	var replication bool
	require.NoError(t, worker.QueryRow(ctx, `SELECT rolreplication OR rolsuper FROM pg_roles WHERE rolname = current_user`).Scan(&replication))
	require.False(t, replication, "the worker runs without REPLICATION (pg_logical_emit_message needs none)")
	startWorker(t, worker)

	want := map[string][2]string{"w1": {"done", "assistant"}, "f1": {"error", "error"}, "l1": {"done", "assistant"}}
	require.EventuallyWithT(t, func(c *assert.CollectT) {
		for id, w := range want {
			status, role, err := outboxState(db.Pool, id)
			assert.NoError(c, err)
			assert.Equal(c, w[0], status, "outbox row of %s", id)
			assert.Equal(c, w[1], role, "reply to %s", id)
		}
	}, 30*time.Second, 20*time.Millisecond)

	var ops, runs int
	require.NoError(t, db.Pool.QueryRow(ctx, `SELECT count(*) FROM operations WHERE message_id IS NOT NULL AND status = 'done'`).Scan(&ops))
	require.GreaterOrEqual(t, ops, 2, "operations are attached to the replies")
	require.NoError(t, db.Pool.QueryRow(ctx, `SELECT count(*) FROM agent_runs WHERE outcome = 'recovered'`).Scan(&runs))
	require.Equal(t, 1, runs, "the dead run was recovered")
	var unread int
	require.NoError(t, db.Pool.QueryRow(ctx, `SELECT unread_count FROM conversations WHERE id = 'works'`).Scan(&unread))
	require.Equal(t, 1, unread)

	refusals(t, worker, map[string]string{
		"drop table":             `DROP TABLE conversations`,
		"delete conversations":   `DELETE FROM conversations`,
		"delete outbox":          `DELETE FROM agent_outbox`,
		"delete messages":        `DELETE FROM messages`,
		"truncate":               `TRUNCATE operations`,
		"update message content": `UPDATE messages SET content = 'changed'`,
		"move outbox row":        `UPDATE agent_outbox SET message_id = 'w1'`,
		"rename conversation":    `UPDATE conversations SET id = 'x'`,
		"relay slots":            `SELECT * FROM baton_relay_slots`,
		"alter table":            `ALTER TABLE agent_outbox ADD COLUMN x int`,
		"create table":           `CREATE TABLE worker_table (id int)`,
		"create index":           `CREATE INDEX worker_index ON agent_outbox (last_error)`,
		"create view":            `CREATE VIEW worker_view AS SELECT 1 AS x`,
		"create function":        `CREATE FUNCTION worker_fn() RETURNS int LANGUAGE sql AS 'SELECT 1'`,
		"replace baton_fence":    `CREATE OR REPLACE FUNCTION baton_fence(ok boolean, what text) RETURNS boolean LANGUAGE sql AS 'SELECT true'`,
		"drop function":          `DROP FUNCTION baton_fence(boolean, text)`,
		"create trigger":         `CREATE TRIGGER worker_trigger BEFORE INSERT ON messages FOR EACH ROW EXECUTE FUNCTION suppress_redundant_updates_trigger()`,
		"create policy":          `CREATE POLICY worker_policy ON messages FOR INSERT WITH CHECK (true)`,
		"disable row security":   `ALTER TABLE messages DISABLE ROW LEVEL SECURITY`,
		"alter publication":      `ALTER PUBLICATION baton DROP TABLE messages`,
		"create schema":          `CREATE SCHEMA worker_schema`,
		"insert outbox row":      `INSERT INTO agent_outbox (conversation_id, message_id) VALUES ('works', 'w1')`,
	})
	refusalsWith(t, worker, map[string]string{
		"insert user message": `INSERT INTO messages (id, conversation_id, role, content) VALUES ('u', 'works', 'user', 'x')`,
	}, requireRowSecurity)
}

func TestRolesRelay(t *testing.T) {
	t.Parallel()
	db, rs := setupRoles(t)
	db.AllowPrivilegeErrors() // it requires the roles' refusals
	ctx := context.Background()
	app := rs.pool(t, roleApp)
	p := newProducer(t)
	_, err := p.CreateConversation(ctx, app, "conv-1")
	require.NoError(t, err)
	// One row from before the relay's first start, published by its backfill.
	_, err = p.Send(ctx, app, producer.Message{ConversationID: "conv-1", ID: "before", Content: "hello"})
	require.NoError(t, err)

	ns := testsvc.StartNATS(t)
	nc, err := nats.Connect(ns.URL())
	require.NoError(t, err)
	t.Cleanup(nc.Close)
	prefix := "deploy_" + db.Name // unique also on a shared BATON_TEST_NATS_URL server
	slot := db.Name
	r, err := relay.New(relay.Config{DatabaseURL: rs.url(t, roleRelay), NATS: nc, Slot: slot, SubjectPrefix: prefix})
	require.NoError(t, err)
	rctx, cancel := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- r.Run(rctx) }()
	t.Cleanup(func() {
		cancel()
		select {
		case err := <-done:
			if err != nil {
				t.Errorf("relay: %v", err)
			}
		case <-time.After(30 * time.Second):
			t.Error("relay did not stop within 30s")
		}
	})
	deadline := time.Now().Add(30 * time.Second)
	for !r.Active() {
		select {
		case err := <-done:
			t.Fatalf("relay stopped: %v", err)
		case <-time.After(10 * time.Millisecond):
		}
		require.True(t, time.Now().Before(deadline), "the relay did not start streaming as baton_relay within 30s")
	}

	// One row streamed, and a reply (written as the worker writes it) as an outcome.
	_, err = p.Send(ctx, app, producer.Message{ConversationID: "conv-1", ID: "after", Content: "hello again"})
	require.NoError(t, err)
	worker := rs.pool(t, roleWorker)
	_, err = worker.Exec(ctx, `INSERT INTO messages (id, conversation_id, role, content) VALUES ('reply-1', 'conv-1', 'assistant', 'hi')`)
	require.NoError(t, err)

	js, err := jetstream.New(nc)
	require.NoError(t, err)
	count := func(kind string) uint64 {
		s, err := js.Stream(ctx, wire.StreamName(prefix, kind))
		if err != nil {
			return 0
		}
		n, err := wire.StreamEvents(ctx, s, prefix, kind)
		if err != nil {
			return 0
		}
		return n
	}
	require.Eventually(t, func() bool { return count(wire.KindTurns) == 2 && count(wire.KindOutcomes) == 1 },
		30*time.Second, 20*time.Millisecond, "turns and outcomes published by the relay role")

	var backfilled int64
	require.NoError(t, db.Pool.QueryRow(ctx, `SELECT backfill_rows FROM baton_relay_slots WHERE slot_name = $1`, slot).Scan(&backfilled))
	require.EqualValues(t, 1, backfilled)

	relayPool := rs.pool(t, roleRelay)
	var n int
	require.NoError(t, relayPool.QueryRow(ctx, `SELECT count(*) FROM agent_outbox`).Scan(&n))
	require.Equal(t, 2, n)
	refusals(t, relayPool, map[string]string{
		"select messages":      `SELECT id FROM messages`,
		"select content":       `SELECT content FROM messages`,
		"count messages":       `SELECT count(*) FROM messages`,
		"outbox last_error":    `SELECT last_error FROM agent_outbox`,
		"outbox whole rows":    `SELECT * FROM agent_outbox`,
		"select conversations": `SELECT * FROM conversations`,
		"update outbox":        `UPDATE agent_outbox SET status = 'done'`,
		"delete outbox":        `DELETE FROM agent_outbox`,
		"insert message":       `INSERT INTO messages (id, conversation_id, role, content) VALUES ('r', 'conv-1', 'assistant', 'x')`,
		"insert conversation":  `INSERT INTO conversations (id) VALUES ('r')`,
		"insert outbox row":    `INSERT INTO agent_outbox (conversation_id, message_id) VALUES ('conv-1', 'before')`,
		"delete slots":         `DELETE FROM baton_relay_slots`,
		"select operations":    `SELECT * FROM operations`,
		"drop table":           `DROP TABLE baton_relay_slots`,
	})
}

func TestRolesMigrator(t *testing.T) {
	t.Parallel()
	db, rs := setupRoles(t)
	db.AllowPrivilegeErrors() // it requires the roles' refusals
	ctx := context.Background()

	// The schema now belongs to the migrator, which the superuser created it as.
	var owner string
	require.NoError(t, db.Pool.QueryRow(ctx, `SELECT tableowner FROM pg_tables WHERE tablename = 'agent_outbox'`).Scan(&owner))
	require.Equal(t, rs.name(roleMigrator), owner)
	require.NoError(t, db.Pool.QueryRow(ctx, `SELECT pg_get_userbyid(pubowner) FROM pg_publication WHERE pubname = 'baton'`).Scan(&owner))
	require.Equal(t, rs.name(roleMigrator), owner)

	conn, err := pgx.Connect(ctx, rs.url(t, roleMigrator))
	require.NoError(t, err)
	t.Cleanup(func() { _ = conn.Close(context.Background()) })
	applied, err := migrations.Up(ctx, conn)
	require.NoError(t, err)
	require.Empty(t, applied)

	// What a future migration does: change tables, add some, change the publication.
	tx, err := conn.Begin(ctx)
	require.NoError(t, err)
	for _, stmt := range []string{
		`ALTER TABLE agent_outbox ADD COLUMN priority int NOT NULL DEFAULT 0`,
		`CREATE TABLE baton_future (id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY)`,
		`ALTER PUBLICATION baton ADD TABLE baton_future`,
		`CREATE PUBLICATION baton_other FOR TABLE baton_future`,
	} {
		_, err := tx.Exec(ctx, stmt)
		require.NoError(t, err, stmt)
	}
	require.NoError(t, tx.Rollback(ctx))

	// The owner bypasses privileges and row-level security, not the foreign key that ties an
	// outbox row's conversation to its message's.
	_, err = conn.Exec(ctx, `INSERT INTO conversations (id) VALUES ('a'), ('b');
		INSERT INTO messages (id, conversation_id, role, content) VALUES ('m1', 'a', 'user', 'x')`)
	require.NoError(t, err)
	_, err = conn.Exec(ctx, `INSERT INTO agent_outbox (conversation_id, message_id) VALUES ('b', 'm1')`)
	requireConversationMismatch(t, err, "the migrator's outbox row of another conversation")

	for what, stmt := range map[string]string{
		"create role":  `CREATE ROLE intruder`,
		"alter system": `ALTER SYSTEM SET wal_level = minimal`,
	} {
		_, err := conn.Exec(ctx, stmt)
		requireDenied(t, err, what)
	}
	var super, replication bool
	require.NoError(t, conn.QueryRow(ctx, `SELECT rolsuper, rolreplication FROM pg_roles WHERE rolname = current_user`).
		Scan(&super, &replication))
	require.False(t, super)
	require.False(t, replication)
}

// TestRolesMigratorUpgrades: on a schema roles.sql was applied to (owned by the migrator,
// row-level security on messages), the migrator applies a new version, here version 7, and
// roles.sql then grants as before.
func TestRolesMigratorUpgrades(t *testing.T) {
	t.Parallel()
	db, rs := setupRoles(t)
	ctx := context.Background()
	want := privilegeState(t, db.Pool)
	// Back to version 6, as the admin.
	_, err := db.Pool.Exec(ctx, `
		ALTER TABLE agent_outbox DROP CONSTRAINT agent_outbox_user_message_fkey;
		ALTER TABLE messages DROP CONSTRAINT messages_conversation_id_id_role_key;
		ALTER TABLE agent_outbox DROP COLUMN message_role;
		ALTER TABLE agent_outbox ADD CONSTRAINT agent_outbox_message_id_fkey
			FOREIGN KEY (message_id) REFERENCES messages (id) ON DELETE CASCADE;
		DELETE FROM baton_schema_migrations WHERE version = 7`)
	require.NoError(t, err)
	p := newProducer(t)
	app := rs.pool(t, roleApp)
	_, err = p.CreateConversation(ctx, app, "conv-1")
	require.NoError(t, err)
	_, err = p.Send(ctx, app, producer.Message{ConversationID: "conv-1", ID: "m1", Content: "hello"})
	require.NoError(t, err)

	conn, err := pgx.Connect(ctx, rs.url(t, roleMigrator))
	require.NoError(t, err)
	applied, err := migrations.Up(ctx, conn)
	require.NoError(t, conn.Close(ctx))
	require.NoError(t, err)
	require.Equal(t, []int{7}, applied)
	rs.apply(t)
	require.Equal(t, want, privilegeState(t, db.Pool))

	_, err = p.CreateConversation(ctx, app, "conv-2")
	require.NoError(t, err)
	_, err = app.Exec(ctx, `INSERT INTO messages (id, conversation_id, role, content) VALUES ('m2', 'conv-1', 'user', 'x')`)
	require.NoError(t, err)
	_, err = app.Exec(ctx, `INSERT INTO agent_outbox (conversation_id, message_id) VALUES ('conv-2', 'm2')`)
	requireConversationMismatch(t, err, "after the upgrade")
}

// TestRolesConverge: roles.sql resets what it manages, so running it again undoes privileges
// and policies changed by hand since (or granted by an older roles.sql).
func TestRolesConverge(t *testing.T) {
	t.Parallel()
	db, rs := setupRoles(t)
	ctx := context.Background()
	want := privilegeState(t, db.Pool)
	var drift []string
	for _, r := range []string{roleApp, roleRelay, roleWorker, roleConsole} {
		name := pgx.Identifier{rs.name(r)}.Sanitize()
		drift = append(drift,
			`GRANT ALL ON ALL TABLES IN SCHEMA public TO `+name,
			`GRANT UPDATE (content) ON messages TO `+name)
	}
	drift = append(drift,
		`GRANT SELECT ON operations TO PUBLIC`,
		`GRANT CREATE ON SCHEMA public TO PUBLIC`,
		`ALTER TABLE messages DISABLE ROW LEVEL SECURITY`,
		`ALTER POLICY messages_app_insert ON messages WITH CHECK (true)`,
		`DROP POLICY messages_worker_select ON messages`)
	for _, stmt := range drift {
		_, err := db.Pool.Exec(ctx, stmt)
		require.NoError(t, err, stmt)
	}
	require.NotEqual(t, want, privilegeState(t, db.Pool))
	rs.apply(t)
	require.Equal(t, want, privilegeState(t, db.Pool))
}

// TestRolesFirstInstall follows a first install on an empty database: roles.sql creates the
// roles (and skips the grants: there are no tables yet), the migrator applies the schema,
// roles.sql grants, and the app sends.
func TestRolesFirstInstall(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	host := testsvc.NewDatabase(t)
	name := host.Name + "_empty"
	u, err := url.Parse(host.URL)
	require.NoError(t, err)
	u.Path = "/" + name
	rs := newRoleSet(t, host, u.String())
	// Registered after newRoleSet, so it runs before the roles are dropped.
	_, err = host.Pool.Exec(ctx, "CREATE DATABASE "+pgx.Identifier{name}.Sanitize()+" TEMPLATE template0")
	require.NoError(t, err)
	t.Cleanup(func() {
		_, err := host.Pool.Exec(context.Background(), "DROP DATABASE IF EXISTS "+pgx.Identifier{name}.Sanitize()+" WITH (FORCE)")
		if err != nil {
			t.Errorf("drop %s: %v", name, err)
		}
	})

	rs.apply(t) // no schema: roles and schema privileges only
	conn, err := pgx.Connect(ctx, rs.url(t, roleMigrator))
	require.NoError(t, err)
	applied, err := migrations.Up(ctx, conn)
	require.NoError(t, conn.Close(ctx))
	require.NoError(t, err)
	require.Len(t, applied, migrations.Latest())

	app := rs.pool(t, roleApp)
	p := newProducer(t)
	_, err = p.CreateConversation(ctx, app, "conv-1")
	requireDenied(t, err, "create conversation before the grants")

	rs.apply(t)
	_, err = p.CreateConversation(ctx, app, "conv-1")
	require.NoError(t, err)
	_, err = p.Send(ctx, app, producer.Message{ConversationID: "conv-1", ID: "m1", Content: "hello"})
	require.NoError(t, err)
}

// TestRolesPartialSchema: roles.sql refuses to grant on a schema that is only partly there,
// saying what to do.
func TestRolesPartialSchema(t *testing.T) {
	t.Parallel()
	db := testsvc.NewDatabase(t)
	rs := newRoleSet(t, db, db.URL)
	_, err := db.Pool.Exec(context.Background(), `DROP TABLE agent_runs`)
	require.NoError(t, err)
	_, err = db.Pool.Exec(context.Background(), rs.sql)
	require.ErrorContains(t, err, "run `baton migrate` first")
	require.ErrorContains(t, err, "agent_runs")
}
