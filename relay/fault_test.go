package relay_test

import (
	"bufio"
	"context"
	"fmt"
	"math/rand/v2"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/batonhq/baton/internal/testsvc"
	"github.com/batonhq/baton/migrations"
	"github.com/batonhq/baton/wire"
)

// batonBinary builds cmd/baton once per test binary, for tests that kill the relay as a process.
func batonBinary(tb testing.TB) string {
	return testsvc.Binary(tb, "github.com/batonhq/baton/cmd/baton")
}

// relayProcess is `baton relay` running as a child process.
type relayProcess struct {
	cmd       *exec.Cmd
	streaming chan struct{} // closed when the process logs that it streams
	exited    chan struct{}
}

func (b *bundle) startProcess(t *testing.T) *relayProcess {
	t.Helper()
	cmd := exec.Command(batonBinary(t), "relay")
	cmd.Env = append(os.Environ(),
		"BATON_DATABASE_URL="+b.cfg.DatabaseURL,
		"BATON_NATS_URL="+b.nats.URL(),
		"BATON_SLOT="+b.cfg.Slot,
		"BATON_LOG_LEVEL=info",
	)
	stderr, err := cmd.StderrPipe()
	require.NoError(t, err)
	require.NoError(t, cmd.Start())
	p := &relayProcess{cmd: cmd, streaming: make(chan struct{}), exited: make(chan struct{})}
	go func() {
		sc := bufio.NewScanner(stderr)
		sc.Buffer(make([]byte, 64<<10), 1<<20)
		once := sync.Once{}
		for sc.Scan() {
			if strings.Contains(sc.Text(), "msg=streaming") {
				once.Do(func() { close(p.streaming) })
			}
		}
		_ = cmd.Wait()
		close(p.exited)
	}()
	t.Cleanup(func() { p.kill(t) })
	return p
}

// awaitStreaming waits, a minute at most, until the process logs that it streams.
func (p *relayProcess) awaitStreaming(t *testing.T) {
	t.Helper()
	select {
	case <-p.streaming:
	case <-p.exited:
		t.Fatal("relay process exited before it streamed")
	case <-time.After(time.Minute):
		t.Fatal("relay process never streamed")
	}
}

func (p *relayProcess) kill(t *testing.T) {
	_ = p.cmd.Process.Kill()
	select {
	case <-p.exited:
	case <-time.After(30 * time.Second):
		t.Error("relay process did not exit after SIGKILL")
	}
}

// producers commits rows on their own conversations until stop is closed; each conversation's
// rows are committed one after another by one goroutine, so id order is commit order there.
// Failed commits are retried after a pause: the truth is what agent_outbox holds afterwards.
func producers(ctx context.Context, _ *testing.T, pool *pgxpool.Pool, convs []string, workers int, limit int64, stop <-chan struct{}) (wait func() int64) {
	var wg sync.WaitGroup
	var n atomic.Int64
	for w := range workers {
		wg.Go(func() {
			for i := 0; ; i++ {
				select {
				case <-stop:
					return
				case <-ctx.Done():
					return
				default:
				}
				if limit > 0 && n.Load() >= limit {
					return
				}
				c := convs[(w+workers*i)%len(convs)]
				if _, err := send(ctx, pool, c, fmt.Sprintf("w%d-%d", w, i)); err != nil {
					time.Sleep(20 * time.Millisecond) // the server is restarting: back off, then go on
					continue
				}
				n.Add(1)
			}
		})
	}
	return func() int64 { wg.Wait(); return n.Load() }
}

// truth reads what agent_outbox holds: outbox id → conversation.
func truth(t *testing.T, pool *pgxpool.Pool) map[int64]string {
	t.Helper()
	rows, err := pool.Query(context.Background(), `SELECT id, conversation_id FROM agent_outbox`)
	require.NoError(t, err)
	want := map[int64]string{}
	for rows.Next() {
		var id int64
		var c string
		require.NoError(t, rows.Scan(&id, &c))
		want[id] = c
	}
	require.NoError(t, rows.Err())
	return want
}

func conversationIDs(n int) []string {
	ids := make([]string, n)
	for i := range ids {
		ids[i] = fmt.Sprintf("c%03d", i)
	}
	return ids
}

func TestKillLoopLosesAndDoublesNothing(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := ctxT(t, 5*time.Minute)
	convs := conversationIDs(50)
	createConversations(t, b.db.Pool, convs...)

	stop := make(chan struct{})
	// Each conversation belongs to one writer, so its rows commit in id order.
	wait := producers(ctx, t, b.db.Pool, convs, 5, 20000, stop)
	kills := 0
	for kills < 12 {
		p := b.startProcess(t)
		p.awaitStreaming(t)
		time.Sleep(time.Duration(50+rand.IntN(400)) * time.Millisecond) // a random moment of the load
		p.kill(t)
		kills++
	}
	written := wait()
	require.GreaterOrEqual(t, written, int64(20000))
	close(stop)
	b.startProcess(t)
	want := truth(t, b.db.Pool)
	require.Len(t, want, int(written))
	msgs := b.waitStream(t, "AGENT_TURNS", len(want), 2*time.Minute)
	assertExactlyOnceInOrder(t, msgs, want)
	t.Logf("%d kills, %d rows", kills, len(want))
}

