package producer_test

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"reflect"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/batonhq/baton/internal/testsvc"
	"github.com/batonhq/baton/producer"
)

// The handles the package documents as DBs.
var (
	_ producer.DB = (*pgxpool.Pool)(nil)
	_ producer.DB = (*pgx.Conn)(nil)
	_ producer.DB = (*pgxpool.Conn)(nil)
)

// bundle is a test's database and producer. The producer sends as roles.sql's app role, as
// deployed (app); db.Pool is the owner's, for setting up and observing.
type bundle struct {
	ctx context.Context
	db  *testsvc.Database
	app *pgxpool.Pool
	p   *producer.Producer
}

func setup(t *testing.T) *bundle {
	t.Helper()
	ctx, cancel := context.WithTimeout(t.Context(), 2*time.Minute)
	t.Cleanup(cancel)
	p, err := producer.New(producer.Config{})
	require.NoError(t, err)
	db := testsvc.NewDatabase(t)
	return &bundle{ctx: ctx, db: db, app: db.RolePool(t, testsvc.RoleApp), p: p}
}

func (b *bundle) conversation(t *testing.T, id string) {
	t.Helper()
	created, err := b.p.CreateConversation(b.ctx, b.app, id)
	require.NoError(t, err)
	require.True(t, created)
}

func (b *bundle) exec(t *testing.T, sql string, args ...any) {
	t.Helper()
	_, err := b.db.Pool.Exec(b.ctx, sql, args...)
	require.NoError(t, err)
}

// rows counts messages and outbox rows.
func (b *bundle) rows(t *testing.T) (messages, outbox int) {
	t.Helper()
	require.NoError(t, b.db.Pool.QueryRow(b.ctx,
		`SELECT (SELECT count(*) FROM messages), (SELECT count(*) FROM agent_outbox)`).Scan(&messages, &outbox))
	return messages, outbox
}

func (b *bundle) requireRows(t *testing.T, messages, outbox int) {
	t.Helper()
	m, o := b.rows(t)
	require.Equal(t, messages, m, "messages")
	require.Equal(t, outbox, o, "outbox rows")
}

// waitForLockWaiters waits until n backends of the test database wait for a lock.
func (b *bundle) waitForLockWaiters(t *testing.T, n int) {
	t.Helper()
	require.Eventually(t, func() bool {
		var waiting int
		err := b.db.Pool.QueryRow(b.ctx, `SELECT count(*) FROM pg_stat_activity
			WHERE datname = current_database() AND wait_event_type = 'Lock'`).Scan(&waiting)
		return err == nil && waiting >= n
	}, 10*time.Second, 5*time.Millisecond)
}

func msg(conv, id, content string) producer.Message {
	return producer.Message{ConversationID: conv, ID: id, Content: content}
}

func TestSendWritesMessageAndPendingOutboxRow(t *testing.T) {
	t.Parallel()
	b := setup(t)
	b.conversation(t, "c1")

	res, err := b.p.Send(b.ctx, b.app, msg("c1", "m1", "hello"))
	require.NoError(t, err)
	require.False(t, res.AlreadyAccepted)
	require.Positive(t, res.OutboxID)
	require.False(t, res.CreatedAt.IsZero())

	var role, content, conv string
	require.NoError(t, b.db.Pool.QueryRow(b.ctx,
		`SELECT role, content, conversation_id FROM messages WHERE id = 'm1'`).Scan(&role, &content, &conv))
	require.Equal(t, "user", role)
	require.Equal(t, "hello", content)
	require.Equal(t, "c1", conv)

	// Callers cannot choose queue fields: the row is the schema's default.
	var (
		id                  int64
		outboxConv, status  string
		attempts            int
		createdAt           time.Time
		claimOrResultIsNull bool
	)
	require.NoError(t, b.db.Pool.QueryRow(b.ctx, `SELECT id, conversation_id, status, attempts, created_at,
			processed_at IS NULL AND run_id IS NULL AND lease_expires_at IS NULL
			AND reply_id IS NULL AND last_error IS NULL
		FROM agent_outbox WHERE message_id = 'm1'`).
		Scan(&id, &outboxConv, &status, &attempts, &createdAt, &claimOrResultIsNull))
	require.Equal(t, res.OutboxID, id)
	require.Equal(t, "c1", outboxConv)
	require.Equal(t, "pending", status)
	require.Zero(t, attempts)
	require.True(t, claimOrResultIsNull)
	require.True(t, res.CreatedAt.Equal(createdAt))
	b.requireRows(t, 1, 1)
}

