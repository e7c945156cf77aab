package testsvc

import (
	"context"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/stretchr/testify/require"
)

func TestMain(m *testing.M) { os.Exit(MainNoLeaks(m)) }

func TestNewDatabaseIsMigratedAndIsolated(t *testing.T) {
	t.Parallel()
	a, b := NewDatabase(t), NewDatabase(t)
	require.NotEqual(t, a.Name, b.Name)
	ctx := context.Background()
	_, err := a.Pool.Exec(ctx, "INSERT INTO conversations (id) VALUES ('c1')")
	require.NoError(t, err)
	var n int
	require.NoError(t, b.Pool.QueryRow(ctx, "SELECT count(*) FROM conversations").Scan(&n))
	require.Zero(t, n, "databases must not share rows")
	var level string
	require.NoError(t, a.Pool.QueryRow(ctx, "SHOW wal_level").Scan(&level))
	require.Equal(t, "logical", level)
}

// The fault tests of later packages stop, crash and restart the servers; this shows data
// survives each and the port stays the same.
func TestPostgresRestartKeepsData(t *testing.T) {
	if os.Getenv(EnvDatabaseURL) != "" {
		t.Log("starting a private cluster although " + EnvDatabaseURL + " is set: this test restarts it")
	}
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	pg, err := StartPostgres(ctx)
	require.NoError(t, err)
	t.Cleanup(func() { require.NoError(t, pg.Close()) })

	exec := func(sql string) {
		conn, err := pgx.Connect(ctx, pg.URL("postgres"))
		require.NoError(t, err)
		defer func() { _ = conn.Close(ctx) }()
		_, err = conn.Exec(ctx, sql)
		require.NoError(t, err)
	}
	count := func() int {
		conn, err := pgx.Connect(ctx, pg.URL("postgres"))
		require.NoError(t, err)
		defer func() { _ = conn.Close(ctx) }()
		var n int
		require.NoError(t, conn.QueryRow(ctx, "SELECT count(*) FROM kept").Scan(&n))
		return n
	}
	exec("CREATE TABLE kept (v int)")
	exec("INSERT INTO kept VALUES (1)")

	connURL := pg.URL("postgres")
	require.NoError(t, pg.Stop())
	_, err = pgx.Connect(ctx, connURL)
	require.Error(t, err, "the server must be down after Stop")
	require.NoError(t, pg.Start(ctx))
	require.Equal(t, connURL, pg.URL("postgres"))
	require.Equal(t, 1, count())

	exec("INSERT INTO kept VALUES (2)")
	require.NoError(t, pg.Crash())
	require.NoError(t, pg.Start(ctx))
	require.Equal(t, 2, count(), "a committed row must survive an immediate shutdown")
}

func TestNATSRestartKeepsStream(t *testing.T) {
	t.Parallel()
	n := StartNATS(t)
	if n.External() {
		t.Fatalf("this test restarts NATS: unset %s", EnvNATSURL)
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	nc, err := nats.Connect(n.URL(), nats.MaxReconnects(-1), nats.ReconnectWait(20*time.Millisecond))
	require.NoError(t, err)
	defer nc.Close()
	js, err := jetstream.New(nc)
	require.NoError(t, err)
	_, err = js.CreateStream(ctx, jetstream.StreamConfig{Name: "KEEP", Subjects: []string{"keep.>"}, Storage: jetstream.FileStorage})
	require.NoError(t, err)
	_, err = js.Publish(ctx, "keep.a", []byte("1"))
	require.NoError(t, err)

	port := n.Port
	n.Stop()
	require.Eventually(t, func() bool { return !nc.IsConnected() }, 10*time.Second, 10*time.Millisecond)
	require.NoError(t, n.Start())
	require.Equal(t, port, n.Port)
	require.Eventually(t, nc.IsConnected, 10*time.Second, 10*time.Millisecond)

	s, err := js.Stream(ctx, "KEEP")
	require.NoError(t, err)
	info, err := s.Info(ctx)
	require.NoError(t, err)
	require.EqualValues(t, 1, info.State.Msgs)
}

func TestBinariesBuildsEachOnce(t *testing.T) {
	t.Parallel()
	pkgs := []string{"github.com/batonhq/baton/cmd/baton", "github.com/batonhq/baton/examples/subscriber"}
	bins := Binaries(t, pkgs...)
	require.Len(t, bins, 2)
	out, err := exec.CommandContext(t.Context(), bins[0], "version").CombinedOutput()
	require.NoError(t, err, "%s", out)
	require.Equal(t, "subscriber", filepath.Base(bins[1]))
	info, err := os.Stat(bins[1])
	require.NoError(t, err)
	require.NotZero(t, info.Mode()&0o100, "executable")
	// Built once: Binary and Binaries hand out the same programs afterwards.
	require.Equal(t, bins[0], Binary(t, pkgs[0]))
	require.Equal(t, []string{bins[1], bins[0]}, Binaries(t, pkgs[1], pkgs[0]))
}

// A server started again is back on its port, also when another listener was given that port
// while the server was down (as a test's proxy listening on port 0 can be): Start tries again
// until the port is free.
func TestNATSStartedAgainWaitsForItsPort(t *testing.T) {
	t.Parallel()
	n := StartNATS(t)
	if n.External() {
		t.Fatalf("this test restarts NATS: unset %s", EnvNATSURL)
	}
	ctx, cancel := context.WithTimeout(t.Context(), 2*time.Minute)
	defer cancel()
	port := n.Port
	n.Stop()
	requireStartWaitsForPort(ctx, t, port, n.Start)
	require.Equal(t, port, n.Port)
	nc, err := nats.Connect(n.URL())
	require.NoError(t, err, "connect to the server started again")
	nc.Close()
}

// requireStartWaitsForPort holds port while start runs, and requires that start waits for it:
// it has not returned after 500 ms, and returns without error once the port is let go.
func requireStartWaitsForPort(ctx context.Context, t *testing.T, port int, start func() error) {
	t.Helper()
	var lc net.ListenConfig
	taken, err := lc.Listen(ctx, "tcp", fmt.Sprintf("127.0.0.1:%d", port))
	require.NoError(t, err, "hold the stopped server's port")
	started := make(chan error, 1)
	go func() { started <- start() }()
	select {
	case err := <-started:
		_ = taken.Close()
		t.Fatalf("started while its port %d was taken: %v", port, err)
	case <-time.After(500 * time.Millisecond): // the port stays taken that long
	}
	require.NoError(t, taken.Close())
	select {
	case err := <-started:
		require.NoError(t, err)
	case <-ctx.Done():
		t.Fatalf("Start did not return once its port %d was free", port)
	}
}