func TestStandbyTakesOver(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := ctxT(t, 3*time.Minute)
	convs := conversationIDs(10)
	createConversations(t, b.db.Pool, convs...)
	first, second := b.startProcess(t), b.startProcess(t)
	var active, standby *relayProcess
	select {
	case <-first.streaming:
		active, standby = first, second
	case <-second.streaming:
		active, standby = second, first
	case <-time.After(time.Minute):
		t.Fatal("no relay became active")
	}
	_, err := send(ctx, b.db.Pool, "c000", "before")
	require.NoError(t, err)
	b.waitStream(t, "AGENT_TURNS", 1, 30*time.Second)
	select {
	case <-standby.streaming:
		t.Fatal("both relays stream")
	default:
	}

	active.kill(t)
	killed := time.Now()
	_, err = send(ctx, b.db.Pool, "c001", "after")
	require.NoError(t, err)
	b.waitStream(t, "AGENT_TURNS", 2, 10*time.Second)
	t.Logf("standby published %v after the kill", time.Since(killed).Round(time.Millisecond))
	assertExactlyOnceInOrder(t, b.readStream(t, "AGENT_TURNS"), truth(t, b.db.Pool))
}

// lsnOf reads an LSN as a number.
func lsnOf(t *testing.T, s string) uint64 {
	t.Helper()
	var hi, lo uint64
	_, err := fmt.Sscanf(s, "%X/%X", &hi, &lo)
	require.NoError(t, err, "lsn %q", s)
	return hi<<32 | lo
}

func TestNATSOutageConfirmsOnlyAcknowledged(t *testing.T) {
	t.Parallel()
	b := setup(t)
	if b.nats.External() {
		t.Fatalf("this test stops NATS: unset %s", testsvc.EnvNATSURL)
	}
	ctx := ctxT(t, 3*time.Minute)
	convs := conversationIDs(20)
	createConversations(t, b.db.Pool, convs...)
	b.startActive(t)

	// Writers record, after each commit, an LSN at or past its commit record.
	type written struct {
		id    int64
		upper uint64
	}
	var mu sync.Mutex
	var rows []written
	stop := make(chan struct{})
	var wg sync.WaitGroup
	for w := range 4 {
		wg.Go(func() {
			conn, err := b.db.Pool.Acquire(ctx)
			if !assertNoError(t, err) {
				return
			}
			defer conn.Release()
			for i := 0; ; i++ {
				select {
				case <-stop:
					return
				default:
				}
				id, err := send(ctx, conn, convs[(w+4*i)%len(convs)], fmt.Sprintf("w%d-%d", w, i))
				if !assertNoError(t, err) {
					return
				}
				var upper string
				if !assertNoError(t, conn.QueryRow(ctx, `SELECT pg_current_wal_insert_lsn()::text`).Scan(&upper)) {
					return
				}
				mu.Lock()
				rows = append(rows, written{id, lsnOf(t, upper)})
				mu.Unlock()
				time.Sleep(time.Millisecond)
			}
		})
	}
	require.Eventually(t, func() bool { return len(b.readStream(t, "AGENT_TURNS")) > 500 }, time.Minute, 50*time.Millisecond)

	b.nats.Stop()
	// After Stop returned: a message stored while the server was stopping was acknowledged
	// before it went away, and may be confirmed.
	stopped := time.Now()
	// During the outage the slot must not move past what JetStream acknowledged.
	var confirmedDuring uint64
	for end := time.Now().Add(10 * time.Second); time.Now().Before(end); time.Sleep(200 * time.Millisecond) {
		var s string
		require.NoError(t, b.db.Pool.QueryRow(ctx, `SELECT confirmed_flush_lsn::text FROM pg_replication_slots WHERE slot_name = $1`, b.cfg.Slot).Scan(&s))
		confirmedDuring = max(confirmedDuring, lsnOf(t, s))
	}
	require.NoError(t, b.nats.Start())
	time.Sleep(time.Second) // let the writers run on after the outage
	close(stop)
	wg.Wait()

	want := truth(t, b.db.Pool)
	msgs := b.waitStream(t, "AGENT_TURNS", len(want), 2*time.Minute)
	assertExactlyOnceInOrder(t, msgs, want)

	// Every row whose commit is certainly at or before the LSN confirmed during the outage was
	// stored before NATS stopped.
	storedAt := storedTimes(t, b)
	checked := 0
	for _, r := range rows {
		if r.upper > confirmedDuring {
			continue
		}
		at, ok := storedAt[r.id]
		require.True(t, ok)
		require.True(t, at.Before(stopped), "outbox %d confirmed during the outage but stored at %v, after the stop at %v", r.id, at, stopped)
		checked++
	}
	require.Greater(t, checked, 100, "the check covered too few rows to mean anything")
	t.Logf("rows %d, checked against the confirmed LSN %d", len(rows), checked)
}

