// Package testsvc gives Baton's tests the real services they talk to: a throwaway PostgreSQL
// cluster with a migrated database per test, and a NATS server with JetStream per test, started
// by internal/localsvc. A test owns what it starts and can stop, crash and restart it.
//
// BATON_TEST_DATABASE_URL and BATON_TEST_NATS_URL point tests at existing servers instead; tests
// that must restart a server then fail with a message saying so.
package testsvc

import (
	"errors"
	"os"
	"testing"

	"github.com/batonhq/baton/internal/localsvc"
)

// The servers, as the tests name them.
type (
	// Postgres is a throwaway PostgreSQL cluster (see localsvc.Postgres).
	Postgres = localsvc.Postgres
	// NATS is a NATS server with JetStream in this process (see localsvc.NATS).
	NATS = localsvc.NATS
)

// StartPostgres starts a throwaway cluster (see localsvc.StartPostgres).
var StartPostgres = localsvc.StartPostgres

// ErrNoPostgres says how to get the PostgreSQL server binaries, or to use an existing server.
var ErrNoPostgres = errors.New(localsvc.ErrNoPostgres.Error() + ", or set " + EnvDatabaseURL +
	" to a server running with wal_level=logical")

// EnvNATSURL points tests at an existing NATS server with JetStream instead of an in-process one.
const EnvNATSURL = "BATON_TEST_NATS_URL"

// StartNATS gives the test a NATS server of its own, shut down when the test ends. With
// BATON_TEST_NATS_URL set it returns that server instead, which Stop and Start refuse to touch.
func StartNATS(t testing.TB) *NATS {
	t.Helper()
	if u := os.Getenv(EnvNATSURL); u != "" {
		return localsvc.ExternalNATS(u)
	}
	n, err := localsvc.RunNATS(t.TempDir(), 0)
	if err != nil {
		t.Fatalf("start nats: %v", err)
	}
	t.Cleanup(n.Stop)
	return n
}
