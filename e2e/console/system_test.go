package console

import (
	"bufio"
	"context"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/batonhq/baton/internal/testsvc"
)

// system is one whole Baton for one test: its own database and NATS server, and `baton relay`,
// an echo agent and `baton console` as processes.
type system struct {
	t       *testing.T
	db      *testsvc.Database
	natsURL string
	console *process
	addr    string // the console's host:port, the same across restarts
}

// options change what start builds.
type options struct {
	// agentArgs are the echo agent's flags (its test hooks: --fail, --model-latency, ...).
	agentArgs []string
}

// start brings up the system and waits until the console answers.
func start(t *testing.T, o options) *system {
	t.Helper()
	s := &system{t: t, db: testsvc.NewDatabase(t), natsURL: testsvc.StartNATS(t).URL(), addr: freeAddr(t)}
	bins := testsvc.Binaries(t, "github.com/batonhq/baton/cmd/baton", "github.com/batonhq/baton/examples/echoagent")
	s.startProcess("relay", bins[0], "relay")
	s.startProcess("echoagent", bins[1], o.agentArgs...)
	s.console = s.startProcess("console", bins[0], "console")
	s.awaitConsole(time.Minute)
	return s
}

// url returns the console's address for path.
func (s *system) url(path string) string { return "http://" + s.addr + path }

// awaitConsole waits until the console answers /healthz.
func (s *system) awaitConsole(within time.Duration) {
	t := s.t
	t.Helper()
	deadline := time.Now().Add(within)
	for {
		resp, err := http.Get(s.url("/healthz")) //nolint:noctx // bounded by the loop's deadline and the client's default dial timeout
		if err == nil {
			_ = resp.Body.Close()
			if resp.StatusCode == http.StatusOK {
				return
			}
		}
		s.console.requireRunning(t)
		if time.Now().After(deadline) {
			t.Fatalf("the console did not answer /healthz within %v: %v", within, err)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// restartConsole starts the console again on the same address after stopConsole.
func (s *system) restartConsole() {
	s.t.Helper()
	s.console = s.startProcess("console", s.console.cmd.Path, "console")
	s.awaitConsole(time.Minute)
}

// stopConsole stops the console with SIGTERM and waits until it exited.
func (s *system) stopConsole() {
	s.t.Helper()
	require.NoError(s.t, s.console.cmd.Process.Signal(syscall.SIGTERM))
	select {
	case <-s.console.exited:
	case <-time.After(30 * time.Second):
		s.t.Fatal("the console did not stop within 30s of SIGTERM")
	}
}

// freeAddr returns a loopback address with a port free now.
func freeAddr(t *testing.T) string {
	t.Helper()
	var lc net.ListenConfig
	ln, err := lc.Listen(t.Context(), "tcp", "127.0.0.1:0")
	require.NoError(t, err)
	addr := ln.Addr().String()
	require.NoError(t, ln.Close())
	return addr
}

// process is a Baton program running as a child process, with its log lines kept.
type process struct {
	name   string
	cmd    *exec.Cmd
	exited chan struct{}
	err    error // cmd.Wait's result, set before exited is closed

	mu    sync.Mutex
	lines []string
}

// startProcess starts bin with args on the system's database and NATS server. The test's
// cleanup stops it with SIGTERM and requires a clean exit.
func (s *system) startProcess(name, bin string, args ...string) *process {
	t := s.t
	t.Helper()
	cmd := exec.Command(bin, args...)
	cmd.Env = append(os.Environ(),
		"BATON_DATABASE_URL="+s.db.URL,
		"BATON_NATS_URL="+s.natsURL,
		"BATON_SLOT="+s.db.Name, // slots are cluster-wide: one per test
		"BATON_CONSOLE_ADDR="+s.addr,
		"BATON_METRICS_ADDR=",
		"BATON_LOG_LEVEL=info",
		"BATON_LOG_FORMAT=json",
	)
	out, err := cmd.StderrPipe()
	require.NoError(t, err)
	cmd.Stdout = cmd.Stderr
	p := &process{name: name, cmd: cmd, exited: make(chan struct{})}
	require.NoError(t, cmd.Start())
	go func() {
		sc := bufio.NewScanner(out)
		sc.Buffer(make([]byte, 64<<10), 4<<20)
		for sc.Scan() {
			p.mu.Lock()
			p.lines = append(p.lines, sc.Text())
			p.mu.Unlock()
		}
		_, _ = io.Copy(io.Discard, out)
		p.err = cmd.Wait()
		close(p.exited)
	}()
	t.Cleanup(func() {
		select {
		case <-p.exited:
		default:
			_ = cmd.Process.Signal(syscall.SIGTERM)
			select {
			case <-p.exited:
				if p.err != nil {
					t.Errorf("%s did not stop cleanly on SIGTERM: %v", name, p.err)
				}
			case <-time.After(30 * time.Second):
				t.Errorf("%s did not stop within 30s of SIGTERM", name)
				_ = cmd.Process.Kill()
				<-p.exited
			}
		}
		if t.Failed() {
			t.Logf("%s log:\n%s", name, p.tail(16<<10))
		}
	})
	return p
}

// tail returns the last n bytes of the log.
func (p *process) tail(n int) string {
	p.mu.Lock()
	out := strings.Join(p.lines, "\n")
	p.mu.Unlock()
	return out[max(0, len(out)-n):]
}

// requireRunning fails the test when the process exited.
func (p *process) requireRunning(t *testing.T) {
	t.Helper()
	select {
	case <-p.exited:
		t.Fatalf("%s exited: %v\n%s", p.name, p.err, p.tail(4<<10))
	default:
	}
}

// ctxFor returns a context ending after d or with the test.
func ctxFor(t *testing.T, d time.Duration) context.Context {
	ctx, cancel := context.WithTimeout(t.Context(), d)
	t.Cleanup(cancel)
	return ctx
}
