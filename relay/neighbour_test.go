package relay_test

// A neighbour: another user of the relay's database, doing what any role may (DESIGN
// invariant 12). Nothing it does may stop the relay.

import (
	"fmt"
	"net/url"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"
)

// neighbourURL returns the database URL with logical_decoding_work_mem at its least (64 kB)
// for the relay's sessions, the walsender's among them: a large transaction's changes spill
// to disk, and decoding it keeps the walsender busy longer, as a larger one would on a faster
// machine.
func neighbourURL(t *testing.T, dbURL string) string {
	t.Helper()
	u, err := url.Parse(dbURL)
	require.NoError(t, err)
	q := u.Query()
	q.Set("options", "-c logical_decoding_work_mem=64kB")
	// Spaces as %20: pgx reads a + in the query as itself.
	u.RawQuery = strings.ReplaceAll(q.Encode(), "+", "%20")
	return u.String()
}

// A neighbour inserts a million rows into a table of its own (outside the publication) in one
// transaction. The walsender decodes it for seconds and answers no status update meanwhile
// (it reads replies only every wal_sender_timeout/2): a relay that takes that silence for a
// dead path ends the session, and the next walsender decodes the same transaction again, for
// ever. The relay must see its walsender busy from its other connection and wait, and relay
// the outbox row committed after it, in the same session.
func TestNeighboursBulkTransactionDoesNotStopTheRelay(t *testing.T) {
	t.Parallel()
	// At a 1s bound 3 million rows keep the walsender busy long enough; 10 million at the
	// default bound live in the long tier (neighbour_long_test.go).
	bulkBesideTheRelay(t, 3_000_000, true, "--status-interval", "250ms", "--min-silence", "1s")
}

// bulkBesideTheRelay commits rows rows into a neighbour's table in one transaction beside a
// relay process started with args, then an outbox row, and requires the relay to relay it in
// the session it had, and, with mustBeBusy, to have seen its walsender busy (else the test
// tested nothing).
func bulkBesideTheRelay(t *testing.T, rows int, mustBeBusy bool, args ...string) {
	b := setup(t)
	ctx := ctxT(t, 10*time.Minute)
	createConversations(t, b.db.Pool, "c")
	_, err := b.db.Pool.Exec(ctx, `CREATE TABLE neighbour_bulk (id bigint, pad text)`)
	require.NoError(t, err)
	p := b.startAdvProcess(t, neighbourURL(t, b.cfg.DatabaseURL), b.nats.URL(), args...)
	p.awaitLogged(t, "msg=streaming")

	started := time.Now()
	_, err = b.db.Pool.Exec(ctx, fmt.Sprintf(`INSERT INTO neighbour_bulk SELECT g, 'neighbour' FROM generate_series(1, %d) g`, rows))
	require.NoError(t, err)
	_, err = send(ctx, b.db.Pool, "c", "after-the-bulk")
	require.NoError(t, err)
	b.waitStream(t, "AGENT_TURNS", 1, 5*time.Minute)
	t.Logf("the outbox row after %d neighbour rows relayed %s after the bulk insert began", rows, time.Since(started).Round(time.Millisecond))
	busy := p.logged("the walsender is busy decoding")
	t.Logf("the relay saw its walsender busy: %v", busy)
	if mustBeBusy {
		require.True(t, busy, "the walsender was never busy long enough to test anything")
	}
	require.False(t, p.logged("relay session ended"), "the relay ended its session on a busy walsender")
}

// A neighbour emits a logical message of its own prefix far larger than --max-change-bytes,
// and Postgres is reached over a slow link (1 MiB/s): the relay cuts the message as it arrives
// and drops its bytes, so no whole CopyData comes for seconds. Bytes arriving are life: a
// relay that counts only whole messages ends every session at the same LSN, for ever.
func TestHugeLogicalMessageOverASlowLinkIsLife(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := ctxT(t, 3*time.Minute)
	createConversations(t, b.db.Pool, "c")
	proxy, viaProxy := proxied(t, b.cfg.DatabaseURL)
	b.cfg.DatabaseURL = viaProxy
	b.cfg.MaxChangeBytes = 1 << 20
	b.cfg.MinSilence = time.Second // the bundle's status interval is 100ms
	reg := prometheus.NewRegistry()
	b.cfg.Registerer = reg
	r := b.start(t)
	require.Eventually(t, r.Active, time.Minute, 5*time.Millisecond, "the relay never streamed")

	proxy.SetReplyRate(1 << 20)
	const size = 6 << 20 // six seconds on the link
	before := proxy.ToClients()
	_, err := b.db.Pool.Exec(ctx, `SELECT pg_logical_emit_message(true, 'neighbour.blob', repeat('x', $1))`, size)
	require.NoError(t, err)
	_, err = send(ctx, b.db.Pool, "c", "after-the-blob")
	require.NoError(t, err)
	started := time.Now()
	b.waitStream(t, "AGENT_TURNS", 1, 2*time.Minute)
	t.Logf("relayed %s after the message", time.Since(started).Round(time.Millisecond))
	require.Greater(t, proxy.ToClients()-before, int64(size), "the message never crossed the slow link")
	require.Zero(t, counter(t, reg, "baton_relay_reconnects_total", ""), "a session ended while the message arrived")
}

// A neighbour's transaction is open (holding a transaction id) when the relay first starts:
// creating the slot waits for it to end, however long that is. The relay must say so, naming
// the backend it waits for, and stream once the neighbour commits.
func TestNeighboursOpenTransactionHoldingSlotCreationIsReported(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := ctxT(t, 3*time.Minute)
	createConversations(t, b.db.Pool, "c")
	_, err := b.db.Pool.Exec(ctx, `CREATE TABLE neighbour_long (id bigint)`)
	require.NoError(t, err)
	long, err := b.db.Pool.Begin(ctx)
	require.NoError(t, err)
	t.Cleanup(func() { _ = long.Rollback(ctx) })
	_, err = long.Exec(ctx, `INSERT INTO neighbour_long VALUES (1)`) // takes a transaction id
	require.NoError(t, err)
	var pid int32
	require.NoError(t, long.QueryRow(ctx, `SELECT pg_backend_pid()`).Scan(&pid))

	p := b.startAdvProcess(t, b.cfg.DatabaseURL, b.nats.URL())
	p.awaitLogged(t, "creating the slot waits for transactions")
	require.True(t, p.logged(fmt.Sprintf("pid %d (role", pid)), "the log names the neighbour's backend")
	require.False(t, p.logged("msg=streaming"))

	require.NoError(t, long.Commit(ctx))
	p.awaitLogged(t, "msg=streaming")
	_, err = send(ctx, b.db.Pool, "c", "after-the-long-transaction")
	require.NoError(t, err)
	b.waitStream(t, "AGENT_TURNS", 1, time.Minute)
}
