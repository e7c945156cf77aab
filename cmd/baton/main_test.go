package main

import (
	"bytes"
	"context"
	"fmt"
	"net/url"
	"os"
	"runtime/debug"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/batonhq/baton/internal/config"
	"github.com/batonhq/baton/internal/testsvc"
	"github.com/batonhq/baton/migrations"
)

func TestMain(m *testing.M) {
	// The tests set what they need; the caller's BATON_* configuration must not leak in
	// (BATON_TEST_* variables stay: they choose the test servers).
	for _, name := range []string{config.EnvDatabaseURL, config.EnvDatabaseURLFile, config.EnvNATSURL, config.EnvNATSURLFile,
		config.EnvNATSCreds, config.EnvNATSNKey, config.EnvNATSCA, config.EnvNATSCert, config.EnvNATSKey, config.EnvSubjectPrefix,
		config.EnvSlot, config.EnvPublication, config.EnvMetricsAddr, config.EnvFatalLinger, config.EnvLogLevel, config.EnvLogFormat} {
		_ = os.Unsetenv(name)
	}
	os.Exit(testsvc.Main(m))
}

type result struct {
	code           int
	stdout, stderr string
}

func runBaton(t *testing.T, args ...string) result {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	var stdout, stderr bytes.Buffer
	code := run(ctx, args, &stdout, &stderr)
	return result{code: code, stdout: stdout.String(), stderr: stderr.String()}
}

// emptyDatabase creates a database with no schema on the test server and returns its URL.
func emptyDatabase(t *testing.T) string {
	t.Helper()
	db := testsvc.NewDatabase(t)
	ctx := context.Background()
	name := db.Name + "_empty"
	_, err := db.Pool.Exec(ctx, "CREATE DATABASE "+pgx.Identifier{name}.Sanitize())
	require.NoError(t, err)
	t.Cleanup(func() { // runs before NewDatabase's cleanup closes the pool
		_, err := db.Pool.Exec(context.Background(), "DROP DATABASE IF EXISTS "+pgx.Identifier{name}.Sanitize()+" WITH (FORCE)")
		require.NoError(t, err)
	})
	u, err := url.Parse(db.URL)
	require.NoError(t, err)
	u.Path = "/" + name
	return u.String()
}

func appliedVersions(t *testing.T, databaseURL string) []int {
	t.Helper()
	ctx := context.Background()
	conn, err := pgx.Connect(ctx, databaseURL)
	require.NoError(t, err)
	defer func() { _ = conn.Close(ctx) }()
	versions, err := migrations.Applied(ctx, conn)
	require.NoError(t, err)
	return versions
}

func allVersions(t *testing.T) []int {
	all, err := migrations.All()
	require.NoError(t, err)
	var vs []int
	for _, m := range all {
		vs = append(vs, m.Version)
	}
	return vs
}

func TestMigrateAppliesSchemaThenIsNoOp(t *testing.T) {
	t.Parallel()
	dbURL := emptyDatabase(t)
	want := fmt.Sprintf("schema at version %d\n", migrations.Latest())

	r := runBaton(t, "migrate", "--database-url", dbURL)
	require.Equal(t, 0, r.code, r.stderr)
	require.Equal(t, want, r.stdout)
	require.Contains(t, r.stderr, `level=INFO msg="migration applied" version=1 name=init`)
	require.Equal(t, allVersions(t), appliedVersions(t, dbURL))

	r = runBaton(t, "migrate", "--database-url", dbURL)
	require.Equal(t, 0, r.code, r.stderr)
	require.Equal(t, want, r.stdout)
	require.NotContains(t, r.stderr, "migration applied")
	require.Contains(t, r.stderr, fmt.Sprintf(`msg="schema already current" version=%d`, migrations.Latest()))
	require.Equal(t, allVersions(t), appliedVersions(t, dbURL))
}

func TestMigrateReadsEnvironment(t *testing.T) {
	db := testsvc.NewDatabase(t)
	t.Setenv(config.EnvDatabaseURL, db.URL)
	t.Setenv(config.EnvLogFormat, "json")

	r := runBaton(t, "migrate")
	require.Equal(t, 0, r.code, r.stderr)
	require.Equal(t, fmt.Sprintf("schema at version %d\n", migrations.Latest()), r.stdout)
	require.Contains(t, r.stderr, `"msg":"schema already current"`)
}

func TestMigrateFlagOverridesEnvironment(t *testing.T) {
	db := testsvc.NewDatabase(t)
	t.Setenv(config.EnvDatabaseURL, "postgres://nobody:envs3cret@127.0.0.1:1/none")
	t.Setenv(config.EnvLogLevel, "error")

	r := runBaton(t, "migrate", "--database-url", db.URL, "--log-level", "info")
	require.Equal(t, 0, r.code, r.stderr)
	require.Contains(t, r.stderr, "schema already current")
}

func TestMigrateWithoutDatabaseURL(t *testing.T) {
	t.Setenv(config.EnvDatabaseURL, "")
	r := runBaton(t, "migrate")
	require.Equal(t, 1, r.code)
	require.Equal(t, "baton migrate: BATON_DATABASE_URL is not set: set it or pass --database-url\n", r.stderr)
	require.Empty(t, r.stdout)
}