// Message must never grow a field that lets callers set status, attempts or claims: the
// outbox row's queue state belongs to workers.
func TestMessageHasNoQueueFields(t *testing.T) {
	t.Parallel()
	var fields []string
	for f := range reflect.TypeFor[producer.Message]().Fields() {
		fields = append(fields, f.Name)
	}
	require.Equal(t, []string{"ConversationID", "ID", "Content"}, fields)
}

func TestSendRetryWithSameIDIsNoop(t *testing.T) {
	t.Parallel()
	b := setup(t)
	b.conversation(t, "c1")

	first, err := b.p.Send(b.ctx, b.app, msg("c1", "m1", "hello"))
	require.NoError(t, err)
	second, err := b.p.Send(b.ctx, b.app, msg("c1", "m1", "hello"))
	require.NoError(t, err)
	require.True(t, second.AlreadyAccepted)
	require.Equal(t, first.OutboxID, second.OutboxID)
	require.True(t, first.CreatedAt.Equal(second.CreatedAt))
	b.requireRows(t, 1, 1)

	// A retry inside a transaction, even one that wrote the message itself, is a no-op too.
	tx, err := b.app.Begin(b.ctx)
	require.NoError(t, err)
	defer func() { _ = tx.Rollback(b.ctx) }()
	third, err := b.p.SendTx(b.ctx, tx, msg("c1", "m1", "hello"))
	require.NoError(t, err)
	require.True(t, third.AlreadyAccepted)
	require.Equal(t, first.OutboxID, third.OutboxID)
	_, err = b.p.SendTx(b.ctx, tx, msg("c1", "m2", "again"))
	require.NoError(t, err)
	fourth, err := b.p.SendTx(b.ctx, tx, msg("c1", "m2", "again"))
	require.NoError(t, err)
	require.True(t, fourth.AlreadyAccepted)
	// A conflict runs no failing statement, so the transaction stays usable.
	_, err = b.p.SendTx(b.ctx, tx, msg("c1", "m2", "other"))
	require.ErrorIs(t, err, producer.ErrConflict)
	require.NoError(t, tx.Commit(b.ctx))
	b.requireRows(t, 2, 2)
}

// Fifty clients retrying one message id at once, at READ COMMITTED, create one message and
// one outbox row; none of them fails and exactly one reports a new write.
func TestSendConcurrentRetriesCreateOneRow(t *testing.T) {
	t.Parallel()
	b := setup(t)
	b.conversation(t, "c1")
	var isolation string
	require.NoError(t, b.db.Pool.QueryRow(b.ctx, "SHOW default_transaction_isolation").Scan(&isolation))
	require.Equal(t, "read committed", isolation)

	const clients = 50
	cfg, err := pgxpool.ParseConfig(b.db.URL)
	require.NoError(t, err)
	cfg.MaxConns = clients
	pool, err := pgxpool.NewWithConfig(b.ctx, cfg)
	require.NoError(t, err)
	defer pool.Close()
	// Open every connection first so the sends start together.
	conns := make([]*pgxpool.Conn, clients)
	for i := range conns {
		conns[i], err = pool.Acquire(b.ctx)
		require.NoError(t, err)
	}

	var (
		wg      sync.WaitGroup
		start   = make(chan struct{})
		results = make([]producer.Result, clients)
		errs    = make([]error, clients)
	)
	for i, conn := range conns {
		wg.Go(func() {
			defer conn.Release()
			<-start
			results[i], errs[i] = b.p.Send(b.ctx, conn, msg("c1", "same-id", "hello"))
		})
	}
	close(start)
	wg.Wait()

	fresh := 0
	for i := range clients {
		require.NoError(t, errs[i], "client %d", i)
		require.Equal(t, results[0].OutboxID, results[i].OutboxID, "client %d", i)
		if !results[i].AlreadyAccepted {
			fresh++
		}
	}
	require.Equal(t, 1, fresh, "exactly one client writes")
	b.requireRows(t, 1, 1)
}

