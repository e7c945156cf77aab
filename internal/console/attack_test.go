package console

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/batonhq/baton/internal/testsvc"
)

// TestAttackReplyFromAnotherConversation: baton_worker may UPDATE agent_outbox.reply_id, and
// the key on reply_id names any message, of any conversation. A row of conversation a whose
// reply_id names an assistant message of conversation b must not show b's text as the answer
// to a's message, neither in the chat nor in the timeline.
func TestAttackReplyFromAnotherConversation(t *testing.T) {
	t.Parallel()
	e := setup(t, Config{}, false)
	e.createConversation(t, "conv-a")
	e.createConversation(t, "conv-b")
	e.send(t, "conv-a", "a1", "question in a")
	const secret = "private answer of conversation b"
	exec(t, e.db.Pool, `INSERT INTO messages (id, conversation_id, role, content) VALUES ('b-reply', 'conv-b', 'assistant', $1)`, secret)
	// What baton_worker's grant allows: UPDATE (status, processed_at, reply_id, ...).
	exec(t, e.db.Pool, `UPDATE agent_outbox SET status = 'done', processed_at = clock_timestamp(), reply_id = 'b-reply'
		WHERE message_id = 'a1'`)

	code, body := e.do(t, http.MethodGet, "/api/conversations/conv-a/messages", nil)
	require.Equal(t, http.StatusOK, code, string(body))
	require.NotContains(t, string(body), secret, "the chat shows conversation b's reply as the answer to a's message")
	code, body = e.do(t, http.MethodGet, "/api/messages/a1", nil)
	require.Equal(t, http.StatusOK, code, string(body))
	require.NotContains(t, string(body), secret, "the timeline shows conversation b's reply as the answer to a's message")
}

// TestAttackQueriesScanWholeTables: the console's periodic reads (the message page every
// second, the system view every 3 seconds, the chat's conversation list every 5 seconds per
// open page) must not read a whole table that grows with every message or turn. On tables of
// realistic size, none of their plans may hold a sequential scan of a Baton table.
func TestAttackQueriesScanWholeTables(t *testing.T) {
	t.Parallel()
	db := testsvc.NewDatabase(t)
	const n = 30000
	for _, sql := range []string{
		`INSERT INTO conversations (id, created_at, last_message_at)
			SELECT 'c' || g, now() - g * interval '1 minute', now() - g * interval '1 minute' FROM generate_series(1, $1) g`,
		`INSERT INTO messages (id, conversation_id, role, content, created_at)
			SELECT 'm' || g, 'c' || g, 'user', 'hello', now() - g * interval '1 minute' FROM generate_series(1, $1) g`,
		`INSERT INTO messages (id, conversation_id, role, content, created_at)
			SELECT 'r' || g, 'c' || g, 'assistant', 'echo', now() - g * interval '1 minute' FROM generate_series(1, $1) g`,
		`INSERT INTO agent_outbox (conversation_id, message_id, status, attempts, created_at, processed_at, reply_id)
			OVERRIDING SYSTEM VALUE
			SELECT 'c' || g, 'm' || g, 'done', 1, now() - g * interval '1 minute', now() - g * interval '1 minute' + interval '1 second', 'r' || g
			FROM generate_series(1, $1) g`,
		`INSERT INTO agent_runs (run_id, conversation_id, outbox_ids, worker, started_at, finished_at, outcome)
			SELECT gen_random_uuid(), 'c' || g, ARRAY[g::bigint], 'worker-' || (g % 10), now() - g * interval '1 minute',
				now() - g * interval '1 minute' + interval '1 second', 'done' FROM generate_series(1, $1) g`,
	} {
		exec(t, db.Pool, sql, n)
	}
	exec(t, db.Pool, `ANALYZE conversations, messages, agent_outbox, agent_runs, operations`)

	queries := []struct {
		name string
		sql  string
		args []any
	}{
		{"timeline outbox row (message page, every second)", timelineOutboxSQL, []any{"m123"}},
		{"timeline outbox row of a reply (message page, every second)", timelineAnsweredSQL,
			[]any{"r123", "c123", time.Now().Add(-123 * time.Minute)}},
		{"workers (system view)", workersSQL, []any{maxWorkers}},
		{"turn series (system view)", seriesSQL, []any{chartWindow.Seconds(), chartBucket.Seconds()}},
		{"conversation list (chat, every 5 s)", conversationsSQL, []any{maxConversations}},
		{"conversation messages (every stream poll)", messagesSQL, []any{"c123", maxMessages}},
	}
	var scans []string
	for _, q := range queries {
		var plan []map[string]any
		require.NoError(t, db.Pool.QueryRow(context.Background(), "EXPLAIN (FORMAT JSON) "+q.sql, q.args...).Scan(&plan), q.name)
		for _, rel := range seqScans(plan[0]["Plan"]) {
			scans = append(scans, fmt.Sprintf("%s: Seq Scan on %s", q.name, rel))
		}
	}
	require.Empty(t, scans, "queries that read a whole table on every refresh")
}

