package migrations_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgconn"
	"github.com/stretchr/testify/require"

	"github.com/batonhq/baton/internal/testsvc"
	"github.com/batonhq/baton/migrations"
)

// An infinite created_at cannot be published (it is no instant; JSON has no form for it), so
// the schema refuses it when it is written, with an error that names the rule.
func TestInfiniteCreatedAtIsRefused(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	db := testsvc.NewDatabase(t)
	_, err := db.Pool.Exec(ctx, `INSERT INTO conversations (id) VALUES ('c')`)
	require.NoError(t, err)

	for name, stmt := range map[string]string{
		"message infinity":  `INSERT INTO messages (id, conversation_id, role, content, created_at) VALUES ('m1', 'c', 'user', 'x', 'infinity')`,
		"message -infinity": `INSERT INTO messages (id, conversation_id, role, content, created_at) VALUES ('m1', 'c', 'user', 'x', '-infinity')`,
		"outbox infinity": `WITH m AS (INSERT INTO messages (id, conversation_id, role, content) VALUES ('m2', 'c', 'user', 'x') RETURNING id)
			INSERT INTO agent_outbox (conversation_id, message_id, created_at) SELECT 'c', id, 'infinity' FROM m`,
		"outbox update": `UPDATE agent_outbox SET created_at = 'infinity'`,
	} {
		if name == "outbox update" {
			_, err := db.Pool.Exec(ctx, `WITH m AS (INSERT INTO messages (id, conversation_id, role, content) VALUES ('m3', 'c', 'user', 'x') RETURNING id)
				INSERT INTO agent_outbox (conversation_id, message_id) SELECT 'c', id FROM m`)
			require.NoError(t, err)
		}
		_, err := db.Pool.Exec(ctx, stmt)
		var pgErr *pgconn.PgError
		require.True(t, errors.As(err, &pgErr), "%s: want a check violation, got %v", name, err)
		require.Equal(t, "23514", pgErr.Code, "%s: %v", name, err)
		require.Contains(t, pgErr.ConstraintName, "created_at_finite", name)
	}
}

// Rows written before the rule existed do not make `baton migrate` fail: the constraint is then
// left NOT VALID (new writes are still checked) instead of rewriting anyone's data.
func TestFiniteCreatedAtMigrationKeepsExistingRows(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	db := testsvc.NewDatabase(t)
	// Undo version 5 as if it had never run, then write what an older schema allowed.
	_, err := db.Pool.Exec(ctx, `
		ALTER TABLE messages DROP CONSTRAINT messages_created_at_finite;
		ALTER TABLE agent_outbox DROP CONSTRAINT agent_outbox_created_at_finite;
		DELETE FROM baton_schema_migrations WHERE version = 5;
		INSERT INTO conversations (id) VALUES ('c');
		INSERT INTO messages (id, conversation_id, role, content, created_at) VALUES ('old', 'c', 'user', 'x', '-infinity')`)
	require.NoError(t, err)

	applied, err := migrations.Up(ctx, db.Pool)
	require.NoError(t, err)
	require.Contains(t, applied, 5)
	var validated map[string]bool
	rows, err := db.Pool.Query(ctx, `SELECT conname::text, convalidated FROM pg_constraint WHERE conname LIKE '%created_at_finite'`)
	require.NoError(t, err)
	validated = map[string]bool{}
	for rows.Next() {
		var name string
		var ok bool
		require.NoError(t, rows.Scan(&name, &ok))
		validated[name] = ok
	}
	require.NoError(t, rows.Err())
	require.Equal(t, map[string]bool{"messages_created_at_finite": false, "agent_outbox_created_at_finite": true}, validated)

	var n int
	require.NoError(t, db.Pool.QueryRow(ctx, `SELECT count(*) FROM messages WHERE created_at = '-infinity'`).Scan(&n))
	require.Equal(t, 1, n, "the existing row is left as it was")
	_, err = db.Pool.Exec(ctx, `INSERT INTO messages (id, conversation_id, role, content, created_at) VALUES ('new', 'c', 'user', 'x', 'infinity')`)
	var pgErr *pgconn.PgError
	require.True(t, errors.As(err, &pgErr), "a new infinite row is refused: %v", err)
	require.Equal(t, "23514", pgErr.Code)
}