// A Send that races an uncommitted writer of the same id waits for it, then reports what that
// writer committed: this is the path where the row is newer than the statement's snapshot.
func TestSendWaitsForConcurrentWriterOfSameID(t *testing.T) {
	t.Parallel()
	cases := []struct {
		name     string
		first    producer.Message
		commit   bool
		wantErr  error
		accepted bool
	}{
		{name: "committed same message", first: msg("c1", "m1", "hello"), commit: true, accepted: true},
		{name: "committed other content", first: msg("c1", "m1", "bye"), commit: true, wantErr: producer.ErrConflict},
		{name: "committed other conversation", first: msg("c2", "m1", "hello"), commit: true, wantErr: producer.ErrConflict},
		{name: "rolled back", first: msg("c1", "m1", "hello"), commit: false, accepted: false},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			b := setup(t)
			b.conversation(t, "c1")
			b.conversation(t, "c2")

			tx, err := b.app.Begin(b.ctx)
			require.NoError(t, err)
			defer func() { _ = tx.Rollback(b.ctx) }()
			first, err := b.p.SendTx(b.ctx, tx, tc.first)
			require.NoError(t, err)

			type outcome struct {
				res producer.Result
				err error
			}
			done := make(chan outcome, 1)
			go func() {
				res, err := b.p.Send(b.ctx, b.app, msg("c1", "m1", "hello"))
				done <- outcome{res, err}
			}()
			b.waitForLockWaiters(t, 1)
			if tc.commit {
				require.NoError(t, tx.Commit(b.ctx))
			} else {
				require.NoError(t, tx.Rollback(b.ctx))
			}

			var got outcome
			select {
			case got = <-done:
			case <-time.After(10 * time.Second):
				t.Fatal("Send still blocked 10s after the other writer finished")
			}
			if tc.wantErr != nil {
				require.ErrorIs(t, got.err, tc.wantErr)
				b.requireRows(t, 1, 1)
				return
			}
			require.NoError(t, got.err)
			require.Equal(t, tc.accepted, got.res.AlreadyAccepted)
			if tc.accepted {
				require.Equal(t, first.OutboxID, got.res.OutboxID)
			}
			b.requireRows(t, 1, 1)
		})
	}
}

// At REPEATABLE READ a racing writer of the same id is a serialization failure, as SendTx
// documents: the caller retries the transaction.
func TestSendTxRepeatableReadRaceIsSerializationFailure(t *testing.T) {
	t.Parallel()
	b := setup(t)
	b.conversation(t, "c1")

	first, err := b.app.Begin(b.ctx)
	require.NoError(t, err)
	defer func() { _ = first.Rollback(b.ctx) }()
	_, err = b.p.SendTx(b.ctx, first, msg("c1", "m1", "hello"))
	require.NoError(t, err)

	second, err := b.app.BeginTx(b.ctx, pgx.TxOptions{IsoLevel: pgx.RepeatableRead})
	require.NoError(t, err)
	defer func() { _ = second.Rollback(b.ctx) }()
	_, err = second.Exec(b.ctx, "SELECT 1") // takes the snapshot
	require.NoError(t, err)
	done := make(chan error, 1)
	go func() {
		_, err := b.p.SendTx(b.ctx, second, msg("c1", "m1", "hello"))
		done <- err
	}()
	b.waitForLockWaiters(t, 1)
	require.NoError(t, first.Commit(b.ctx))
	select {
	case err = <-done:
	case <-time.After(10 * time.Second):
		t.Fatal("SendTx still blocked")
	}
	var pgErr *pgconn.PgError
	require.ErrorAs(t, err, &pgErr)
	require.Equal(t, "40001", pgErr.Code)
	require.NoError(t, second.Rollback(b.ctx))

	// Retried, the transaction sees the committed message.
	tx, err := b.app.BeginTx(b.ctx, pgx.TxOptions{IsoLevel: pgx.RepeatableRead})
	require.NoError(t, err)
	defer func() { _ = tx.Rollback(b.ctx) }()
	res, err := b.p.SendTx(b.ctx, tx, msg("c1", "m1", "hello"))
	require.NoError(t, err)
	require.True(t, res.AlreadyAccepted)
	require.NoError(t, tx.Commit(b.ctx))
	b.requireRows(t, 1, 1)
}

