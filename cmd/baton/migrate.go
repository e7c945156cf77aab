package main

import (
	"context"
	"fmt"
	"io"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/batonhq/baton/internal/config"
	"github.com/batonhq/baton/migrations"
)

// connectTimeout bounds connecting when the connection string sets no connect_timeout.
const connectTimeout = 30 * time.Second

const migrateSummary = "apply the database schema (safe at every start and from many processes at once)"

func runMigrate(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	fs := newFlagSet("migrate", `Migrate applies every embedded schema migration the database lacks, each in its own
transaction, logs each version it applied and prints the version the schema is at.
It is safe to run at every start and from many processes at once. Baton's tables go into
the schema BATON_SCHEMA names, created when missing. With --print it writes the SQL instead,
for teams that apply migrations with their own tool, and needs no database.`, stderr)
	printSQL := fs.Bool("print", false, "write the migrations as one SQL script to stdout instead of applying them")
	cfg, log, err := configure(fs, args, stderr, config.EnvDatabaseURL, config.EnvSchema, config.EnvPublication)
	if err != nil {
		return err
	}
	opts := migrations.Options{Schema: cfg.Schema, Publication: cfg.Publication}
	if *printSQL {
		return migrations.Print(stdout, opts)
	}
	if err := cfg.Require(config.EnvDatabaseURL); err != nil {
		return err
	}
	log.Debug("configuration", "config", cfg)

	conn, err := connect(ctx, cfg)
	if err != nil {
		return err
	}
	defer func() { _ = conn.Close(context.WithoutCancel(ctx)) }()

	all, err := migrations.All()
	if err != nil {
		return err
	}
	names := make(map[int]string, len(all))
	for _, m := range all {
		names[m.Version] = m.Name
	}
	applied, err := migrations.UpWith(ctx, conn, opts)
	for _, v := range applied { // also those applied before a failure
		log.Info("migration applied", "version", v, "name", names[v])
	}
	if err != nil {
		return fmt.Errorf("apply migrations: %w", err)
	}
	versions, err := migrations.AppliedIn(ctx, conn, cfg.Schema)
	if err != nil {
		return err
	}
	current := 0
	if len(versions) > 0 {
		current = versions[len(versions)-1]
	}
	if len(applied) == 0 {
		log.Info("schema already current", "version", current)
	}
	if latest := migrations.Latest(); current > latest {
		log.Warn("database schema is newer than this binary", "version", current, "binary_version", latest)
	}
	fmt.Fprintf(stdout, "schema at version %d\n", current)
	return nil
}

// connect opens one connection to cfg.DatabaseURL. Its errors never hold the password.
func connect(ctx context.Context, cfg *config.Config) (*pgx.Conn, error) {
	pc, err := pgx.ParseConfig(cfg.DatabaseURL)
	if err != nil {
		// pgx's parse errors may quote parts of the string: show only the redacted value.
		return nil, fmt.Errorf("%s: not a usable PostgreSQL connection string: %s",
			cfg.Source(config.EnvDatabaseURL), config.Redact(cfg.DatabaseURL))
	}
	if pc.ConnectTimeout == 0 {
		pc.ConnectTimeout = connectTimeout // an unreachable host must not hang the command
	}
	pc.RuntimeParams["search_path"] = pgx.Identifier{cfg.Schema}.Sanitize()
	conn, err := pgx.ConnectConfig(ctx, pc)
	if err != nil {
		return nil, fmt.Errorf("connect to PostgreSQL: %w", err)
	}
	return conn, nil
}
