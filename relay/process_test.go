package relay_test

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/batonhq/baton/internal/opsserver"
	"github.com/batonhq/baton/internal/testsvc"
	"github.com/batonhq/baton/migrations"
	"github.com/batonhq/baton/relay"
	"github.com/batonhq/baton/wire"
)

// peakRSS reads a process's peak resident set size.
func peakRSS(t *testing.T, pid int) int64 {
	t.Helper()
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	require.NoError(t, err)
	for line := range strings.SplitSeq(string(b), "\n") {
		if rest, ok := strings.CutPrefix(line, "VmHWM:"); ok {
			kb, err := strconv.ParseInt(strings.TrimSpace(strings.TrimSuffix(strings.TrimSpace(rest), "kB")), 10, 64)
			require.NoError(t, err)
			return kb << 10
		}
	}
	t.Fatal("no VmHWM in /proc status")
	return 0
}

// awaitListening waits until one of the lines a process logged so far (lines) says where it
// listens for msg, and returns that address. It fails the test when the process exits first
// (exited closes once every line was read) or after a minute.
func awaitListening(t *testing.T, msg string, lines func() []string, exited <-chan struct{}) string {
	t.Helper()
	find := func() (string, bool) {
		for _, l := range lines() {
			if addr, ok := opsserver.ListeningAddr(l, msg); ok {
				return addr, true
			}
		}
		return "", false
	}
	deadline := time.NewTimer(time.Minute)
	defer deadline.Stop()
	tick := time.NewTicker(10 * time.Millisecond)
	defer tick.Stop()
	for {
		if addr, ok := find(); ok {
			return addr
		}
		select {
		case <-exited:
			if addr, ok := find(); ok {
				return addr
			}
			t.Fatalf("the relay exited without logging %q; log:\n%s", msg, strings.Join(lines(), "\n"))
		case <-deadline.C:
			t.Fatalf("the relay did not log %q within a minute; log:\n%s", msg, strings.Join(lines(), "\n"))
		case <-tick.C:
		}
	}
}

// metricsAddr returns where the relay serves its metrics, once it logged it.
func (p *haProcess) metricsAddr(t *testing.T) string {
	t.Helper()
	return awaitListening(t, opsserver.MetricsListening, func() []string {
		p.mu.Lock()
		defer p.mu.Unlock()
		return slices.Clone(p.seen)
	}, p.exited)
}

func httpGet(t *testing.T, url string) (int, string) {
	t.Helper()
	req, err := http.NewRequestWithContext(ctxT(t, 10*time.Second), http.MethodGet, url, nil)
	require.NoError(t, err)
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return 0, err.Error()
	}
	defer func() { _ = resp.Body.Close() }()
	body, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, string(body)
}

func TestLargeTransactionWithBoundedMemory(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := ctxT(t, 5*time.Minute)
	convs := conversationIDs(100)
	createConversations(t, b.db.Pool, convs...)
	p := b.startProcess(t)
	p.awaitStreaming(t)
	// One transaction of 100k outbox rows, each with a 1 KiB user message.
	_, err := b.db.Pool.Exec(ctx, `WITH m AS (
			INSERT INTO messages (id, conversation_id, role, content)
			SELECT 'big-' || g, 'c' || lpad((g % 100)::text, 3, '0'), 'user', repeat('x', 1024)
			FROM generate_series(1, 100000) g RETURNING id, conversation_id)
		INSERT INTO agent_outbox (conversation_id, message_id) SELECT conversation_id, id FROM m ORDER BY id`)
	require.NoError(t, err)
	// Counted, not read back: reading 100k events cost CI about ten seconds, and Nats-Msg-Id
	// deduplication makes the count exact.
	require.Equal(t, uint64(100000), b.waitStreamCount(t, "AGENT_TURNS", 100000, 3*time.Minute))
	rss := peakRSS(t, p.cmd.Process.Pid)
	t.Logf("relay peak RSS after a 100k-row transaction: %d MiB", rss>>20)
	require.Less(t, rss, int64(64<<20), "the relay's memory must not grow with the transaction")
}

