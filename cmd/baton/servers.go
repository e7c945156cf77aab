package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"

	"github.com/batonhq/baton/internal/config"
	"github.com/batonhq/baton/internal/throwaway"
)

// The servers the commands that run Baton on this machine (demo, bench) start when they are
// given none: a throwaway PostgreSQL cluster and an embedded NATS server.

// localPostgres starts a throwaway PostgreSQL cluster when cfg names no database, and sets
// cfg.DatabaseURL to it; otherwise it prints the server it uses and using, what the command
// does there. stop stops and removes the cluster (a no-op when none was started); call it on
// every path once err is nil. noPostgres makes the error for missing server binaries.
func localPostgres(ctx context.Context, cfg *config.Config, opts throwaway.PostgresOptions, using string, noPostgres func(error) error,
	out io.Writer) (stop func() error, err error) {
	if cfg.DatabaseURL != "" {
		fmt.Fprintf(out, "using the PostgreSQL at %s (BATON_DATABASE_URL): %s\n", config.Redact(cfg.DatabaseURL), using)
		return func() error { return nil }, nil
	}
	fmt.Fprintf(out, "starting a throwaway PostgreSQL cluster (BATON_DATABASE_URL is not set)\n")
	pg, err := throwaway.StartPostgresWith(ctx, opts)
	if err != nil {
		return nil, noPostgres(err)
	}
	if pg.TCP {
		cfg.DatabaseURL = pg.TCPURL("postgres")
		fmt.Fprintf(out, "  PostgreSQL on 127.0.0.1:%d, data in %s (removed on exit)\n", pg.Port, pg.Dir)
	} else {
		cfg.DatabaseURL = pg.URL("postgres")
		fmt.Fprintf(out, "  PostgreSQL on a Unix socket (psql -h %s -U postgres), data in %s (removed on exit)\n", pg.Dir, pg.Dir)
	}
	return func() error {
		if err := pg.Close(); err != nil {
			return fmt.Errorf("remove the throwaway PostgreSQL: %w", err)
		}
		return nil
	}, nil
}

// noPostgresErrorFor says how to give a command a PostgreSQL when the server binaries are
// missing: who is the command ("the demo"), given what it does with a server it is given.
func noPostgresErrorFor(who, given string, err error) error {
	if !errors.Is(err, throwaway.ErrNoPostgres) {
		return fmt.Errorf("start a throwaway PostgreSQL: %w", err)
	}
	return errors.New(who + " needs PostgreSQL and found no server binaries (initdb, postgres) to start a " +
		"throwaway cluster with.\n" +
		"  Install them: Debian/Ubuntu `apt-get install -y postgresql`, Fedora `dnf install -y postgresql-server`, " +
		"macOS `brew install postgresql` (pg_config must be on PATH, or initdb itself);\n" +
		"  or set BATON_DATABASE_URL (or --database-url) to a PostgreSQL 15+ server running with wal_level=logical, " +
		"as a role that may replicate: " + given)
}

// localNATS starts an embedded NATS server with JetStream, storing in a new temp dir named
// after command, when cfg names no NATS server, and sets cfg.NATSURL to it. stop stops the
// server and removes its store (a no-op when none was started); call it on every path once
// err is nil. started reports whether the server runs in this process.
func localNATS(cfg *config.Config, command string, out io.Writer) (stop func() error, started bool, err error) {
	if cfg.NATSURL != "" {
		fmt.Fprintf(out, "using the NATS server at %s (BATON_NATS_URL)\n", config.Redact(cfg.NATSURL))
		return func() error { return nil }, false, nil
	}
	dir, err := os.MkdirTemp("", "baton-"+command+"-nats-")
	if err != nil {
		return nil, false, fmt.Errorf("NATS store dir: %w", err)
	}
	removeStore := func() error {
		if err := os.RemoveAll(dir); err != nil {
			return fmt.Errorf("remove the NATS store: %w", err)
		}
		return nil
	}
	srv, err := throwaway.StartNATS(dir, 0)
	if err != nil {
		_ = removeStore() // the start error is the one to report
		return nil, false, fmt.Errorf("start an embedded NATS server: %w", err)
	}
	cfg.NATSURL = srv.URL()
	fmt.Fprintf(out, "  embedded NATS JetStream on %s, store in %s (removed on exit)\n", srv.URL(), dir)
	return func() error {
		srv.Stop()
		return removeStore()
	}, true, nil
}