// storedTimes maps outbox ids to the time JetStream stored their event.
func storedTimes(t *testing.T, b *bundle) map[int64]time.Time {
	t.Helper()
	out := map[int64]time.Time{}
	for _, m := range b.readStream(t, "AGENT_TURNS") {
		id, err := strconv.ParseInt(m.header.Get(wire.HeaderOutboxID), 10, 64)
		require.NoError(t, err)
		out[id] = m.stored
	}
	return out
}

func TestPostgresRestartAndTerminatedWalsender(t *testing.T) {
	t.Parallel()
	ctx := ctxT(t, 5*time.Minute)
	// A cluster of its own: this test restarts it.
	pg, err := testsvc.StartPostgres(ctx)
	require.NoError(t, err)
	t.Cleanup(func() { require.NoError(t, pg.Close()) })
	conn, err := pgx.Connect(ctx, pg.URL("postgres"))
	require.NoError(t, err)
	_, err = migrations.Up(ctx, conn)
	require.NoError(t, err)
	require.NoError(t, conn.Close(ctx))
	pool, err := pgxpool.New(ctx, pg.URL("postgres"))
	require.NoError(t, err)
	t.Cleanup(pool.Close)

	b := setup(t)
	b.cfg.DatabaseURL = pg.URL("postgres")
	b.cfg.Slot = "baton"
	b.db = &testsvc.Database{Name: "postgres", URL: pg.URL("postgres"), Pool: pool}
	convs := conversationIDs(20)
	createConversations(t, pool, convs...)
	r := b.startActive(t)

	stop := make(chan struct{})
	wait := producers(ctx, t, pool, convs, 4, 0, stop)
	waitRows := func(n int) {
		require.Eventually(t, func() bool { return len(b.readStream(t, "AGENT_TURNS")) >= n }, time.Minute, 50*time.Millisecond)
	}
	waitRows(300)

	// 1. The walsender is terminated, three times.
	for range 3 {
		var killed int
		require.NoError(t, pool.QueryRow(ctx, `SELECT count(pg_terminate_backend(active_pid)) FROM pg_replication_slots
			WHERE slot_name = 'baton' AND active_pid IS NOT NULL`).Scan(&killed))
		require.Equal(t, 1, killed)
		n := len(b.readStream(t, "AGENT_TURNS"))
		waitRows(n + 200) // it reconnected and streams again
	}
	// 2. Postgres restarted: a clean stop, then a crash.
	require.NoError(t, pg.Stop())
	require.NoError(t, pg.Start(ctx))
	n := len(b.readStream(t, "AGENT_TURNS"))
	waitRows(n + 200)
	require.NoError(t, pg.Crash())
	require.NoError(t, pg.Start(ctx))
	n = len(b.readStream(t, "AGENT_TURNS"))
	waitRows(n + 200)
	close(stop)
	wait()
	require.True(t, r.Active(), "the relay streams again after every fault")

	want := truth(t, pool)
	msgs := b.waitStream(t, "AGENT_TURNS", len(want), 2*time.Minute)
	assertExactlyOnceInOrder(t, msgs, want)
}

func TestIdleOutboxHoldsNoWAL(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := ctxT(t, 3*time.Minute)
	createConversations(t, b.db.Pool, "c")
	b.startActive(t)
	_, err := send(ctx, b.db.Pool, "c", "one")
	require.NoError(t, err)
	b.waitStream(t, "AGENT_TURNS", 1, 30*time.Second)

	// 200 MB of writes to a table the publication does not cover.
	_, err = b.db.Pool.Exec(ctx, `CREATE TABLE busy (v text)`)
	require.NoError(t, err)
	var start string
	require.NoError(t, b.db.Pool.QueryRow(ctx, `SELECT pg_current_wal_lsn()::text`).Scan(&start))
	for range 20 {
		_, err = b.db.Pool.Exec(ctx, `INSERT INTO busy SELECT repeat(md5(g::text), 30) FROM generate_series(1, 10000) g`)
		require.NoError(t, err)
	}
	var written int64
	require.NoError(t, b.db.Pool.QueryRow(ctx, `SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), $1::pg_lsn)::bigint`, start).Scan(&written))
	t.Logf("WAL written while the outbox was idle: %d MB", written>>20)
	require.Greater(t, written, int64(150<<20))

	// restart_lsn advances at the next running-xacts record; a checkpoint writes one.
	var retained int64
	require.Eventually(t, func() bool {
		_, err := b.db.Pool.Exec(ctx, `CHECKPOINT`)
		if err != nil {
			return false
		}
		err = b.db.Pool.QueryRow(ctx, `SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), restart_lsn)::bigint
			FROM pg_replication_slots WHERE slot_name = $1`, b.cfg.Slot).Scan(&retained)
		return err == nil && retained < 16<<20
	}, time.Minute, 200*time.Millisecond, "the slot retains %d MB of WAL for an idle outbox", retained>>20)
}
