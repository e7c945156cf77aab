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
for teams that apply migrations with their own tool, and needs no database.

With --shards N it also creates the publications <BATON_PUBLICATION>_0 … _<N-1>, one per
sharded relay (baton relay --shard K/N), each publishing the conversations whose
(hashtextextended(conversation_id, 0) & 9223372036854775807) % N = K. Run again with the same
N, it changes nothing. With another N it redefines them, creates the missing ones and drops
those past N-1, but only when no slot <BATON_SLOT>_<K> exists: drain and drop the shard slots
first (README, "Resharding"). Without --shards, shard publications are left as they are.`, stderr)
	printSQL := fs.Bool("print", false, "write the migrations as one SQL script to stdout instead of applying them")
	shards := fs.Int("shards", 0, "also create the publications of `N` sharded relays (1…256; 0: none)")
	cfg, log, err := configure(fs, args, stderr, config.EnvDatabaseURL, config.EnvSchema, config.EnvPublication, config.EnvSlot)
	if err != nil {
		return err
	}
	opts := migrations.Options{Schema: cfg.Schema, Publication: cfg.Publication}
	shardOpts := migrations.ShardOptions{Options: opts, Slot: cfg.Slot}
	if *shards != 0 {
		if err := migrations.CheckShard(0, *shards); err != nil {
			return usageError{msg: "--shards: " + err.Error()}
		}
	}
	if *printSQL {
		if err := migrations.Print(stdout, opts); err != nil {
			return err
		}
		if *shards == 0 {
			return nil
		}
		return migrations.PrintShards(stdout, shardOpts, *shards)
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
	if *shards != 0 {
		res, err := migrations.EnsureShards(ctx, conn, shardOpts, *shards)
		if err != nil {
			return fmt.Errorf("shard publications: %w", err)
		}
		if !res.Changed() {
			log.Info("shard publications already current", "shards", *shards)
		}
		for _, what := range []struct {
			msg   string
			names []string
		}{{"shard publication created", res.Created}, {"shard publication redefined", res.Altered}, {"shard publication dropped", res.Dropped}} {
			for _, name := range what.names {
				log.Info(what.msg, "publication", name, "shards", *shards)
			}
		}
	}
	fmt.Fprintf(stdout, "schema at version %d\n", current)
	if *shards != 0 {
		fmt.Fprintf(stdout, "%d shard publications %s … %s\n", *shards,
			migrations.ShardName(cfg.Publication, 0), migrations.ShardName(cfg.Publication, *shards-1))
	}
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
