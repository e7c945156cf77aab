package console

import (
	"context"
	"fmt"
	"net/url"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/batonhq/baton/internal/testsvc"
	"github.com/batonhq/baton/internal/throwaway"
	"github.com/batonhq/baton/migrations"
)

// costWindow is how long each case of TestStreamDatabaseCost lets its streams poll.
const costWindow = 3 * time.Second

// TestStreamDatabaseCost measures what open event streams cost the database, from
// pg_stat_statements of a cluster of the test's own, with the console connected as roles.sql's
// console role and polling every 250 ms (the default):
//
//   - A: 10 streams (10 clients), each on an idle conversation of a few small messages. While
//     nothing changes no statement that reads a message's content runs: each poll reads the
//     rows' small columns only. A new message is then read once, by the stream watching it.
//   - B: 4 streams on one conversation of 100 messages of 1 MB (poorly compressible, stored
//     out of line) with their replies. Each poll used to read all 100 MB (length() of each
//     content); the blocks a stream touches per second are bounded far below that.
//
// It logs the database time per stream per second and the blocks per stream per poll; it
// asserts on blocks and statements, which do not depend on the machine's speed.
func TestStreamDatabaseCost(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	admin, consolePool := costCluster(ctx, t)
	e := serve(t, &testEnv{}, Config{Pool: consolePool})

	t.Run("A idle conversations", func(t *testing.T) {
		const streams = 10
		for i := range streams {
			conv := fmt.Sprintf("idle-%d", i)
			exec(t, admin, `INSERT INTO conversations (id) VALUES ($1)`, conv)
			for j := range 3 {
				id := fmt.Sprintf("%s-m%d", conv, j)
				exec(t, admin, `INSERT INTO messages (id, conversation_id, role, content, created_at)
					VALUES ($1, $2, 'user', 'hello ' || $1, now() + $3 * interval '1 millisecond')`, id, conv, j)
				exec(t, admin, `INSERT INTO messages (id, conversation_id, role, content) VALUES ($1 || '-reply', $2, 'assistant', 'echo')`, id, conv)
				exec(t, admin, `INSERT INTO agent_outbox (conversation_id, message_id, status, attempts, reply_id)
					VALUES ($2, $1, 'done', 1, $1 || '-reply')`, id, conv)
			}
		}
		var open []*stream
		for i := range streams {
			s := e.openStreamWith(t, clientFrom(t, fmt.Sprintf("127.0.0.%d", 10+i)), fmt.Sprintf("idle-%d", i))
			require.Len(t, firstEvent(t, s).Messages, 3)
			open = append(open, s)
		}
		c := measure(ctx, t, admin, streams)
		require.Zero(t, c.contentCalls, "a statement reading contents ran %d times while nothing changed", c.contentCalls)
		require.GreaterOrEqual(t, c.calls, int64(streams), "the streams did not poll")

		// A change is read once, by the stream that watches it: its new message only.
		exec(t, admin, `INSERT INTO messages (id, conversation_id, role, content, created_at)
			VALUES ('idle-0-new', 'idle-0', 'user', 'new', now() + interval '1 second')`)
		open[0].view(t, "idle-0-new", StateSynchronized)
		require.Eventually(t, func() bool { return readCost(ctx, t, admin).contentCalls > 0 }, waitFor, 10*time.Millisecond)
		require.Equal(t, int64(1), readCost(ctx, t, admin).contentCalls, "the new message was not read exactly once")
		for _, s := range open {
			s.close()
		}
	})

	t.Run("B 1 MB messages", func(t *testing.T) {
		const streams, messages = 4, 100
		exec(t, admin, `INSERT INTO conversations (id) VALUES ('big')`)
		// One 1 MB text of hex digits, which pglz does not compress: each row stores its own
		// copy out of line, 100 MB of messages; replies of 64 kB likewise.
		exec(t, admin, `WITH b AS (SELECT string_agg(md5(random()::text || h), '') AS s FROM generate_series(1, 32768) h)
			INSERT INTO messages (id, conversation_id, role, content, created_at)
			SELECT 'big-' || g || suffix, 'big', role, g || substr(b.s, 1, size), now() + g * interval '1 millisecond'
			FROM b, generate_series(1, $1) g,
				(VALUES ('', 'user', 1 << 20), ('-reply', 'assistant', 64 << 10)) AS kind (suffix, role, size)`, messages)
		exec(t, admin, `INSERT INTO agent_outbox (conversation_id, message_id, status, attempts, reply_id)
			SELECT 'big', 'big-' || g, 'done', 1, 'big-' || g || '-reply' FROM generate_series(1, $1) g`, messages)
		var stored int64
		require.NoError(t, admin.QueryRow(ctx, `SELECT sum(pg_column_size(content)) FROM messages WHERE conversation_id = 'big'`).Scan(&stored))
		require.Greater(t, stored, int64(messages)<<20, "the messages were compressed")

		var open []*stream
		for i := range streams {
			s := e.openStreamWith(t, clientFrom(t, fmt.Sprintf("127.0.1.%d", 10+i)), "big")
			first := firstEvent(t, s)
			require.Len(t, first.Messages, messages)
			require.Equal(t, StateReplied, first.Messages[0].State)
			require.Len(t, []rune(first.Messages[0].Content), chatTextChars+1)
			open = append(open, s)
		}
		c := measure(ctx, t, admin, streams)
		// 100 MB is 12800 blocks of 8 kB: each poll of the old read touched more than that
		// (about 16000), and a stream 17000 to 28000 a second, as many as its polls could get
		// through on 2 busy cores. A poll now reads each row's small columns by index (about
		// 520 blocks), at most 4 times a second.
		const maxBlocksPerPoll, maxBlocksPerStreamSecond = 1000, 3000
		require.Less(t, c.blocksPerPoll, float64(maxBlocksPerPoll), "each poll touches %.0f blocks", c.blocksPerPoll)
		require.Less(t, c.blocksPerStreamSecond, float64(maxBlocksPerStreamSecond),
			"each stream touches %.0f blocks per second", c.blocksPerStreamSecond)
		require.Zero(t, c.contentCalls, "a statement reading contents ran %d times while nothing changed", c.contentCalls)
		for _, s := range open {
			s.close()
		}
	})
}