func TestGracefulStopConfirmsAndExitsZero(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := ctxT(t, 3*time.Minute)
	convs := conversationIDs(20)
	createConversations(t, b.db.Pool, convs...)

	cmd := exec.Command(batonBinary(t), "relay", "--metrics-addr", opsserver.AnyPort)
	cmd.Env = append(os.Environ(), "BATON_DATABASE_URL="+b.cfg.DatabaseURL, "BATON_NATS_URL="+b.nats.URL(),
		"BATON_SLOT="+b.cfg.Slot, "BATON_LOG_FORMAT=json")
	stderr, err := cmd.StderrPipe()
	require.NoError(t, err)
	require.NoError(t, cmd.Start())
	t.Cleanup(func() { _ = cmd.Process.Kill() })
	lines := make(chan string, 1000)
	bound := make(chan string, 1) // the metrics address, once logged; closed when the log ends
	go func() {
		sc := bufio.NewScanner(stderr)
		logged := false
		for sc.Scan() {
			if a, ok := opsserver.ListeningAddr(sc.Text(), opsserver.MetricsListening); ok && !logged {
				logged = true
				bound <- a
			}
			select {
			case lines <- sc.Text():
			default:
			}
		}
		close(lines)
		close(bound)
	}()
	var addr string
	select {
	case a, ok := <-bound:
		require.True(t, ok, "the relay's log ended before it said where it serves metrics")
		addr = a
	case <-time.After(time.Minute):
		t.Fatal("the relay did not log where it serves metrics within a minute")
	}

	// Ready once streaming; health answers throughout.
	require.Eventually(t, func() bool { code, _ := httpGet(t, "http://"+addr+"/readyz"); return code == 200 }, time.Minute, 20*time.Millisecond)
	code, _ := httpGet(t, "http://"+addr+"/healthz")
	require.Equal(t, 200, code)

	stop := make(chan struct{})
	wait := producers(ctx, t, b.db.Pool, convs, 4, 0, stop)
	require.Eventually(t, func() bool { return len(b.readStream(t, "AGENT_TURNS")) > 300 }, time.Minute, 20*time.Millisecond)

	code, metrics := httpGet(t, "http://"+addr+"/metrics")
	require.Equal(t, 200, code)
	for _, name := range []string{"baton_relay_events_total{kind=\"turn\"}", "baton_relay_publish_seconds_bucket",
		"baton_relay_commit_to_ack_seconds_bucket", "baton_relay_confirmed_lsn", "baton_relay_slot_lag_bytes",
		"baton_relay_in_flight", "baton_relay_active 1", "baton_relay_reconnects_total", "baton_relay_slot_lost 0"} {
		require.Contains(t, metrics, name)
	}

	require.NoError(t, cmd.Process.Signal(syscall.SIGTERM))
	require.NoError(t, cmd.Wait(), "SIGTERM must end the relay with exit 0")
	close(stop)
	wait()
	for l := range lines {
		require.NotContains(t, l, `"level":"ERROR"`)
	}

	// What it published is confirmed: the slot's position covers every event in the stream,
	// and a new relay publishes the rest without doubling anything.
	published := len(b.readStream(t, "AGENT_TURNS"))
	var confirmed string
	require.NoError(t, b.db.Pool.QueryRow(ctx, `SELECT confirmed_flush_lsn::text FROM pg_replication_slots WHERE slot_name = $1`, b.cfg.Slot).Scan(&confirmed))
	require.NotEqual(t, "0/0", confirmed)
	t.Logf("stopped after %d events at %s", published, confirmed)
	b.startActive(t)
	want := truth(t, b.db.Pool)
	assertExactlyOnceInOrder(t, b.waitStream(t, "AGENT_TURNS", len(want), time.Minute), want)
}

