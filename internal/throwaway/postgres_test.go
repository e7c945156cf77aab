package throwaway

import (
	"context"
	"errors"
	"net"
	"os"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"
)

func startPostgres(t *testing.T, opts PostgresOptions) *Postgres {
	t.Helper()
	ctx, cancel := context.WithTimeout(t.Context(), 2*time.Minute)
	defer cancel()
	pg, err := StartPostgresWith(ctx, opts)
	if errors.Is(err, ErrNoPostgres) {
		t.Fatal(err)
	}
	require.NoError(t, err)
	t.Cleanup(func() { require.NoError(t, pg.Close()) })
	return pg
}

// A throwaway cluster listens on its Unix socket only: a TCP port chosen for it and released
// until the server bound it could be given to another process meanwhile (a CI run failed
// that way: a test's scrape reached a proxy on the port it had picked).
func TestPostgresListensOnItsSocketOnly(t *testing.T) {
	t.Parallel()
	pg := startPostgres(t, PostgresOptions{})
	ctx := t.Context()
	conn, err := pgx.Connect(ctx, pg.URL("postgres"))
	require.NoError(t, err)
	defer func() { _ = conn.Close(ctx) }()
	var listen string
	require.NoError(t, conn.QueryRow(ctx, "SHOW listen_addresses").Scan(&listen))
	require.Empty(t, listen, "the server listens on TCP")
	require.Empty(t, pg.TCPURL("postgres"))
	_, err = os.Stat(pg.SocketPath())
	require.NoError(t, err, "no socket where SocketPath says")
}

// With TCP, the server binds a port below the ephemeral range itself; restarted while
// another process holds that port, it waits for the port instead of failing or moving.
func TestPostgresTCPRestartWaitsForItsPort(t *testing.T) {
	t.Parallel()
	pg := startPostgres(t, PostgresOptions{TCP: true})
	low, high := tcpPortRange()
	require.True(t, pg.Port >= low && pg.Port < high, "port %d outside [%d, %d)", pg.Port, low, high)
	ctx := t.Context()
	conn, err := pgx.Connect(ctx, pg.TCPURL("postgres"))
	require.NoError(t, err)
	require.NoError(t, conn.Close(ctx))

	port := pg.Port
	require.NoError(t, pg.StopServer(syscall.SIGINT))
	var lc net.ListenConfig
	squatter, err := lc.Listen(ctx, "tcp", net.JoinHostPort("127.0.0.1", strconv.Itoa(port)))
	require.NoError(t, err)
	defer func() { _ = squatter.Close() }()
	logged, err := os.ReadFile(pg.LogPath())
	require.NoError(t, err)
	started := make(chan error, 1)
	go func() { started <- pg.StartServer(ctx) }()
	// The server tried the port and found it taken: then the port is given back.
	require.Eventually(t, func() bool {
		b, err := os.ReadFile(pg.LogPath())
		return err == nil && strings.Count(string(b), "Address already in use") > strings.Count(string(logged), "Address already in use")
	}, time.Minute, 10*time.Millisecond, "the restarted server never tried its port")
	require.NoError(t, squatter.Close())
	select {
	case err := <-started:
		require.NoError(t, err)
	case <-time.After(2 * time.Minute):
		t.Fatal("the restart did not end")
	}
	require.Equal(t, port, pg.Port)
	conn, err = pgx.Connect(ctx, pg.TCPURL("postgres"))
	require.NoError(t, err)
	require.NoError(t, conn.Close(ctx))
}
