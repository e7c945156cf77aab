package migrations_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/batonhq/baton/internal/testsvc"
	"github.com/batonhq/baton/migrations"
)

// requireMismatchRefused requires err to be the foreign key that ties an outbox row's
// conversation to its message's.
func requireMismatchRefused(t *testing.T, err error, what string) {
	t.Helper()
	var pgErr *pgconn.PgError
	require.True(t, errors.As(err, &pgErr), "%s: want a foreign key violation, got %v", what, err)
	require.Equal(t, "23503", pgErr.Code, "%s: %v", what, err)
	require.Equal(t, "agent_outbox_user_message_fkey", pgErr.ConstraintName, what)
}

// outboxKeys returns agent_outbox's foreign keys to messages and whether each is validated.
func outboxKeys(ctx context.Context, t *testing.T, pool *pgxpool.Pool) map[string]bool {
	t.Helper()
	rows, err := pool.Query(ctx, `SELECT conname::text, convalidated FROM pg_constraint
		WHERE contype = 'f' AND conrelid = 'agent_outbox'::regclass AND confrelid = 'messages'::regclass
		  AND conname <> 'agent_outbox_reply_id_fkey'`)
	require.NoError(t, err)
	keys := map[string]bool{}
	for rows.Next() {
		var name string
		var ok bool
		require.NoError(t, rows.Scan(&name, &ok))
		keys[name] = ok
	}
	require.NoError(t, rows.Err())
	return keys
}

// An outbox row names a turn of its conversation: its message must be a user message of that
// conversation, whoever writes it (here the superuser, whom no privilege or policy stops), on
// insert and on update. Deleting the message still deletes its outbox row.
func TestOutboxConversationMustMatchMessage(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	db := testsvc.NewDatabase(t)
	require.Equal(t, map[string]bool{"agent_outbox_user_message_fkey": true}, outboxKeys(ctx, t, db.Pool),
		"the composite key is validated and replaces the key on message_id")
	_, err := db.Pool.Exec(ctx, `INSERT INTO conversations (id) VALUES ('a'), ('b');
		INSERT INTO messages (id, conversation_id, role, content) VALUES ('m1', 'a', 'user', 'x'), ('m2', 'a', 'user', 'y')`)
	require.NoError(t, err)

	_, err = db.Pool.Exec(ctx, `INSERT INTO agent_outbox (conversation_id, message_id) VALUES ('b', 'm1')`)
	requireMismatchRefused(t, err, "insert naming another conversation's message")
	_, err = db.Pool.Exec(ctx, `WITH m AS (INSERT INTO messages (id, conversation_id, role, content) VALUES ('m3', 'a', 'user', 'z') RETURNING id)
		INSERT INTO agent_outbox (conversation_id, message_id) SELECT 'b', id FROM m`)
	requireMismatchRefused(t, err, "message and outbox row in one statement")

	_, err = db.Pool.Exec(ctx, `INSERT INTO messages (id, conversation_id, role, content) VALUES ('r1', 'a', 'assistant', 'r'), ('e1', 'a', 'error', 'e')`)
	require.NoError(t, err)
	_, err = db.Pool.Exec(ctx, `INSERT INTO agent_outbox (conversation_id, message_id) VALUES ('a', 'r1')`)
	requireMismatchRefused(t, err, "insert naming a reply")
	_, err = db.Pool.Exec(ctx, `INSERT INTO agent_outbox (conversation_id, message_id) VALUES ('a', 'e1')`)
	requireMismatchRefused(t, err, "insert naming an error message")
	_, err = db.Pool.Exec(ctx, `INSERT INTO agent_outbox (conversation_id, message_id, message_role) VALUES ('a', 'r1', 'assistant')`)
	var pgErr *pgconn.PgError
	require.ErrorAs(t, err, &pgErr, "an outbox row's message_role is always user")
	require.Equal(t, "23514", pgErr.Code, "%v", err)

	_, err = db.Pool.Exec(ctx, `INSERT INTO agent_outbox (conversation_id, message_id) VALUES ('a', 'm1'), ('a', 'm2')`)
	require.NoError(t, err)
	_, err = db.Pool.Exec(ctx, `UPDATE messages SET role = 'assistant' WHERE id = 'm1'`)
	requireMismatchRefused(t, err, "turning a queued user message into a reply")
	_, err = db.Pool.Exec(ctx, `UPDATE agent_outbox SET conversation_id = 'b' WHERE message_id = 'm1'`)
	requireMismatchRefused(t, err, "moving an outbox row to another conversation")
	_, err = db.Pool.Exec(ctx, `UPDATE agent_outbox SET message_id = 'm2' WHERE message_id = 'm1'`)
	require.Error(t, err, "message_id stays unique")

	_, err = db.Pool.Exec(ctx, `DELETE FROM messages WHERE id = 'm1'`)
	require.NoError(t, err)
	var n int
	require.NoError(t, db.Pool.QueryRow(ctx, `SELECT count(*) FROM agent_outbox`).Scan(&n))
	require.Equal(t, 1, n, "deleting a message deletes its outbox row")
}