func TestLostSlotIsLoudAndRecoverable(t *testing.T) {
	t.Parallel()
	ctx := ctxT(t, 3*time.Minute)
	// A cluster of its own: the slot WAL cap is cluster-wide.
	pg, conn := ownCluster(t, ctx)
	_, err := conn.Exec(ctx, `ALTER SYSTEM SET max_slot_wal_keep_size = '1MB'`)
	require.NoError(t, err)
	_, err = conn.Exec(ctx, `SELECT pg_reload_conf()`)
	require.NoError(t, err)
	_, err = conn.Exec(ctx, `INSERT INTO conversations (id) VALUES ('c')`)
	require.NoError(t, err)

	b := setup(t)
	b.cfg.DatabaseURL = pg.URL("postgres")
	b.cfg.Slot = "baton"
	b.db = &testsvc.Database{Name: "postgres", URL: pg.URL("postgres")}
	r, err := relay.New(b.cfg)
	require.NoError(t, err)
	runCtx, cancel := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- r.Run(runCtx) }()
	require.Eventually(t, r.Active, time.Minute, 10*time.Millisecond)
	cancel()
	require.NoError(t, <-done)

	// While no relay runs, a row is committed and then far more WAL than the cap is written.
	_, err = send(ctx, conn, "c", "lost-1")
	require.NoError(t, err)
	_, err = conn.Exec(ctx, `CREATE TABLE filler (v text)`)
	require.NoError(t, err)
	require.Eventually(t, func() bool {
		_, err := conn.Exec(ctx, `INSERT INTO filler SELECT repeat('x', 500) FROM generate_series(1, 20000); SELECT pg_switch_wal(); CHECKPOINT; CHECKPOINT`)
		require.NoError(t, err)
		var status string
		require.NoError(t, conn.QueryRow(ctx, `SELECT wal_status FROM pg_replication_slots WHERE slot_name = 'baton'`).Scan(&status))
		return status == "lost"
	}, time.Minute, 10*time.Millisecond)

	// The relay refuses, loudly: an error that says what to do, a metric that stays scrapeable
	// until it exits, a non-zero exit.
	p := startFatalProcess(t, "BATON_DATABASE_URL="+pg.URL("postgres"), "BATON_NATS_URL="+b.nats.URL(),
		"BATON_METRICS_ADDR="+opsserver.AnyPort, "BATON_FATAL_LINGER=10m")
	p.requireLingering(t, `baton_relay_slot_lost 1`, `baton_relay_fatal{reason="slot_lost"} 1`)
	require.NoError(t, p.cmd.Process.Signal(syscall.SIGTERM))
	require.Equal(t, 1, p.exitCode(t, 30*time.Second), "SIGTERM during the linger exits with the error's status")
	rec := p.errorRecord(t)
	require.Contains(t, rec["error"], "replication slot lost")
	require.Contains(t, rec["error"], "pg_drop_replication_slot")
	require.Equal(t, "10m0s", rec["exit_in"])

	// The documented recovery: drop the slot; the relay recreates it and backfills the row.
	_, err = conn.Exec(ctx, `SELECT pg_drop_replication_slot('baton')`)
	require.NoError(t, err)
	b.startActive(t)
	msgs := b.waitStream(t, "AGENT_TURNS", 1, time.Minute)
	require.Equal(t, wire.TurnMsgID(1), msgs[0].header.Get("Nats-Msg-Id"))
	t.Cleanup(func() { _, _ = conn.Exec(context.Background(), `SELECT pg_drop_replication_slot('baton')`) })
}

// fatalProcess is `baton relay` run to stop on an error no retry can fix, logging JSON.
type fatalProcess struct {
	cmd    *exec.Cmd
	stderr testsvc.Buffer
	exited chan struct{}
}

func startFatalProcess(t *testing.T, env ...string) *fatalProcess {
	t.Helper()
	cmd := exec.Command(batonBinary(t), "relay")
	cmd.Env = append(append(os.Environ(), "BATON_LOG_FORMAT=json"), env...)
	p := &fatalProcess{cmd: cmd, exited: make(chan struct{})}
	cmd.Stderr = &p.stderr
	require.NoError(t, cmd.Start())
	go func() { _ = cmd.Wait(); close(p.exited) }()
	t.Cleanup(func() {
		_ = cmd.Process.Kill()
		<-p.exited
	})
	return p
}