func TestMigrateInvalidConfiguration(t *testing.T) {
	t.Setenv(config.EnvSlot, "Not-A-Slot")
	r := runBaton(t, "migrate", "--database-url", "postgres:///x", "--log-format", "xml")
	require.Equal(t, 1, r.code)
	require.Contains(t, r.stderr, "BATON_SLOT: must match")
	require.Contains(t, r.stderr, "--log-format: must be text or json")
}

func TestMigrateErrorsHideThePassword(t *testing.T) {
	t.Parallel()
	closed := testsvc.RefusingAddr(t) // refuses connections

	for _, dbURL := range []string{
		"postgres://baton:s3cret@" + closed + "/baton?sslmode=disable",
		"host=127.0.0.1 port=" + closed[strings.LastIndexByte(closed, ':')+1:] + " password='s3cret' sslmode=disable",
		"postgres://baton:s3cret@127.0.0.1:5432/baton?sslmode=bogus", // parses as a URL, pgx refuses it
	} {
		r := runBaton(t, "migrate", "--database-url", dbURL, "--log-level", "debug")
		require.Equal(t, 1, r.code, r.stderr)
		require.NotContains(t, r.stderr+r.stdout, "s3cret")
		require.Contains(t, r.stderr, "xxxxx", "the debug log shows the redacted configuration")
	}
}

func TestUsageErrors(t *testing.T) {
	t.Parallel()
	for _, tt := range []struct {
		args   []string
		stderr string
	}{
		{nil, "usage: baton <command>"},
		{[]string{"frobnicate"}, `baton: unknown command "frobnicate"`},
		{[]string{"help", "frobnicate"}, `baton: unknown command "frobnicate"`},
		{[]string{"migrate", "--no-such-flag"}, "flag provided but not defined: -no-such-flag"},
		{[]string{"migrate", "extra"}, `baton migrate: unexpected argument "extra"`},
		{[]string{"version", "extra"}, `baton version: unexpected argument "extra"`},
	} {
		t.Run(strings.Join(tt.args, " "), func(t *testing.T) {
			r := runBaton(t, tt.args...)
			require.Equal(t, 2, r.code)
			require.Contains(t, r.stderr, tt.stderr)
			require.Empty(t, r.stdout)
		})
	}
	r := runBaton(t, "frobnicate")
	require.Contains(t, r.stderr, "usage: baton <command>", "an unknown command shows the usage")
}

func TestHelp(t *testing.T) {
	t.Parallel()
	for _, args := range [][]string{{"help"}, {"-h"}, {"--help"}} {
		r := runBaton(t, args...)
		require.Equal(t, 0, r.code)
		require.Empty(t, r.stderr)
		for name, cmd := range commands {
			require.Contains(t, r.stdout, name+" ")
			require.Contains(t, r.stdout, cmd.summary)
		}
	}

	r := runBaton(t, "help", "migrate")
	require.Equal(t, 0, r.code)
	require.Contains(t, r.stdout, "usage: baton migrate [flags]")
	require.Contains(t, r.stdout, "-database-url url")
	require.Contains(t, r.stdout, "[env BATON_DATABASE_URL]")

	r = runBaton(t, "migrate", "-h")
	require.Equal(t, 0, r.code)
	require.Contains(t, r.stderr, "usage: baton migrate [flags]")
}

func TestVersion(t *testing.T) {
	t.Parallel()
	r := runBaton(t, "version")
	require.Equal(t, 0, r.code, r.stderr)
	require.True(t, strings.HasPrefix(r.stdout, "baton "), r.stdout)

	info := &debug.BuildInfo{GoVersion: "go1.26.8", Main: debug.Module{Version: "(devel)"}}
	require.Equal(t, "dev (go1.26.8)", versionString("dev", info))
	require.Equal(t, "v1.0.0 (go1.26.8)", versionString("v1.0.0", info))
	info.Main.Version = "v0.3.0"
	info.Settings = []debug.BuildSetting{{Key: "vcs.revision", Value: "0123456789abcdef"}, {Key: "vcs.modified", Value: "true"}}
	require.Equal(t, "v0.3.0 (go1.26.8, commit 0123456789ab-dirty)", versionString("dev", info))
	require.Equal(t, "v2 (go1.26.8, commit 0123456789ab-dirty)", versionString("v2", info))
	require.Equal(t, "dev", versionString("dev", nil))
}

func TestVersionFlag(t *testing.T) {
	t.Parallel()
	want := runBaton(t, "version")
	for _, flag := range []string{"--version", "-version"} {
		r := runBaton(t, flag)
		require.Equal(t, 0, r.code, r.stderr)
		require.Equal(t, want.stdout, r.stdout, "%s prints what baton version prints", flag)
		require.Empty(t, r.stderr)
	}
	r := runBaton(t, "--version", "extra")
	require.Equal(t, 2, r.code)
	require.Contains(t, r.stderr, `baton version: unexpected argument "extra"`)
	require.Contains(t, runBaton(t, "help").stdout, "baton --version")
}