func TestSendSameIDDifferentMessageIsConflict(t *testing.T) {
	t.Parallel()
	b := setup(t)
	b.conversation(t, "c1")
	b.conversation(t, "c2")
	_, err := b.p.Send(b.ctx, b.app, msg("c1", "m1", "hello"))
	require.NoError(t, err)
	// Messages this package did not write: a reply, and a user message without outbox row.
	b.exec(t, `INSERT INTO messages (id, conversation_id, role, content) VALUES ('reply', 'c1', 'assistant', 'hi')`)
	b.exec(t, `INSERT INTO messages (id, conversation_id, role, content) VALUES ('bare', 'c1', 'user', 'hi')`)

	for _, m := range []producer.Message{
		msg("c1", "m1", "hello!"),  // other content
		msg("c1", "m1", "Hello"),   // content is compared exactly
		msg("c1", "m1", "hello\n"), // even one byte more
		msg("c2", "m1", "hello"),   // other conversation
		msg("c2", "m1", "hello!"),  // both
		msg("nope", "m1", "hello"), // a missing conversation: the taken id decides
		msg("c1", "reply", "hi"),   // not a user message
		msg("c1", "bare", "hi"),    // no outbox row: recreating it could start a second turn
	} {
		_, err := b.p.Send(b.ctx, b.app, m)
		require.ErrorIs(t, err, producer.ErrConflict, "%+v", m)
		require.Contains(t, err.Error(), fmt.Sprintf("%q", m.ID))
	}
	b.requireRows(t, 3, 1)

	// Ids are compared exactly: these are new messages.
	for _, id := range []string{"M1", "m1 "} {
		res, err := b.p.Send(b.ctx, b.app, msg("c1", id, "hello"))
		require.NoError(t, err)
		require.False(t, res.AlreadyAccepted)
	}
	b.requireRows(t, 5, 3)
}

// A conflict says only that the id is taken. A client sending id X into its conversation must
// not learn that X exists in another conversation, that message's role or content, or how it was
// written: every kind of conflict has the same error text, naming only the caller's own ids.
func TestSendConflictRevealsNothingAboutTheExistingMessage(t *testing.T) {
	t.Parallel()
	b := setup(t)
	b.conversation(t, "mine")
	b.conversation(t, "secret-other-conv")

	const id = "X"
	sent := msg("mine", id, "hello")
	cases := []struct {
		name  string
		state func(t *testing.T) // puts a message with id X in place
	}{
		{"same id in another conversation", func(t *testing.T) {
			_, err := b.p.Send(b.ctx, b.app, msg("secret-other-conv", id, "hello"))
			require.NoError(t, err)
		}},
		{"same id in another conversation with other content", func(t *testing.T) {
			_, err := b.p.Send(b.ctx, b.app, msg("secret-other-conv", id, "secret content"))
			require.NoError(t, err)
		}},
		{"same id in another conversation not a user message", func(t *testing.T) {
			b.exec(t, `INSERT INTO messages (id, conversation_id, role, content)
				VALUES ($1, 'secret-other-conv', 'assistant', 'hello')`, id)
		}},
		{"same id, different content in the same conversation", func(t *testing.T) {
			_, err := b.p.Send(b.ctx, b.app, msg("mine", id, "secret content"))
			require.NoError(t, err)
		}},
		{"same id, same content, not a user message", func(t *testing.T) {
			b.exec(t, `INSERT INTO messages (id, conversation_id, role, content)
				VALUES ($1, 'mine', 'assistant', 'hello')`, id)
		}},
		{"same id, same content, no outbox row", func(t *testing.T) {
			b.exec(t, `INSERT INTO messages (id, conversation_id, role, content)
				VALUES ($1, 'mine', 'user', 'hello')`, id)
		}},
	}
	want := `send message "X" to conversation "mine": ` + producer.ErrConflict.Error()
	for _, tc := range cases {
		b.exec(t, "DELETE FROM messages WHERE id = $1", id) // its outbox row goes with it
		tc.state(t)

		_, err := b.p.Send(b.ctx, b.app, sent)
		require.ErrorIs(t, err, producer.ErrConflict, tc.name)
		require.Equal(t, want, err.Error(), tc.name)
		require.NotContains(t, err.Error(), "secret", tc.name)

		tx, err := b.app.Begin(b.ctx)
		require.NoError(t, err)
		_, err = b.p.SendTx(b.ctx, tx, sent)
		require.ErrorIs(t, err, producer.ErrConflict, tc.name)
		require.Equal(t, want, err.Error(), tc.name)
		require.NoError(t, tx.Rollback(b.ctx))
	}
}