// exitCode waits up to within for the process to exit and returns its exit status.
func (p *fatalProcess) exitCode(t *testing.T, within time.Duration) int {
	t.Helper()
	select {
	case <-p.exited:
	case <-time.After(within):
		t.Fatalf("relay did not exit within %s; log:\n%s", within, p.stderr.String())
	}
	return p.cmd.ProcessState.ExitCode()
}

// metricsAddr returns where the process serves its metrics, once it logged it.
func (p *fatalProcess) metricsAddr(t *testing.T) string {
	t.Helper()
	return awaitListening(t, opsserver.MetricsListening, func() []string {
		return strings.Split(p.stderr.String(), "\n")
	}, p.exited)
}

// requireLingering waits until the process serves metrics showing every one of want, then
// checks that it is alive and not ready.
func (p *fatalProcess) requireLingering(t *testing.T, want ...string) {
	t.Helper()
	addr := p.metricsAddr(t)
	require.Eventually(t, func() bool {
		code, metrics := httpGet(t, "http://"+addr+"/metrics")
		if code != http.StatusOK {
			return false
		}
		for _, w := range want {
			if !strings.Contains(metrics, w) {
				return false
			}
		}
		return true
	}, time.Minute, 20*time.Millisecond, "metrics never showed %v; log:\n%s", want, p.stderr.String())
	code, _ := httpGet(t, "http://"+addr+"/healthz")
	require.Equal(t, http.StatusOK, code, "alive while it lingers")
	code, _ = httpGet(t, "http://"+addr+"/readyz")
	require.Equal(t, http.StatusServiceUnavailable, code, "not ready while it lingers")
}

// errorRecord checks that every line the process logged is a JSON record (nothing printed
// raw) and that exactly one is at ERROR, and returns that one.
func (p *fatalProcess) errorRecord(t *testing.T) map[string]any {
	t.Helper()
	var errs []map[string]any
	for line := range strings.SplitSeq(strings.TrimSpace(p.stderr.String()), "\n") {
		var rec map[string]any
		require.NoError(t, json.Unmarshal([]byte(line), &rec), "a log line that is not a JSON record: %s", line)
		if rec["level"] == "ERROR" {
			errs = append(errs, rec)
		}
	}
	require.Len(t, errs, 1, "one ERROR record; log:\n%s", p.stderr.String())
	return errs[0]
}

// After an error no retry can fix, `baton relay` keeps serving /metrics and /healthz, with
// /readyz not ready, for BATON_FATAL_LINGER, then exits non-zero; SIGTERM ends the linger at
// once. With a linger of 0, or no metrics address, it exits at once. Either way the error is
// logged once, as a record in the configured format, saying when it will exit.
func TestFatalErrorLingersWithMetrics(t *testing.T) {
	t.Parallel()
	b := setup(t)
	env := func(more ...string) []string {
		return append([]string{"BATON_DATABASE_URL=" + b.db.URL, "BATON_NATS_URL=" + b.nats.URL(),
			"BATON_SLOT=" + b.cfg.Slot, "BATON_PUBLICATION=no_such_publication"}, more...)
	}
	requireSetupRecord := func(t *testing.T, p *fatalProcess, exitIn string) {
		t.Helper()
		rec := p.errorRecord(t)
		require.Contains(t, rec["error"], `publication "no_such_publication" does not exist`)
		require.Equal(t, exitIn, rec["exit_in"])
	}

	t.Run("SIGTERM ends the linger", func(t *testing.T) {
		t.Parallel()
		p := startFatalProcess(t, env("BATON_METRICS_ADDR="+opsserver.AnyPort, "BATON_FATAL_LINGER=10m")...)
		p.requireLingering(t, `baton_relay_fatal{reason="setup"} 1`, `baton_relay_fatal{reason="slot_lost"} 0`,
			"baton_relay_slot_lost 0")
		require.NoError(t, p.cmd.Process.Signal(syscall.SIGTERM))
		require.Equal(t, 1, p.exitCode(t, 30*time.Second))
		requireSetupRecord(t, p, "10m0s")
	})
	t.Run("the linger ends", func(t *testing.T) {
		t.Parallel()
		p := startFatalProcess(t, env("BATON_METRICS_ADDR="+opsserver.AnyPort, "BATON_FATAL_LINGER=1s")...)
		require.Equal(t, 1, p.exitCode(t, time.Minute))
		requireSetupRecord(t, p, "1s")
	})
	// Bounds well below the default linger of 2m: these exit at once.
	t.Run("no linger", func(t *testing.T) {
		t.Parallel()
		p := startFatalProcess(t, env("BATON_METRICS_ADDR="+opsserver.AnyPort, "BATON_FATAL_LINGER=0")...)
		require.Equal(t, 1, p.exitCode(t, 30*time.Second))
		requireSetupRecord(t, p, "0s")
	})
	t.Run("no metrics address", func(t *testing.T) {
		t.Parallel()
		p := startFatalProcess(t, env("BATON_METRICS_ADDR=", "BATON_FATAL_LINGER=10m")...)
		require.Equal(t, 1, p.exitCode(t, 30*time.Second))
		requireSetupRecord(t, p, "0s")
	})
}

