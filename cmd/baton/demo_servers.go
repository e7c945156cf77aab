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

// demoPostgres starts a throwaway PostgreSQL cluster when cfg names no database, and sets
// cfg.DatabaseURL to it. stop stops and removes the cluster (a no-op when none was started);
// call it on every path once err is nil.
func demoPostgres(ctx context.Context, cfg *config.Config, runID string, out io.Writer) (stop func() error, err error) {
	if cfg.DatabaseURL != "" {
		fmt.Fprintf(out, "using the PostgreSQL at %s (BATON_DATABASE_URL): the demo writes ids starting with %s- there "+
			"and its workers answer every pending message\n", config.Redact(cfg.DatabaseURL), runID)
		return func() error { return nil }, nil
	}
	fmt.Fprintf(out, "starting a throwaway PostgreSQL cluster (BATON_DATABASE_URL is not set)\n")
	pg, err := throwaway.StartPostgres(ctx)
	if err != nil {
		return nil, noPostgresError(err)
	}
	cfg.DatabaseURL = pg.URL("postgres")
	fmt.Fprintf(out, "  PostgreSQL on 127.0.0.1:%d, data in %s (removed on exit)\n", pg.Port, pg.Dir)
	return func() error {
		if err := pg.Close(); err != nil {
			return fmt.Errorf("remove the throwaway PostgreSQL: %w", err)
		}
		return nil
	}, nil
}

// noPostgresError says how to give the demo a PostgreSQL when the server binaries are missing.
func noPostgresError(err error) error {
	if !errors.Is(err, throwaway.ErrNoPostgres) {
		return fmt.Errorf("start a throwaway PostgreSQL: %w", err)
	}
	return errors.New("the demo needs PostgreSQL and found no server binaries (initdb, postgres) to start a " +
		"throwaway cluster with.\n" +
		"  Install them: Debian/Ubuntu `apt-get install -y postgresql`, Fedora `dnf install -y postgresql-server`, " +
		"macOS `brew install postgresql` (pg_config must be on PATH, or initdb itself);\n" +
		"  or set BATON_DATABASE_URL (or --database-url) to a PostgreSQL 15+ server running with wal_level=logical, " +
		"as a role that may replicate: the demo writes into that database")
}

// demoNATS starts an embedded NATS server with JetStream, storing in a new temp dir, when cfg
// names no NATS server, and sets cfg.NATSURL to it. stop stops the server and removes its
// store (a no-op when none was started); call it on every path once err is nil.
func demoNATS(cfg *config.Config, out io.Writer) (stop func() error, err error) {
	if cfg.NATSURL != "" {
		fmt.Fprintf(out, "using the NATS server at %s (BATON_NATS_URL)\n", config.Redact(cfg.NATSURL))
		return func() error { return nil }, nil
	}
	dir, err := os.MkdirTemp("", "baton-demo-nats-")
	if err != nil {
		return nil, fmt.Errorf("NATS store dir: %w", err)
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
		return nil, fmt.Errorf("start an embedded NATS server: %w", err)
	}
	cfg.NATSURL = srv.URL()
	fmt.Fprintf(out, "  embedded NATS JetStream on %s, store in %s (removed on exit)\n", srv.URL(), dir)
	return func() error {
		srv.Stop()
		return removeStore()
	}, nil
}