func TestSendMissingConversationWritesNothing(t *testing.T) {
	t.Parallel()
	b := setup(t)

	_, err := b.p.Send(b.ctx, b.app, msg("missing", "m1", "hello"))
	require.ErrorIs(t, err, producer.ErrConversationNotFound)
	b.requireRows(t, 0, 0)

	tx, err := b.app.Begin(b.ctx)
	require.NoError(t, err)
	defer func() { _ = tx.Rollback(b.ctx) }()
	_, err = b.p.SendTx(b.ctx, tx, msg("missing", "m1", "hello"))
	require.ErrorIs(t, err, producer.ErrConversationNotFound)
	require.NoError(t, tx.Rollback(b.ctx))
	b.requireRows(t, 0, 0)

	var conversations int
	require.NoError(t, b.db.Pool.QueryRow(b.ctx, "SELECT count(*) FROM conversations").Scan(&conversations))
	require.Zero(t, conversations, "Send never creates a conversation")

	// Once it exists, the same message goes through.
	b.conversation(t, "missing")
	res, err := b.p.Send(b.ctx, b.app, msg("missing", "m1", "hello"))
	require.NoError(t, err)
	require.False(t, res.AlreadyAccepted)
	b.requireRows(t, 1, 1)
}

func TestDeleteConversationCascades(t *testing.T) {
	t.Parallel()
	b := setup(t)
	b.conversation(t, "c1")
	b.conversation(t, "c2")
	for i := range 3 {
		_, err := b.p.Send(b.ctx, b.app, msg("c1", fmt.Sprint("a", i), "hello"))
		require.NoError(t, err)
		_, err = b.p.Send(b.ctx, b.app, msg("c2", fmt.Sprint("b", i), "hello"))
		require.NoError(t, err)
	}
	b.requireRows(t, 6, 6)
	b.exec(t, "DELETE FROM conversations WHERE id = 'c1'")
	b.requireRows(t, 3, 3)
	var left int
	require.NoError(t, b.db.Pool.QueryRow(b.ctx,
		"SELECT count(*) FROM agent_outbox WHERE conversation_id = 'c1'").Scan(&left))
	require.Zero(t, left)

	// The ids are free again, and the conversation must be created again first.
	_, err := b.p.Send(b.ctx, b.app, msg("c1", "a0", "hello"))
	require.ErrorIs(t, err, producer.ErrConversationNotFound)
	b.conversation(t, "c1")
	res, err := b.p.Send(b.ctx, b.app, msg("c1", "a0", "hello"))
	require.NoError(t, err)
	require.False(t, res.AlreadyAccepted)
}