func TestStartupChecksNameTheProblem(t *testing.T) {
	t.Parallel()
	ctx := ctxT(t, 2*time.Minute)
	b := setup(t)

	// A role without REPLICATION (refused, as it should be).
	b.db.AllowPrivilegeErrors()
	_, err := b.db.Pool.Exec(ctx, `CREATE ROLE `+b.db.Name+`_app LOGIN`)
	require.NoError(t, err)
	t.Cleanup(func() {
		_, _ = b.db.Pool.Exec(context.Background(), `DROP OWNED BY `+b.db.Name+`_app; DROP ROLE `+b.db.Name+`_app`)
	})
	cfg := b.cfg
	cfg.DatabaseURL = strings.Replace(b.db.URL, "postgres@", b.db.Name+"_app@", 1)
	r, err := relay.New(cfg)
	require.NoError(t, err)
	err = r.Run(ctx)
	require.ErrorIs(t, err, relay.ErrSetup)
	require.ErrorContains(t, err, "may not replicate")

	// wal_level below logical, on a cluster of its own.
	pg, err := testsvc.StartPostgres(ctx)
	require.NoError(t, err)
	t.Cleanup(func() { require.NoError(t, pg.Close()) })
	conn, err := pgx.Connect(ctx, pg.URL("postgres"))
	require.NoError(t, err)
	_, err = conn.Exec(ctx, `ALTER SYSTEM SET wal_level = 'replica'`)
	require.NoError(t, err)
	require.NoError(t, conn.Close(ctx))
	require.NoError(t, pg.Stop())
	require.NoError(t, pg.Start(ctx))
	cfg = b.cfg
	cfg.DatabaseURL = pg.URL("postgres")
	r, err = relay.New(cfg)
	require.NoError(t, err)
	err = r.Run(ctx)
	require.ErrorIs(t, err, relay.ErrSetup)
	require.ErrorContains(t, err, `wal_level is "replica"`)
}

// ownCluster starts a throwaway cluster for this test alone (for settings that are
// cluster-wide), migrates its postgres database and returns it with a connection to it.
func ownCluster(t *testing.T, ctx context.Context) (*testsvc.Postgres, *pgx.Conn) {
	t.Helper()
	pg, err := testsvc.StartPostgres(ctx)
	require.NoError(t, err)
	t.Cleanup(func() { require.NoError(t, pg.Close()) })
	conn, err := pgx.Connect(ctx, pg.URL("postgres"))
	require.NoError(t, err)
	t.Cleanup(func() { _ = conn.Close(context.Background()) })
	_, err = migrations.Up(ctx, conn)
	require.NoError(t, err)
	return pg, conn
}
