package relay_test

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/stretchr/testify/require"

	"github.com/batonhq/baton/internal/testsvc"
	"github.com/batonhq/baton/internal/throwaway"
	"github.com/batonhq/baton/relay"
)

// prependHBA puts lines at the top of pg's pg_hba.conf, where they win over the trust rules
// initdb wrote, and reloads the configuration.
func prependHBA(ctx context.Context, t *testing.T, pg *testsvc.Postgres, conn *pgx.Conn, lines ...string) {
	t.Helper()
	path := filepath.Join(pg.Dir, "data", "pg_hba.conf")
	old, err := os.ReadFile(path)
	require.NoError(t, err)
	require.NoError(t, os.WriteFile(path, []byte(strings.Join(lines, "\n")+"\n"+string(old)), 0o600))
	_, err = conn.Exec(ctx, `SELECT pg_reload_conf()`)
	require.NoError(t, err)
}

// connectCode returns the SQLSTATE with which the server refuses url, or "" when it accepts it.
func connectCode(ctx context.Context, url string) string {
	conn, err := pgx.Connect(ctx, url)
	if err == nil {
		_ = conn.Close(ctx)
		return ""
	}
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) {
		return pgErr.Code
	}
	return err.Error()
}

// A connection the server refuses for a reason no retry changes — a wrong password, no
// pg_hba.conf entry, a role or database that does not exist, no CONNECT privilege — and a
// connection string the driver cannot parse are ErrSetup: Run returns at once, naming the
// problem, instead of reconnecting forever. Neither the error nor the log shows the password.
func TestConnectRefusalsAreSetupErrors(t *testing.T) {
	t.Parallel()
	ctx := ctxT(t, 3*time.Minute)
	b := setup(t)

	// A cluster of its own that asks for passwords: the shared one trusts every connection. On
	// TCP, as users' URLs name a host (the driver checks no sslmode for a Unix socket).
	pg, err := testsvc.StartPostgresWith(ctx, throwaway.PostgresOptions{TCP: true})
	require.NoError(t, err)
	t.Cleanup(func() { require.NoError(t, pg.Close()) })
	admin, err := pgx.Connect(ctx, pg.URL("postgres"))
	require.NoError(t, err)
	t.Cleanup(func() { _ = admin.Close(context.Background()) })
	const password = "right-s3cret"
	_, err = admin.Exec(ctx, `CREATE ROLE app LOGIN REPLICATION PASSWORD '`+password+`'`)
	require.NoError(t, err)
	_, err = admin.Exec(ctx, `CREATE DATABASE closed`)
	require.NoError(t, err)
	_, err = admin.Exec(ctx, `REVOKE CONNECT ON DATABASE closed FROM PUBLIC`)
	require.NoError(t, err)
	prependHBA(ctx, t, pg, admin,
		"host all app 127.0.0.1/32 scram-sha-256",
		"host all shut_out 127.0.0.1/32 reject")
	at := func(userinfo, db string) string {
		return fmt.Sprintf("postgres://%s@127.0.0.1:%d/%s?sslmode=disable", userinfo, pg.Port, db)
	}
	require.Eventually(t, func() bool { return connectCode(ctx, at("app:wrong", "postgres")) == "28P01" },
		10*time.Second, 20*time.Millisecond, "the server does not ask app for a password")
	require.Empty(t, connectCode(ctx, at("app:"+password, "postgres")), "app logs in with its password")

	for _, tc := range []struct {
		name     string
		url      string
		password string
		says     []string
	}{
		{"wrong password", at("app:wrong-s3cret", "postgres"), "wrong-s3cret",
			[]string{"password authentication failed", "28P01"}},
		{"database does not exist", at("app:"+password, "no_such_db"), password,
			[]string{`database "no_such_db" does not exist`, "3D000"}},
		{"no CONNECT privilege", at("app:"+password, "closed"), password,
			[]string{`permission denied for database "closed"`, "42501"}},
		{"pg_hba.conf rejects", at("shut_out:shut-s3cret", "postgres"), "shut-s3cret",
			[]string{"pg_hba.conf rejects", "28000"}},
		{"role does not exist", at("nobody:nobody-s3cret", "postgres"), "nobody-s3cret",
			[]string{`role "nobody" does not exist`, "28000"}},
		// A password holding '@' the driver's own masking cuts short.
		{"unparseable", at("app:p@ss-s3cret", "postgres") + "&sslmode=bogus", "ss-s3cret",
			[]string{"parse database url", "sslmode"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var log testsvc.Buffer
			cfg := b.cfg
			cfg.DatabaseURL = tc.url
			cfg.Logger = slog.New(slog.NewTextHandler(&log, nil))
			r, err := relay.New(cfg)
			require.NoError(t, err)
			runCtx, cancel := context.WithCancel(ctx)
			defer cancel()
			done := make(chan error, 1)
			go func() { done <- r.Run(runCtx) }()
			select {
			case err = <-done:
			case <-time.After(10 * time.Second):
				cancel()
				stopped := <-done
				tail := log.String()
				tail = tail[max(0, len(tail)-2000):]
				t.Fatalf("Run still retrying after 10s (then returned %v); log ends:\n%s", stopped, tail)
			}
			require.ErrorIs(t, err, relay.ErrSetup)
			for _, s := range tc.says {
				require.ErrorContains(t, err, s)
			}
			require.NotContains(t, err.Error(), tc.password)
			require.NotContains(t, log.String(), tc.password)
		})
	}
}