// seqScans returns the relations a plan node (or its children) scans sequentially.
func seqScans(node any) []string {
	m, ok := node.(map[string]any)
	if !ok {
		return nil
	}
	var out []string
	if m["Node Type"] == "Seq Scan" {
		out = append(out, fmt.Sprint(m["Relation Name"]))
	}
	if kids, ok := m["Plans"].([]any); ok {
		for _, k := range kids {
			out = append(out, seqScans(k)...)
		}
	}
	return out
}

// TestAttackShutdownWithStalledStream: stopping the console (SIGTERM) while an event stream's
// client does not read must end that stream at once and return cleanly. The stream's write
// ignores the server's context, so Shutdown waits its 5 seconds and Serve fails with
// "context deadline exceeded" (the command exits with an error on a plain SIGTERM) while the
// handler goroutine keeps writing after Serve returned.
func TestAttackShutdownWithStalledStream(t *testing.T) {
	t.Parallel()
	db := testsvc.NewDatabase(t)
	exec(t, db.Pool, `INSERT INTO conversations (id) VALUES ('big')`)
	// 200 messages and replies of 4000 characters that JSON escapes to 6 bytes each: one full
	// event of about 9.6 MB, more than the server's socket buffer and the client's together.
	exec(t, db.Pool, `INSERT INTO messages (id, conversation_id, role, content)
		SELECT 'm' || g, 'big', 'user', repeat('<', 5000) FROM generate_series(1, 200) g`)
	exec(t, db.Pool, `INSERT INTO messages (id, conversation_id, role, content)
		SELECT 'r' || g, 'big', 'assistant', repeat('>', 5000) FROM generate_series(1, 200) g`)
	exec(t, db.Pool, `INSERT INTO agent_outbox (conversation_id, message_id, status, reply_id, processed_at)
		SELECT 'big', 'm' || g, 'done', 'r' || g, now() FROM generate_series(1, 200) g`)

	srv, addr, stop := serveUntilStopped(t, db, waitFor)

	// A client that reads the start of the stream, then stops reading (a frozen tab, a stalled
	// proxy), with a small receive buffer.
	var d net.Dialer
	conn, err := d.DialContext(context.Background(), "tcp", addr)
	require.NoError(t, err)
	defer func() { _ = conn.Close() }()
	require.NoError(t, conn.(*net.TCPConn).SetReadBuffer(4096))
	_, err = io.WriteString(conn, "GET /api/conversations/big/events HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
	require.NoError(t, err)
	require.NoError(t, conn.SetReadDeadline(time.Now().Add(waitFor)))
	br := bufio.NewReaderSize(conn, 1024)
	res, err := http.ReadResponse(br, nil)
	require.NoError(t, err)
	require.Equal(t, http.StatusOK, res.StatusCode)
	// Read until the big event has started: its write cannot finish while we read no more.
	buf := make([]byte, 1024)
	for got := ""; !strings.Contains(got, "event: messages"); {
		n, err := res.Body.Read(buf)
		require.NoError(t, err)
		got += string(buf[:n])
	}

	require.NoError(t, stop(), "Serve must stop cleanly with a client that does not read") // SIGTERM
	require.Zero(t, srv.streams.Load(), "the stalled stream was still open after Serve returned")
}

// TestAttackSendHangsWhenPostgresStalls: when Postgres stops answering (a half-open connection,
// a failover whose old address went away), a send must answer an error the page can offer a
// retry for, within a bounded time. Nothing bounds the console's database work but the
// client's patience: the request hangs, and the page shows the message as local with no retry.
func TestAttackSendHangsWhenPostgresStalls(t *testing.T) {
	t.Parallel()
	db := testsvc.NewDatabase(t)
	proxy, proxied := testsvc.ProxyPostgres(t, db.URL)
	pool, err := pgxpool.New(context.Background(), proxied)
	require.NoError(t, err)
	t.Cleanup(pool.Close)
	e := serve(t, &testEnv{db: db}, Config{Pool: pool})
	t.Cleanup(proxy.Unfreeze) // before the console stops
	e.createConversation(t, "conv-1")

	proxy.Freeze()
	ctx, cancelReq := context.WithTimeout(context.Background(), waitFor)
	defer cancelReq()
	body := strings.NewReader(`{"id":"m1","content":"hello"}`)
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, e.base+"/api/conversations/conv-1/messages", body)
	require.NoError(t, err)
	res, err := http.DefaultClient.Do(req)
	require.NoError(t, err, "no answer to a send within %s while Postgres is stalled", waitFor)
	defer func() { _ = res.Body.Close() }()
	out, _ := io.ReadAll(res.Body)
	var apiErr apiError
	require.NoError(t, json.Unmarshal(out, &apiErr), string(out))
	require.GreaterOrEqual(t, res.StatusCode, 500, string(out))
}

