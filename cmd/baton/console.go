package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go"

	"github.com/batonhq/baton/internal/config"
	"github.com/batonhq/baton/internal/console"
)

const consoleSummary = "serve a web console: chat through the producer, each message's journey, the system's health"

const consoleDescription = `Console serves a web console on --addr (BATON_CONSOLE_ADDR, default 127.0.0.1:8080):

  /               chat: pick or create a conversation and send messages through the producer;
                  each shows local, synchronized, queued, running, replied or failed, pushed
                  live from Postgres (and woken by the outcomes on NATS)
  /system         the report of baton status --json, turns/s and reply latency, workers seen
  /messages/<id>  one message's timeline: written, queued, claimed, operations, reply or error

It reads Baton's tables and writes only by sending messages (producer.Send). Connect it as its
own role, baton_console (deploy/postgres/roles.sql). Without BATON_NATS_URL it polls only and
shows no streams.

Basic auth: BATON_CONSOLE_USER with BATON_CONSOLE_PASSWORD or BATON_CONSOLE_PASSWORD_FILE
(--user, --password-file). Without auth it listens only on a loopback address: any other
address is refused (exit 2). One client IP address holds at most --max-streams-per-client
event streams (watched conversations) at once. SIGTERM, SIGINT or SIGHUP stop it.`

func runConsole(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	fs := newFlagSet("console", consoleDescription, stderr)
	settings, err := console.SettingsFromEnv()
	if err != nil {
		return err
	}
	fs.StringVar(&settings.Addr, "addr", settings.Addr, "listen `host:port` [env "+console.EnvAddr+"]")
	fs.StringVar(&settings.User, "user", settings.User, "basic auth `user` [env "+console.EnvUser+"]")
	fs.StringVar(&settings.PasswordFile, "password-file", settings.PasswordFile,
		"`file` holding the basic auth password [env "+console.EnvPasswordFile+"; or "+console.EnvPassword+"]")
	fs.IntVar(&settings.MaxStreamsPerClient, "max-streams-per-client", console.DefaultMaxStreamsPerClient,
		"the most event streams (watched conversations) one client IP address holds at once")
	cfg, log, err := configure(fs, args, stderr, config.EnvDatabaseURL, config.EnvNATSURL,
		config.EnvSubjectPrefix, config.EnvSlot, config.EnvPublication, config.EnvSchema)
	if err != nil {
		return err
	}
	if err := cfg.Require(config.EnvDatabaseURL); err != nil {
		return err
	}
	if err := settings.Resolve(); err != nil {
		return usageError{msg: err.Error()}
	}
	if settings.MaxStreamsPerClient < 1 {
		return usageError{msg: "--max-streams-per-client must be at least 1"}
	}
	log.Info("starting console", "config", cfg, "console", settings)
	return serveConsole(ctx, cfg, settings, log, func(url string) {
		fmt.Fprintf(stdout, "console on %s\n", url)
	})
}

// serveConsole connects to cfg's database and NATS (when set) and serves the console until ctx
// ends. listening gets the console's URL once it listens.
func serveConsole(ctx context.Context, cfg *config.Config, settings console.Settings, log *slog.Logger, listening func(string)) error {
	pcfg, err := pgxpool.ParseConfig(cfg.DatabaseURL)
	if err != nil {
		return fmt.Errorf("%s: not a usable PostgreSQL connection string: %s",
			cfg.Source(config.EnvDatabaseURL), config.Redact(cfg.DatabaseURL))
	}
	pcfg.MaxConns = 8
	if pcfg.ConnConfig.ConnectTimeout == 0 {
		pcfg.ConnConfig.ConnectTimeout = connectTimeout
	}
	pcfg.ConnConfig.RuntimeParams["search_path"] = pgx.Identifier{cfg.Schema}.Sanitize()
	pcfg.ConnConfig.RuntimeParams["application_name"] = "baton-console"
	pool, err := pgxpool.NewWithConfig(ctx, pcfg)
	if err != nil {
		return fmt.Errorf("connect to PostgreSQL: %w", err)
	}
	defer pool.Close()
	if err := pool.Ping(ctx); err != nil {
		if ctx.Err() != nil {
			return nil
		}
		return fmt.Errorf("connect to PostgreSQL: %w", err)
	}
	var nc *nats.Conn
	if cfg.NATSURL != "" {
		nc, err = connectNATS(cfg, "baton-console",
			nats.ErrorHandler(func(_ *nats.Conn, _ *nats.Subscription, err error) { log.Warn("NATS error", "error", err) }))
		if err != nil {
			return err
		}
		defer closeNATS(nc)
	}
	srv, err := console.New(console.Config{
		Pool: pool, NATS: nc, NATSURL: config.Redact(cfg.NATSURL),
		Schema: cfg.Schema, SubjectPrefix: cfg.SubjectPrefix, Slot: cfg.Slot, Publication: cfg.Publication,
		User: settings.User, Password: settings.Password, MaxStreamsPerClient: settings.MaxStreamsPerClient, Logger: log,
	})
	if err != nil {
		return err
	}
	if err := srv.ListenAndServe(ctx, settings.Addr, listening); err != nil && !errors.Is(err, context.Canceled) {
		return err
	}
	return nil
}
