// Package testsvc gives Baton's tests the real services they talk to: a throwaway PostgreSQL
// cluster with a migrated database per test, and a NATS server with JetStream per test, started
// by internal/throwaway. A test owns what it starts and can stop, crash and restart it on the same
// port and data directory.
//
// BATON_TEST_DATABASE_URL and BATON_TEST_NATS_URL point tests at existing servers instead; tests
// that must restart a server then fail with a message saying so.
package testsvc

import (
	"context"
	"errors"
	"fmt"
	"os"
	"sync"
	"syscall"
	"testing"

	"github.com/batonhq/baton/internal/throwaway"
)

// Postgres is a throwaway PostgreSQL cluster (see throwaway.Postgres) that a test can stop,
// crash and start again on the same port and data directory.
type Postgres struct {
	*throwaway.Postgres
}

// StartPostgres starts a throwaway cluster of the test's own (see throwaway.StartPostgres);
// Close stops it and removes it.
func StartPostgres(ctx context.Context) (*Postgres, error) {
	pg, err := throwaway.StartPostgres(ctx)
	if err != nil {
		return nil, err
	}
	return &Postgres{Postgres: pg}, nil
}

// StartPostgresWith is StartPostgres with options: TLS, or pg_hba.conf lines that ask for a
// password (see throwaway.PostgresOptions).
func StartPostgresWith(ctx context.Context, opts throwaway.PostgresOptions) (*Postgres, error) {
	pg, err := throwaway.StartPostgresWith(ctx, opts)
	if err != nil {
		return nil, err
	}
	return &Postgres{Postgres: pg}, nil
}

// Start starts the server again, on the same port and data directory, after Stop or Crash, and
// waits until it accepts connections.
func (p *Postgres) Start(ctx context.Context) error { return p.StartServer(ctx) }

// Stop shuts the server down cleanly (fast shutdown: sessions are disconnected, a checkpoint
// runs) and keeps its data for Start.
func (p *Postgres) Stop() error { return p.StopServer(syscall.SIGINT) }

// Crash stops the server the way a power cut would look to clients: immediate shutdown, no
// checkpoint; the next Start runs crash recovery.
func (p *Postgres) Crash() error { return p.StopServer(syscall.SIGQUIT) }

// ErrNoPostgres says how to get the PostgreSQL server binaries, or to use an existing server.
var ErrNoPostgres = errors.New(throwaway.ErrNoPostgres.Error() + ", or set " + EnvDatabaseURL +
	" to a server running with wal_level=logical")

// EnvNATSURL points tests at an existing NATS server with JetStream instead of an in-process one.
const EnvNATSURL = "BATON_TEST_NATS_URL"

// NATS is a NATS server with JetStream for one test: one in this process (see throwaway.NATS),
// which the test can stop and start again on the same port with the same store directory, or
// the existing server EnvNATSURL names, which it cannot.
type NATS struct {
	// StoreDir is where JetStream keeps its streams; empty for an external server.
	StoreDir string
	// Port is the client port, which stays the same across Stop and Start.
	Port int

	mu       sync.Mutex
	srv      *throwaway.NATS // nil when stopped
	external string          // the URL of a server this process did not start
}

// StartNATS gives the test a NATS server of its own, shut down when the test ends. With
// BATON_TEST_NATS_URL set it returns that server instead, which Stop and Start refuse to touch.
func StartNATS(t testing.TB) *NATS {
	t.Helper()
	if u := os.Getenv(EnvNATSURL); u != "" {
		return &NATS{external: u}
	}
	n := &NATS{StoreDir: t.TempDir()}
	if err := n.Start(); err != nil {
		t.Fatalf("start nats: %v", err)
	}
	t.Cleanup(n.Stop)
	return n
}

// URL returns the client URL; it stays the same across Stop and Start.
func (n *NATS) URL() string {
	if n.external != "" {
		return n.external
	}
	return fmt.Sprintf("nats://127.0.0.1:%d", n.Port)
}

// External reports whether the server is one this process did not start (BATON_TEST_NATS_URL).
func (n *NATS) External() bool { return n.external != "" }

// errExternal is what Start returns for a server this process did not start.
var errExternal = errors.New("cannot stop or restart a NATS server this process did not start")

// Start starts the server: the first time on a free port, after Stop on the same port with the
// same store directory, where JetStream recovers its streams.
func (n *NATS) Start() error {
	if n.external != "" {
		return errExternal
	}
	n.mu.Lock()
	defer n.mu.Unlock()
	if n.srv != nil {
		return errors.New("nats already running")
	}
	srv, err := throwaway.StartNATS(n.StoreDir, n.Port)
	if err != nil {
		return err
	}
	n.srv, n.Port = srv, srv.Port
	return nil
}

// Stop shuts the server down and waits until it is gone; clients see a dropped connection. It
// does nothing when the server is stopped or external.
func (n *NATS) Stop() {
	n.mu.Lock()
	defer n.mu.Unlock()
	if n.srv == nil {
		return
	}
	n.srv.Stop()
	n.srv = nil
}