// SendTx's rows commit with the caller's writes or not at all.
func TestSendTxCommitsAndRollsBackWithCallerTx(t *testing.T) {
	t.Parallel()
	b := setup(t)
	b.conversation(t, "c1")
	b.exec(t, "CREATE TABLE app_tickets (id text PRIMARY KEY, state text NOT NULL)")
	b.exec(t, "GRANT ALL ON app_tickets TO "+pgx.Identifier{b.db.RoleName(testsvc.RoleApp)}.Sanitize()) // the app's own table

	// The application's statement after SendTx fails: the caller rolls back, nothing stays.
	tx, err := b.app.Begin(b.ctx)
	require.NoError(t, err)
	_, err = tx.Exec(b.ctx, "INSERT INTO app_tickets VALUES ('t1', 'open')")
	require.NoError(t, err)
	_, err = b.p.SendTx(b.ctx, tx, msg("c1", "m1", "hello"))
	require.NoError(t, err)
	_, err = tx.Exec(b.ctx, "INSERT INTO app_tickets VALUES ('t1', 'duplicate')")
	require.Error(t, err)
	require.NoError(t, tx.Rollback(b.ctx))
	b.requireRows(t, 0, 0)

	// Explicit rollback after a successful SendTx.
	tx, err = b.app.Begin(b.ctx)
	require.NoError(t, err)
	_, err = b.p.SendTx(b.ctx, tx, msg("c1", "m1", "hello"))
	require.NoError(t, err)
	require.NoError(t, tx.Rollback(b.ctx))
	b.requireRows(t, 0, 0)

	// Commit: the application's state and the message are there together.
	err = pgx.BeginFunc(b.ctx, b.db.Pool, func(tx pgx.Tx) error {
		if _, err := tx.Exec(b.ctx, "INSERT INTO app_tickets VALUES ('t1', 'open')"); err != nil {
			return err
		}
		res, err := b.p.SendTx(b.ctx, tx, msg("c1", "m1", "hello"))
		if err != nil {
			return err
		}
		if res.AlreadyAccepted {
			return errors.New("rolled-back send must not count as accepted")
		}
		return nil
	})
	require.NoError(t, err)
	b.requireRows(t, 1, 1)
	var tickets int
	require.NoError(t, b.db.Pool.QueryRow(b.ctx, "SELECT count(*) FROM app_tickets").Scan(&tickets))
	require.Equal(t, 1, tickets)
}

// A failure after the message insert, inside Send's one statement, leaves no message behind.
func TestSendFailureBetweenInsertsWritesNothing(t *testing.T) {
	t.Parallel()
	b := setup(t)
	b.conversation(t, "c1")
	b.exec(t, `CREATE FUNCTION fail_outbox() RETURNS trigger LANGUAGE plpgsql AS $$
		BEGIN RAISE EXCEPTION 'injected outbox failure' USING ERRCODE = 'P0001'; END $$`)
	b.exec(t, `CREATE TRIGGER fail_outbox BEFORE INSERT ON agent_outbox
		FOR EACH ROW EXECUTE FUNCTION fail_outbox()`)

	_, err := b.p.Send(b.ctx, b.app, msg("c1", "m1", "hello"))
	var pgErr *pgconn.PgError
	require.ErrorAs(t, err, &pgErr)
	require.Equal(t, "P0001", pgErr.Code)
	require.NotErrorIs(t, err, producer.ErrConflict)
	b.requireRows(t, 0, 0)

	b.exec(t, "DROP TRIGGER fail_outbox ON agent_outbox")
	res, err := b.p.Send(b.ctx, b.app, msg("c1", "m1", "hello"))
	require.NoError(t, err)
	require.False(t, res.AlreadyAccepted, "the failed attempt must have left no message")
	b.requireRows(t, 1, 1)
}