// firstEvent is a stream's first event, which holds every message.
func firstEvent(t *testing.T, s *stream) messagesEvent {
	t.Helper()
	select {
	case ev := <-s.events:
		require.True(t, ev.Full)
		return ev
	case <-time.After(waitFor):
		t.Fatal("no first event")
		return messagesEvent{}
	}
}

// cost is what the console's statements cost since pg_stat_statements was reset.
type cost struct {
	calls, contentCalls, blocks int64
	ms                          float64

	blocksPerPoll, blocksPerStreamSecond, msPerStreamSecond float64
}

// measure resets pg_stat_statements, lets the streams poll for costWindow, and returns and
// logs the console's cost per stream.
func measure(ctx context.Context, t *testing.T, admin *pgxpool.Pool, streams int) cost {
	t.Helper()
	exec(t, admin, `SELECT pg_stat_statements_reset()`)
	start := time.Now()
	time.Sleep(costWindow) // the window measured, not a wait for an event
	c := readCost(ctx, t, admin)
	secs := time.Since(start).Seconds()
	c.blocksPerStreamSecond = float64(c.blocks) / float64(streams) / secs
	c.msPerStreamSecond = c.ms / float64(streams) / secs
	if c.calls > 0 {
		c.blocksPerPoll = float64(c.blocks) / float64(c.calls)
	}
	t.Logf("%d streams, %.1f s: %d statements (%d reading contents), %.2f ms of database time per stream per second, "+
		"%.0f blocks per stream per poll, %.0f blocks per stream per second",
		streams, secs, c.calls, c.contentCalls, c.msPerStreamSecond, c.blocksPerPoll, c.blocksPerStreamSecond)
	return c
}

// readCost sums pg_stat_statements over the statements the console's role ran in this
// database. A statement that names a content column reads contents.
func readCost(ctx context.Context, t *testing.T, admin *pgxpool.Pool) cost {
	t.Helper()
	var c cost
	require.NoError(t, admin.QueryRow(ctx, `SELECT coalesce(sum(calls), 0)::bigint,
		coalesce(sum(calls) FILTER (WHERE query LIKE '%content%'), 0)::bigint,
		coalesce(sum(shared_blks_hit + shared_blks_read), 0)::bigint, coalesce(sum(total_exec_time), 0)
		FROM pg_stat_statements
		WHERE userid = 'cost_console'::regrole AND dbid = (SELECT oid FROM pg_database WHERE datname = current_database())`).
		Scan(&c.calls, &c.contentCalls, &c.blocks, &c.ms))
	return c
}

// costCluster starts a cluster of the test's own with pg_stat_statements, makes a migrated
// database with roles.sql's roles (named cost_*), and returns a pool on it as its owner and
// one as cost_console, set up as `baton console` sets its own.
func costCluster(ctx context.Context, t *testing.T) (admin, console *pgxpool.Pool) {
	t.Helper()
	pg, err := testsvc.StartPostgresWith(ctx, throwaway.PostgresOptions{Settings: []string{
		"shared_preload_libraries = 'pg_stat_statements'",
		"pg_stat_statements.track = all",
	}})
	if err != nil {
		t.Fatalf("start postgres: %v", err)
	}
	t.Cleanup(func() { require.NoError(t, pg.Close()) })
	conn, err := pgx.Connect(ctx, pg.URL("postgres"))
	require.NoError(t, err)
	_, err = conn.Exec(ctx, `CREATE DATABASE cost`)
	require.NoError(t, err)
	require.NoError(t, conn.Close(ctx))

	conn, err = pgx.Connect(ctx, pg.URL("cost"))
	require.NoError(t, err)
	defer func() { _ = conn.Close(ctx) }()
	_, err = conn.Exec(ctx, `CREATE EXTENSION pg_stat_statements`)
	require.NoError(t, err)
	_, err = migrations.Up(ctx, conn)
	require.NoError(t, err)
	roles, err := testsvc.RolesSQL("cost")
	require.NoError(t, err)
	_, err = conn.Exec(ctx, roles)
	require.NoError(t, err)

	admin, err = pgxpool.New(ctx, pg.URL("cost"))
	require.NoError(t, err)
	t.Cleanup(admin.Close)
	u, err := url.Parse(pg.URL("cost"))
	require.NoError(t, err)
	u.User = url.User("cost_console")
	pcfg, err := pgxpool.ParseConfig(u.String())
	require.NoError(t, err)
	pcfg.MaxConns = 8 // as cmd/baton's console
	console, err = pgxpool.NewWithConfig(ctx, pcfg)
	require.NoError(t, err)
	t.Cleanup(console.Close)
	return admin, console
}
