package main

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"flag"
	"fmt"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"regexp"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/batonhq/baton/consumer"
	"github.com/batonhq/baton/internal/testsvc"
	"github.com/batonhq/baton/internal/throwaway"
)

// demoProcessEnv makes TestDemoProcess run `baton` with the arguments after "--".
const demoProcessEnv = "BATON_DEMO_TEST_PROCESS"

// TestDemoProcess is not a test of its own: it is the process the demo tests start. They
// re-execute this test binary with demoProcessEnv set and the baton arguments after "--",
// so the demo runs as a real process (signals, exit code, child servers) built from this
// package, race detector included.
func TestDemoProcess(_ *testing.T) {
	if os.Getenv(demoProcessEnv) != "1" {
		return
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	code := run(ctx, flag.Args(), os.Stdout, os.Stderr)
	stop()
	os.Exit(code)
}

// demoProcess is a running `baton demo`.
type demoProcess struct {
	cmd      *exec.Cmd
	tmp      string        // its TMPDIR: every temp dir it creates is in here
	progress chan struct{} // closed at the first progress line
	exited   chan struct{} // closed when it exited and its stdout was read

	mu     sync.Mutex
	stdout strings.Builder
	stderr bytes.Buffer // written by exec's copier; read after exited
}

// startDemo runs `baton demo args...` with no BATON_DATABASE_URL or BATON_NATS_URL, so it
// starts its own PostgreSQL and NATS, and with TMPDIR set to a directory of the test's.
func startDemo(t *testing.T, args ...string) *demoProcess {
	t.Helper()
	// Not t.TempDir: when running as root the cluster runs as user postgres, which must be able
	// to enter the directory holding its data directory.
	tmp, err := os.MkdirTemp("", "baton-demo-test-")
	require.NoError(t, err)
	require.NoError(t, os.Chmod(tmp, 0o755))
	t.Cleanup(func() { _ = os.RemoveAll(tmp) })

	cmd := exec.Command(os.Args[0], append([]string{"-test.run=^TestDemoProcess$", "--", "demo"}, args...)...)
	for _, kv := range os.Environ() {
		if strings.HasPrefix(kv, "BATON_") || strings.HasPrefix(kv, "TMPDIR=") {
			continue
		}
		cmd.Env = append(cmd.Env, kv)
	}
	cmd.Env = append(cmd.Env, demoProcessEnv+"=1", "TMPDIR="+tmp)
	p := &demoProcess{cmd: cmd, tmp: tmp, progress: make(chan struct{}), exited: make(chan struct{})}
	cmd.Stderr = &p.stderr
	stdout, err := cmd.StdoutPipe()
	require.NoError(t, err)
	require.NoError(t, cmd.Start())
	go func() {
		defer close(p.exited)
		var once sync.Once
		sc := bufio.NewScanner(stdout)
		for sc.Scan() {
			p.mu.Lock()
			p.stdout.WriteString(sc.Text() + "\n")
			p.mu.Unlock()
			if strings.HasPrefix(sc.Text(), "progress:") {
				once.Do(func() { close(p.progress) })
			}
		}
		_ = cmd.Wait()
	}()
	t.Cleanup(func() {
		select {
		case <-p.exited:
		default:
			_ = cmd.Process.Kill()
			<-p.exited
		}
	})
	return p
}

func (p *demoProcess) output() string {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.stdout.String()
}

// wait waits up to timeout for the process to exit and returns its exit code.
func (p *demoProcess) wait(t *testing.T, timeout time.Duration) int {
	t.Helper()
	select {
	case <-p.exited:
	case <-time.After(timeout):
		_ = p.cmd.Process.Kill()
		<-p.exited
		t.Fatalf("baton demo did not exit within %s\nstdout:\n%s\nstderr:\n%s", timeout, p.output(), p.stderr.String())
	}
	return p.cmd.ProcessState.ExitCode()
}

// requireCleanedUp checks that the demo left no temp dir and no process behind: its TMPDIR is
// empty and no process runs from, or names, a path inside it (a PostgreSQL server's command
// line names its data directory; its backends' working directory is that directory).
func (p *demoProcess) requireCleanedUp(t *testing.T) {
	t.Helper()
	out := p.output()
	m := regexp.MustCompile(`data in (\S+) `).FindStringSubmatch(out)
	require.NotNil(t, m, "the demo names its PostgreSQL data dir:\n%s", out)
	require.True(t, strings.HasPrefix(m[1], p.tmp+string(filepath.Separator)+"baton-pg-"), m[1])

	entries, err := os.ReadDir(p.tmp)
	require.NoError(t, err)
	var left []string
	for _, e := range entries {
		left = append(left, e.Name())
	}
	require.Empty(t, left, "temp dirs left behind in %s", p.tmp)
	require.Empty(t, processesUsing(t, p.tmp), "processes left behind")
}

// processesUsing lists the processes whose command line or working directory holds dir.
func processesUsing(t *testing.T, dir string) []string {
	t.Helper()
	pids, err := filepath.Glob("/proc/[0-9]*")
	require.NoError(t, err)
	var found []string
	for _, proc := range pids {
		cmdline, _ := os.ReadFile(filepath.Join(proc, "cmdline"))
		cwd, _ := os.Readlink(filepath.Join(proc, "cwd"))
		line := string(bytes.ReplaceAll(cmdline, []byte{0}, []byte{' '}))
		if strings.Contains(line, dir) || strings.HasPrefix(cwd, dir) {
			found = append(found, fmt.Sprintf("%s: %s (cwd %s)", filepath.Base(proc), line, cwd))
		}
	}
	return found
}

func TestDemoRunsAndCleansUp(t *testing.T) {
	t.Parallel()
	p := startDemo(t, "--messages", "300", "--conversations", "20", "--rate", "0")
	code := p.wait(t, 3*time.Minute)
	out := p.output()
	require.Equal(t, 0, code, "stdout:\n%s\nstderr:\n%s", out, p.stderr.String())
	for _, want := range []string{
		"workers demo-worker-1 and demo-worker-2 consuming AGENT_TURNS",
		"outcome subscriber reading AGENT_OUTCOMES",
		"sent: 300 messages to 20 conversations",
		"retries accepted as duplicates: 15 of 15",
		"outbox rows: 300 for 300 accepted messages",
		"relayed: 300 of 300 accepted messages in stream AGENT_TURNS\n",
		"replied: 300 (answered by an assistant reply in stream AGENT_OUTCOMES)\n",
		"failed visibly: 0 (",
		"lost: 0\n",
		"duplicates: 0 (turn events stored twice 0, outcomes stored twice 0, messages answered twice 0)\n",
		"commit→reply latency: p50 ",
		"over 300 replied messages",
		"database side: p50 ",
		"turns: demo-worker-",
		"result: OK: every accepted message reached JetStream once and got exactly one outcome",
	} {
		require.Contains(t, out, want)
	}
	require.Regexp(t, `; [1-9][0-9]* lookup operations recorded\n`, out)
	require.NotContains(t, out, "interrupted")
	require.NotContains(t, out, "unfinished")
	p.requireCleanedUp(t)
}

func TestDemoStopsCleanlyOnInterrupt(t *testing.T) {
	t.Parallel()
	p := startDemo(t, "--messages", "100000", "--rate", "200")
	select {
	case <-p.progress:
	case <-p.exited:
		t.Fatalf("baton demo exited before its first progress line\nstdout:\n%s\nstderr:\n%s", p.output(), p.stderr.String())
	case <-time.After(3 * time.Minute):
		t.Fatalf("no progress line within 3m\nstdout:\n%s", p.output())
	}
	require.NoError(t, p.cmd.Process.Signal(os.Interrupt))
	start := time.Now()
	code := p.wait(t, time.Minute)
	out := p.output()
	require.Equal(t, 0, code, "a user's Ctrl-C is a clean stop\nstdout:\n%s\nstderr:\n%s", out, p.stderr.String())
	t.Logf("exited %s after SIGINT", time.Since(start).Round(time.Millisecond))
	for _, want := range []string{
		"interrupted: stopped sending after ",
		"duplicates: 0 (",
		"lost: 0\n",
		"unfinished (interrupted): ",
		"result: OK so far (interrupted)",
	} {
		require.Contains(t, out, want)
	}
	require.NotContains(t, out, "sent: 100000 messages")
	p.requireCleanedUp(t)
}

// TestDemoWithGivenServers runs the demo in this process against servers it did not start,
// twice: the second run finds the slot, the workers' durable consumer and streams holding the
// first run's events, and counts only its own.
func TestDemoWithGivenServers(t *testing.T) {
	t.Parallel()
	db := testsvc.NewDatabase(t)
	ns := testsvc.StartNATS(t)
	for range 2 {
		// A prefix of its own: with BATON_TEST_NATS_URL the server is shared, and workers of
		// another test's database must not take this one's turn events.
		r := runBaton(t, "demo", "--database-url", db.URL, "--nats-url", ns.URL(), "--slot", db.Name,
			"--subject-prefix", db.Name, "--messages", "200", "--conversations", "5", "--rate", "0")
		require.Equal(t, 0, r.code, "stdout:\n%s\nstderr:\n%s", r.stdout, r.stderr)
		require.Contains(t, r.stdout, "using the PostgreSQL at")
		require.Contains(t, r.stdout, "using the NATS server at")
		require.Contains(t, r.stdout, "relayed: 200 of 200 accepted messages")
		require.Contains(t, r.stdout, "outbox rows: 200 for 200 accepted messages")
		require.Contains(t, r.stdout, "replied: 200 (")
		require.Contains(t, r.stdout, "lost: 0\n")
		require.Contains(t, r.stdout, "duplicates: 0 (")
	}
	var rows, done int
	require.NoError(t, db.Pool.QueryRow(context.Background(),
		`SELECT count(*), count(*) FILTER (WHERE status = 'done') FROM agent_outbox WHERE message_id LIKE 'demo-%'`).Scan(&rows, &done))
	require.Equal(t, 400, rows)
	require.Equal(t, 400, done)
}

// TestDemoFailEvery makes every turn of every 5th conversation fail: those messages end as
// visible failures, the others as replies, none lost.
func TestDemoFailEvery(t *testing.T) {
	t.Parallel()
	db := testsvc.NewDatabase(t)
	ns := testsvc.StartNATS(t)
	r := runBaton(t, "demo", "--database-url", db.URL, "--nats-url", ns.URL(), "--slot", db.Name,
		"--subject-prefix", db.Name, "--messages", "200", "--conversations", "10", "--rate", "0", "--fail-every", "5")
	require.Equal(t, 0, r.code, "stdout:\n%s\nstderr:\n%s", r.stdout, r.stderr)
	// Conversations 4 and 9 of 0..9 fail: the messages i with i%10 in {4, 9}.
	for _, want := range []string{
		"every turn of every 5th conversation fails on purpose",
		"relayed: 200 of 200 accepted messages",
		"replied: 160 (",
		"failed visibly: 40 (an error message in the conversation, after 2 attempts; --fail-every 5)\n",
		"lost: 0\n",
		"duplicates: 0 (",
		"result: OK",
	} {
		require.Contains(t, r.stdout, want)
	}

	ctx := context.Background()
	// Attempts count per row: every failed row used its own two.
	var errRows, errMsgs, failedConvs, minAttempts, maxAttempts, detailed int
	require.NoError(t, db.Pool.QueryRow(ctx, `SELECT count(*), count(DISTINCT conversation_id), min(attempts), max(attempts),
		count(*) FILTER (WHERE last_error LIKE '%--fail-every%') FROM agent_outbox WHERE status = 'error'`).
		Scan(&errRows, &failedConvs, &minAttempts, &maxAttempts, &detailed))
	require.Equal(t, 40, errRows)
	require.Equal(t, 2, failedConvs)
	require.Equal(t, 2, minAttempts)
	require.Equal(t, 2, maxAttempts)
	require.Equal(t, 40, detailed, "the detail is kept for operators")
	// Users see a generic message, never the error's text.
	require.NoError(t, db.Pool.QueryRow(ctx, `SELECT count(*) FROM messages WHERE role = 'error'
		AND content = $1`, consumer.DefaultFailureMessage(nil)).Scan(&errMsgs))
	require.Positive(t, errMsgs)
	require.Zero(t, testsvc.Query[int](t, db, `SELECT count(*)::int FROM messages WHERE role = 'error' AND content <> $1`,
		consumer.DefaultFailureMessage(nil))[0])
}

func TestDemoUsageErrors(t *testing.T) {
	t.Parallel()
	for _, tt := range []struct {
		args   []string
		stderr string
	}{
		{[]string{"demo", "--messages", "0"}, "--messages must be at least 1"},
		{[]string{"demo", "--conversations", "0"}, "--conversations must be at least 1"},
		{[]string{"demo", "--rate", "-1"}, "--rate must not be negative"},
		{[]string{"demo", "--tail-timeout", "0s"}, "--tail-timeout must be positive"},
		{[]string{"demo", "--model-latency", "-1s"}, "--model-latency must not be negative"},
		{[]string{"demo", "--fail-every", "-1"}, "--fail-every must not be negative"},
		{[]string{"demo", "extra"}, `unexpected argument "extra"`},
	} {
		r := runBaton(t, tt.args...)
		require.Equal(t, 2, r.code, r.stderr)
		require.Contains(t, r.stderr, tt.stderr)
		require.Empty(t, r.stdout)
	}

	r := runBaton(t, "help", "demo")
	require.Equal(t, 0, r.code)
	for _, flag := range []string{"-messages", "-conversations", "-rate", "-tail-timeout", "-model-latency",
		"-fail-every", "-database-url", "-log-level"} {
		require.Contains(t, r.stdout, flag)
	}
	require.Contains(t, r.stdout, "WRITES TO THAT DATABASE")
}

func TestDemoNoPostgresError(t *testing.T) {
	t.Parallel()
	msg := noPostgresError(throwaway.ErrNoPostgres).Error()
	require.Contains(t, msg, "apt-get install -y postgresql")
	require.Contains(t, msg, "BATON_DATABASE_URL")
	require.NotContains(t, msg, "BATON_TEST_DATABASE_URL", "the demo does not read the tests' variable")

	other := errors.New("initdb: exit status 1")
	require.ErrorIs(t, noPostgresError(other), other)
}

func TestIsTerminal(t *testing.T) {
	t.Parallel()
	require.False(t, isTerminal(&bytes.Buffer{}))
	f, err := os.CreateTemp(t.TempDir(), "out")
	require.NoError(t, err)
	defer func() { _ = f.Close() }()
	require.False(t, isTerminal(f))
}