// A connection that dies before its transaction commits loses the whole transaction; the client
// retries with the same id and the message is written once.
func TestSendTxDroppedConnectionWritesNothing(t *testing.T) {
	t.Parallel()
	b := setup(t)
	b.conversation(t, "c1")

	conn, err := b.db.Pool.Acquire(b.ctx)
	require.NoError(t, err)
	defer conn.Release()
	tx, err := conn.Begin(b.ctx)
	require.NoError(t, err)
	_, err = b.p.SendTx(b.ctx, tx, msg("c1", "m1", "hello"))
	require.NoError(t, err)
	var pid uint32
	require.NoError(t, tx.QueryRow(b.ctx, "SELECT pg_backend_pid()").Scan(&pid))

	var terminated bool
	require.NoError(t, b.db.Pool.QueryRow(b.ctx, "SELECT pg_terminate_backend($1, 10000)", pid).Scan(&terminated))
	require.True(t, terminated)
	require.Error(t, tx.Commit(b.ctx))
	b.requireRows(t, 0, 0)

	res, err := b.p.Send(b.ctx, b.app, msg("c1", "m1", "hello"))
	require.NoError(t, err)
	require.False(t, res.AlreadyAccepted)
	b.requireRows(t, 1, 1)
}

// failDB fails the test on any database call: input errors must come before I/O.
type failDB struct {
	pgx.Tx // nil; only the methods below may be called, and they must not be
	t      *testing.T
}

func (f failDB) Begin(context.Context) (pgx.Tx, error) {
	f.t.Error("Begin called for invalid input")
	return nil, errors.New("no database")
}

func (f failDB) QueryRow(context.Context, string, ...any) pgx.Row {
	f.t.Error("QueryRow called for invalid input")
	return errRow{}
}

type errRow struct{}

func (errRow) Scan(...any) error { return errors.New("no database") }

func TestSendInvalidInputWritesNothing(t *testing.T) {
	t.Parallel()
	b := setup(t)
	b.conversation(t, "c1")
	p, err := producer.New(producer.Config{MaxContentBytes: 16})
	require.NoError(t, err)

	long := strings.Repeat("é", producer.MaxIDBytes/2) + "x" // 201 bytes, 101 runes
	cases := []struct {
		name    string
		msg     producer.Message
		field   string
		tooLong bool
	}{
		{"empty conversation id", msg("", "m1", "hi"), "ConversationID", false},
		{"long conversation id", msg(long, "m1", "hi"), "ConversationID", false},
		{"invalid UTF-8 conversation id", msg("c\xff", "m1", "hi"), "ConversationID", false},
		{"NUL in conversation id", msg("c\x001", "m1", "hi"), "ConversationID", false},
		{"empty id", msg("c1", "", "hi"), "ID", false},
		{"long id", msg("c1", long, "hi"), "ID", false},
		{"invalid UTF-8 id", msg("c1", "m\xc3", "hi"), "ID", false},
		{"NUL in id", msg("c1", "\x00", "hi"), "ID", false},
		{"empty content", msg("c1", "m1", ""), "Content", false},
		{"content too large", msg("c1", "m1", strings.Repeat("x", 17)), "Content", true},
		{"invalid UTF-8 content", msg("c1", "m1", "h\xe2\x28\xa1"), "Content", false},
		{"NUL in content", msg("c1", "m1", "h\x00i"), "Content", false},
		{"surrogate half in content", msg("c1", "m1", "\xed\xa0\x80"), "Content", false},
	}
	for _, tc := range cases {
		check := func(t *testing.T, err error) {
			t.Helper()
			require.ErrorIs(t, err, producer.ErrInvalidInput)
			var inputErr *producer.InputError
			require.ErrorAs(t, err, &inputErr)
			require.Equal(t, tc.field, inputErr.Field)
			require.NotEmpty(t, inputErr.Reason)
			require.Equal(t, tc.tooLong, errors.Is(err, producer.ErrContentTooLarge))
			require.NotErrorIs(t, err, producer.ErrConflict)
		}
		t.Run(tc.name, func(t *testing.T) {
			_, err := p.Send(b.ctx, failDB{t: t}, tc.msg)
			check(t, err)
			_, err = p.SendTx(b.ctx, failDB{t: t}, tc.msg)
			check(t, err)
			_, err = p.Send(b.ctx, b.db.Pool, tc.msg)
			check(t, err)
			b.requireRows(t, 0, 0)
		})
	}

	// The limits themselves are accepted.
	maxID := strings.Repeat("é", producer.MaxIDBytes/2) // 200 bytes
	b.conversation(t, maxID)
	_, err = p.Send(b.ctx, b.db.Pool, msg(maxID, maxID, strings.Repeat("x", 16)))
	require.NoError(t, err)
	b.requireRows(t, 1, 1)
}