// TestAttackHugeWorkerAndToolNamesNotClipped: contents are clipped in SQL because any role that
// writes messages may write huge ones, but baton_worker writes agent_runs.worker and
// operations.tool too, unbounded text that the chat (every stream event), the timeline and the
// system view return whole: one 8 MB worker name makes every answer carry it.
func TestAttackHugeWorkerAndToolNamesNotClipped(t *testing.T) {
	t.Parallel()
	e := setup(t, Config{}, false)
	e.createConversation(t, "conv-1")
	e.send(t, "conv-1", "m1", "hello")
	huge := strings.Repeat("w", 8<<20)
	w := worker{t: t, e: e, conv: "conv-1", msgID: "m1", runID: "00000000-0000-4000-8000-0000000000a1", worker: huge}
	w.claim()
	exec(t, e.db.Pool, `INSERT INTO operations (run_id, conversation_id, tool, effect) VALUES ($1, 'conv-1', $2, 'read')`, w.runID, huge)

	const limit = 1 << 20 // far above anything these pages need
	var big []string
	for _, path := range []string{"/api/conversations/conv-1/messages", "/api/messages/m1", "/api/status"} {
		code, body := e.do(t, http.MethodGet, path, nil)
		require.Equal(t, http.StatusOK, code, path)
		if len(body) >= limit {
			big = append(big, fmt.Sprintf("%s: %d bytes", path, len(body)))
		}
	}
	require.Empty(t, big, "answers carrying a worker's or tool's name whole")
}

// countingHandler counts the records logged at Warn or above, and those at Info.
type countingHandler struct {
	slog.Handler
	n    *atomic.Int64
	info *atomic.Int64
}

func (h countingHandler) Enabled(context.Context, slog.Level) bool { return true }

func (h countingHandler) Handle(_ context.Context, r slog.Record) error {
	switch {
	case r.Level >= slog.LevelWarn:
		h.n.Add(1)
	case r.Level == slog.LevelInfo && h.info != nil:
		h.info.Add(1)
	}
	return nil
}

// TestAttackDatabaseOutageFloodsTheLog: while Postgres cannot answer a stream's read, every
// open stream logs a warning on every poll (4 a second each at the default interval, 256 a
// second with 64 streams), for as long as the outage lasts. One outage should say so once (and
// again when it ends), not bury the log.
func TestAttackDatabaseOutageFloodsTheLog(t *testing.T) {
	t.Parallel()
	var warnings, infos atomic.Int64
	log := slog.New(countingHandler{Handler: slog.DiscardHandler, n: &warnings, info: &infos})
	e := setup(t, Config{PollInterval: 5 * time.Millisecond, Logger: log}, false)
	e.createConversation(t, "conv-1")
	s := e.openStream(t, "conv-1")
	require.True(t, (<-s.events).Full)

	// The outbox is away (as a dropped or unreachable database makes every read fail).
	exec(t, e.db.Pool, `ALTER TABLE agent_outbox RENAME TO agent_outbox_away`)
	// 2 seconds are 400 polls: a warning per poll would pass the threshold 4 times over.
	const flood = 100
	deadline := time.Now().Add(2 * time.Second)
	for warnings.Load() < flood && time.Now().Before(deadline) {
		time.Sleep(10 * time.Millisecond)
	}
	t.Logf("warnings: %d", warnings.Load())
	require.Less(t, warnings.Load(), int64(flood), "one stream logged a warning per poll during one outage")
	require.Positive(t, warnings.Load(), "the outage was not logged")

	// The outage ends: the stream says so once.
	before := infos.Load()
	exec(t, e.db.Pool, `ALTER TABLE agent_outbox_away RENAME TO agent_outbox`)
	require.Eventually(t, func() bool { return infos.Load() > before }, waitFor, 5*time.Millisecond,
		"the end of the outage was not logged")
}
