package main

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/nats-io/nats.go"
	"github.com/stretchr/testify/require"

	"github.com/batonhq/baton/internal/statusreport"
	"github.com/batonhq/baton/internal/testsvc"
	"github.com/batonhq/baton/internal/throwaway"
	"github.com/batonhq/baton/migrations"
	"github.com/batonhq/baton/relay"
)

// TestStatusRelayReplicationAccess: baton_relay has REPLICATION, and with pg_hba.conf as initdb
// writes it (`host replication all 127.0.0.1/32 trust`) pg_basebackup logged in as baton_relay
// copies the whole cluster: every database, and pg_authid with every role's password verifier.
// `baton status` run as a superuser (who may read pg_hba_file_rules) warns, naming the line
// that lets the relay in and the reject line to add; run as another role it prints that line
// and the query to check it with as a superuser. With `host replication baton_relay all
// reject` first in pg_hba.conf and the configuration reloaded, pg_basebackup as baton_relay is
// refused while a relay logged in as baton_relay starts and streams (its logical replication
// connection matches the database lines), and status shows the relay role refused, warning
// about nothing.
func TestStatusRelayReplicationAccess(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	basebackup := pgBasebackup(t)

	// A cluster of the test's own: roles.sql's roles keep their names, and pg_hba.conf is ours.
	// On TCP: the host lines are what this is about.
	pg, err := testsvc.StartPostgresWith(ctx, throwaway.PostgresOptions{TCP: true})
	require.NoError(t, err)
	t.Cleanup(func() { require.NoError(t, pg.Close()) })
	admin, err := pgx.Connect(ctx, pg.URL("postgres"))
	require.NoError(t, err)
	t.Cleanup(func() { _ = admin.Close(context.Background()) })
	_, err = admin.Exec(ctx, "CREATE DATABASE baton")
	require.NoError(t, err)
	owner, err := pgx.Connect(ctx, pg.URL("baton"))
	require.NoError(t, err)
	_, err = migrations.Up(ctx, owner)
	require.NoError(t, err)
	roles, err := os.ReadFile("../../deploy/postgres/roles.sql")
	require.NoError(t, err)
	_, err = owner.Exec(ctx, string(roles))
	require.NoError(t, err, "apply roles.sql")
	var authid, batonOID string
	require.NoError(t, owner.QueryRow(ctx, `SELECT pg_relation_filepath('pg_authid'),
		(SELECT oid::text FROM pg_database WHERE datname = 'baton')`).Scan(&authid, &batonOID))
	require.NoError(t, owner.Close(ctx))
	as := func(role string) string {
		return fmt.Sprintf("postgres://%s@127.0.0.1:%d/baton?sslmode=disable", role, pg.Port)
	}

	// A relay streams as baton_relay.
	ns := testsvc.StartNATS(t)
	nc, err := nats.Connect(ns.URL())
	require.NoError(t, err)
	t.Cleanup(nc.Close)
	b := &statusBundle{t: t}
	startRelayAs := func() (stop func()) {
		r, err := relay.New(relay.Config{DatabaseURL: as("baton_relay"), NATS: nc, Logger: discardLogger(),
			StatusInterval: 100 * time.Millisecond})
		require.NoError(t, err)
		return b.runUntilStopped("relay", r.Run, r.Active)
	}
	stopRelay := startRelayAs()

	report := func(role string) (statusreport.Report, string) {
		t.Helper()
		res := runBaton(t, "status", "--database-url", as(role), "--json")
		rep := parseReport(t, res)
		text := runBaton(t, "status", "--database-url", as(role))
		return rep, text.stdout
	}
	relayWarnings := func(rep statusreport.Report) []string {
		var ws []string
		for _, w := range rep.Warnings {
			if strings.Contains(w, "pg_basebackup") {
				ws = append(ws, w)
			}
		}
		return ws
	}
	const reject = "host replication baton_relay all reject"
	require.Equal(t, reject, statusreport.RejectLine("baton_relay"))

	// Before: the relay's role copies the cluster.
	dir := filepath.Join(t.TempDir(), "copy")
	out, err := basebackup(ctx, as("baton_relay"), dir)
	require.NoError(t, err, "pg_basebackup as baton_relay with initdb's pg_hba.conf: %s", out)
	for _, f := range []string{authid, filepath.Join("base", batonOID)} {
		_, err := os.Stat(filepath.Join(dir, f))
		require.NoError(t, err, "the copy holds %s", f)
	}
	rep, text := report("postgres")
	require.True(t, rep.ReplicationAccess.HBAChecked)
	require.Len(t, rep.ReplicationAccess.Roles, 1)
	got := rep.ReplicationAccess.Roles[0]
	require.Equal(t, "baton_relay", got.Name)
	require.NotNil(t, got.PhysicalRefused)
	require.False(t, *got.PhysicalRefused)
	require.NotNil(t, got.HBALine)
	ws := relayWarnings(rep)
	require.Len(t, ws, 1, "warnings: %q", rep.Warnings)
	require.Contains(t, ws[0], "role baton_relay may copy the whole cluster")
	require.Contains(t, ws[0], fmt.Sprintf("pg_hba.conf line %d", *got.HBALine))
	require.Contains(t, ws[0], "`"+reject+"`")
	require.Regexp(t, `(?m)^  baton_relay +`+regexp.QuoteMeta(fmt.Sprintf("physical replication ALLOWED by pg_hba.conf line %d: put `%s` before it", *got.HBALine, reject)), text)

	// Any other role cannot read pg_hba.conf's rules: it gets the line and the check.
	rep, text = report("baton_console")
	require.False(t, rep.ReplicationAccess.HBAChecked)
	require.Equal(t, "only superusers may read pg_hba_file_rules", rep.ReplicationAccess.HBANote)
	require.Len(t, rep.ReplicationAccess.Roles, 1)
	require.Nil(t, rep.ReplicationAccess.Roles[0].PhysicalRefused)
	require.Empty(t, relayWarnings(rep))
	require.Regexp(t, `(?m)^  baton_relay +REPLICATION; pg_hba.conf not checked: only superusers may read pg_hba_file_rules$`, text)
	require.Contains(t, text, "put `"+reject+"` before pg_hba.conf's other lines, then SELECT pg_reload_conf()")
	require.Contains(t, text, statusreport.HBACheckSQL)

	// The reject line first, and a reload.
	hba := filepath.Join(pg.Dir, "data", "pg_hba.conf")
	lines, err := os.ReadFile(hba)
	require.NoError(t, err)
	require.NoError(t, os.WriteFile(hba, append([]byte(reject+"\n"), lines...), 0o600))
	_, err = admin.Exec(ctx, "SELECT pg_reload_conf()")
	require.NoError(t, err)
	require.Eventually(t, func() bool {
		conn, err := pgconn.Connect(ctx, as("baton_relay")+"&replication=true")
		if err == nil {
			_ = conn.Close(ctx)
			return false
		}
		return strings.Contains(err.Error(), "pg_hba.conf rejects replication connection")
	}, 30*time.Second, 20*time.Millisecond, "the server never loaded the reject line")

	// After: no copy, and the relay starts again as baton_relay and streams.
	out, err = basebackup(ctx, as("baton_relay"), filepath.Join(t.TempDir(), "refused"))
	require.Error(t, err)
	require.Contains(t, out, `pg_hba.conf rejects replication connection for host "127.0.0.1", user "baton_relay"`)
	stopRelay()
	startRelayAs()
	rep, text = report("postgres")
	require.True(t, rep.ReplicationAccess.HBAChecked)
	require.Len(t, rep.ReplicationAccess.Roles, 1)
	got = rep.ReplicationAccess.Roles[0]
	require.NotNil(t, got.PhysicalRefused)
	require.True(t, *got.PhysicalRefused)
	require.NotNil(t, got.HBALine)
	require.Equal(t, 1, *got.HBALine)
	require.Empty(t, relayWarnings(rep))
	require.Regexp(t, `(?m)^  baton_relay +physical replication refused \(pg_hba.conf line 1\)$`, text)
	require.True(t, rep.Slot.Active, "the relay streams")
}

// pgBasebackup finds pg_basebackup (on PATH, or beside the server binaries, newest first)
// and returns a function that copies the cluster at url into dir, returning its output.
func pgBasebackup(t *testing.T) func(ctx context.Context, url, dir string) (string, error) {
	t.Helper()
	candidates, _ := filepath.Glob("/usr/lib/postgresql/*/bin/pg_basebackup")
	slices.Reverse(candidates) // "15" after "14"; two-digit majors sort together
	if p, err := exec.LookPath("pg_basebackup"); err == nil {
		candidates = append(candidates, p)
	}
	require.NotEmpty(t, candidates, "pg_basebackup not found (it ships with the PostgreSQL client programs)")
	bin := candidates[0]
	return func(ctx context.Context, url, dir string) (string, error) {
		cmd := exec.CommandContext(ctx, bin, "--dbname", url, "--pgdata", dir, "--wal-method", "none", "--no-sync", "--checkpoint", "fast")
		out, err := cmd.CombinedOutput()
		return string(out), err
	}
}