func TestCreateConversation(t *testing.T) {
	t.Parallel()
	b := setup(t)

	created, err := b.p.CreateConversation(b.ctx, b.app, "c1")
	require.NoError(t, err)
	require.True(t, created)
	created, err = b.p.CreateConversation(b.ctx, b.app, "c1")
	require.NoError(t, err)
	require.False(t, created, "the second call finds it")

	tx, err := b.app.Begin(b.ctx)
	require.NoError(t, err)
	created, err = b.p.CreateConversationTx(b.ctx, tx, "c2")
	require.NoError(t, err)
	require.True(t, created)
	_, err = b.p.SendTx(b.ctx, tx, msg("c2", "m1", "first message"))
	require.NoError(t, err)
	require.NoError(t, tx.Rollback(b.ctx))
	b.requireRows(t, 0, 0)
	created, err = b.p.CreateConversation(b.ctx, b.app, "c2")
	require.NoError(t, err)
	require.True(t, created, "the rolled-back conversation must not exist")

	for _, id := range []string{"", strings.Repeat("x", 201), "\xff", "a\x00"} {
		_, err := b.p.CreateConversation(b.ctx, failDB{t: t}, id)
		require.ErrorIs(t, err, producer.ErrInvalidInput)
		var inputErr *producer.InputError
		require.ErrorAs(t, err, &inputErr)
		require.Equal(t, "ConversationID", inputErr.Field)
	}
	var n int
	require.NoError(t, b.db.Pool.QueryRow(b.ctx, "SELECT count(*) FROM conversations").Scan(&n))
	require.Equal(t, 2, n)
}

func TestNewConfig(t *testing.T) {
	t.Parallel()
	b := setup(t)
	b.conversation(t, "c1")

	p, err := producer.New(producer.Config{})
	require.NoError(t, err)
	_, err = p.Send(b.ctx, b.db.Pool, msg("c1", "max", strings.Repeat("x", producer.DefaultMaxContentBytes)))
	require.NoError(t, err, "1 MiB is the default limit")
	_, err = p.Send(b.ctx, b.db.Pool, msg("c1", "over", strings.Repeat("x", producer.DefaultMaxContentBytes+1)))
	require.ErrorIs(t, err, producer.ErrContentTooLarge)
	b.requireRows(t, 1, 1)
	// A retry of a large message compares content in the database, not by fetching it.
	res, err := p.Send(b.ctx, b.db.Pool, msg("c1", "max", strings.Repeat("x", producer.DefaultMaxContentBytes)))
	require.NoError(t, err)
	require.True(t, res.AlreadyAccepted)

	_, err = producer.New(producer.Config{MaxContentBytes: -1})
	require.Error(t, err)
	_, err = producer.New(producer.Config{MaxContentBytes: 1<<30 + 1})
	require.Error(t, err)
}

func TestSendLogsAtDebug(t *testing.T) {
	t.Parallel()
	b := setup(t)
	b.conversation(t, "c1")
	var buf bytes.Buffer
	p, err := producer.New(producer.Config{
		Logger: slog.New(slog.NewJSONHandler(&buf, &slog.HandlerOptions{Level: slog.LevelDebug})),
	})
	require.NoError(t, err)
	res, err := p.Send(b.ctx, b.db.Pool, msg("c1", "m1", "secret content"))
	require.NoError(t, err)

	var rec map[string]any
	require.NoError(t, json.Unmarshal(buf.Bytes(), &rec))
	require.Equal(t, "DEBUG", rec["level"])
	require.Equal(t, "c1", rec["conversation_id"])
	require.Equal(t, "m1", rec["message_id"])
	require.EqualValues(t, res.OutboxID, rec["outbox_id"])
	require.Equal(t, false, rec["already_accepted"])
	require.NotContains(t, buf.String(), "secret content", "content is never logged")
}