// Outbox rows written before version 7 that name another conversation's message do not make
// `baton migrate` fail: the new key is then left NOT VALID (new writes are still checked) and
// the key on message_id is kept, instead of deleting anyone's rows.
func TestOutboxConversationMigrationKeepsExistingRows(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	db := testsvc.NewDatabase(t)
	// Undo version 7 as if it had never run, then write what an older schema allowed.
	_, err := db.Pool.Exec(ctx, `
		ALTER TABLE agent_outbox DROP CONSTRAINT agent_outbox_user_message_fkey;
		ALTER TABLE messages DROP CONSTRAINT messages_conversation_id_id_role_key;
		ALTER TABLE agent_outbox DROP COLUMN message_role;
		ALTER TABLE agent_outbox ADD CONSTRAINT agent_outbox_message_id_fkey
			FOREIGN KEY (message_id) REFERENCES messages (id) ON DELETE CASCADE;
		DELETE FROM baton_schema_migrations WHERE version = 7;
		INSERT INTO conversations (id) VALUES ('a'), ('b');
		INSERT INTO messages (id, conversation_id, role, content) VALUES ('old', 'a', 'user', 'x'), ('new', 'a', 'user', 'y');
		INSERT INTO agent_outbox (conversation_id, message_id) VALUES ('b', 'old')`)
	require.NoError(t, err)

	applied, err := migrations.Up(ctx, db.Pool)
	require.NoError(t, err)
	require.Equal(t, []int{7}, applied)
	require.Equal(t, map[string]bool{"agent_outbox_user_message_fkey": false, "agent_outbox_message_id_fkey": true},
		outboxKeys(ctx, t, db.Pool))
	var conv string
	require.NoError(t, db.Pool.QueryRow(ctx, `SELECT conversation_id FROM agent_outbox WHERE message_id = 'old'`).Scan(&conv))
	require.Equal(t, "b", conv, "the existing row is left as it was")
	_, err = db.Pool.Exec(ctx, `INSERT INTO agent_outbox (conversation_id, message_id) VALUES ('b', 'new')`)
	requireMismatchRefused(t, err, "a new row naming another conversation's message")

	// Fixed as the migration's comment says, the key validates.
	_, err = db.Pool.Exec(ctx, `UPDATE agent_outbox SET conversation_id = 'a' WHERE message_id = 'old';
		ALTER TABLE agent_outbox VALIDATE CONSTRAINT agent_outbox_user_message_fkey;
		ALTER TABLE agent_outbox DROP CONSTRAINT agent_outbox_message_id_fkey`)
	require.NoError(t, err)
	require.Equal(t, map[string]bool{"agent_outbox_user_message_fkey": true}, outboxKeys(ctx, t, db.Pool))
}
