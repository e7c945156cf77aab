package console

import (
	"context"
	"net/http"
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
	console *testsvc.Process
	addr    string // the console's host:port, the same across restarts (reservedAddr)
}

// options change what start builds.
type options struct {
	// agentArgs are the echo agent's flags (its test hooks: --fail, --model-latency, ...).
	agentArgs []string
}

// start brings up the system and waits until the console answers.
func start(t *testing.T, o options) *system {
	t.Helper()
	s := &system{t: t, db: testsvc.NewDatabase(t), natsURL: testsvc.StartNATS(t).URL(), addr: testsvc.ReservedAddr(t)}
	bins := testsvc.Binaries(t, "github.com/batonhq/baton/cmd/baton", "github.com/batonhq/baton/examples/echoagent")
	s.startProcess("relay", testsvc.RoleRelay, bins[0], "relay")
	s.startProcess("echoagent", testsvc.RoleWorker, bins[1], o.agentArgs...)
	s.console = s.startProcess("console", testsvc.RoleConsole, bins[0], "console")
	s.awaitConsole(time.Minute)
	return s
}

// url returns the console's address for path.
func (s *system) url(path string) string { return "http://" + s.addr + path }

// awaitConsole waits until the console says it listens, on the system's address, and answers
// /healthz.
func (s *system) awaitConsole(within time.Duration) {
	t := s.t
	t.Helper()
	deadline := time.Now().Add(within)
	line := s.console.WaitLog(t, "console on ", within)
	require.Contains(t, line, "console on http://"+s.addr+"/", "the console listens elsewhere than on the address it was given")
	for {
		resp, err := http.Get(s.url("/healthz")) //nolint:noctx // bounded by the loop's deadline and the client's default dial timeout
		if err == nil {
			_ = resp.Body.Close()
			if resp.StatusCode == http.StatusOK {
				return
			}
		}
		s.console.RequireRunning(t)
		if time.Now().After(deadline) {
			t.Fatalf("the console did not answer /healthz within %v: %v", within, err)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// restartConsole starts the console again on the same address after stopConsole.
func (s *system) restartConsole() {
	s.t.Helper()
	s.console = s.startProcess("console", testsvc.RoleConsole, s.console.Cmd.Path, "console")
	s.awaitConsole(time.Minute)
}

// stopConsole stops the console with SIGTERM and waits until it exited.
func (s *system) stopConsole() {
	s.t.Helper()
	require.NoError(s.t, s.console.Stop(30*time.Second))
}

// startProcess starts bin with args on the system's database, logged in as role (as deployed),
// and NATS server, the console on the system's address. The test's cleanup stops it with
// SIGTERM and requires a clean exit.
func (s *system) startProcess(name string, role testsvc.Role, bin string, args ...string) *testsvc.Process {
	return testsvc.StartProcess(s.t, name, bin, []string{
		"BATON_DATABASE_URL=" + s.db.RoleURL(role),
		"BATON_NATS_URL=" + s.natsURL,
		"BATON_SLOT=" + s.db.Name, // slots are cluster-wide: one per test
		"BATON_CONSOLE_ADDR=" + s.addr,
		"BATON_METRICS_ADDR=",
		"BATON_LOG_LEVEL=info",
		"BATON_LOG_FORMAT=json",
	}, args...)
}

// ctxFor returns a context ending after d or with the test.
func ctxFor(t *testing.T, d time.Duration) context.Context {
	ctx, cancel := context.WithTimeout(t.Context(), d)
	t.Cleanup(cancel)
	return ctx
}
