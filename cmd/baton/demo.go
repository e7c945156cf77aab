package main

import (
	"context"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"os"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"golang.org/x/sync/errgroup"

	"github.com/batonhq/baton/consumer"
	"github.com/batonhq/baton/examples/echo"
	"github.com/batonhq/baton/internal/config"
	"github.com/batonhq/baton/internal/console"
	"github.com/batonhq/baton/internal/demo"
	"github.com/batonhq/baton/internal/opsserver"
	"github.com/batonhq/baton/migrations"
	"github.com/batonhq/baton/producer"
	"github.com/batonhq/baton/relay"
)

const demoSummary = "send messages through producer, relay, JetStream and two echo workers, and check each gets exactly one outcome"

const demoDescription = `Demo runs Baton end to end on this machine. It sends user messages with the producer over
many conversations, and runs in this process the relay, two echo-agent workers (demo-worker-1
and demo-worker-2, each with a connection pool of its own) and an outcome subscriber. It follows
the turns stream, to check that every accepted message reached JetStream once, and the outcomes
stream, to check that every accepted message got exactly one terminal outcome: an assistant
reply, or a visible failure (an error message in the conversation). About 5% of the messages are
sent a second time with the same id, as a client retrying after a timeout would: each retry must
come back as AlreadyAccepted with the same outbox row, and write nothing.

The workers' handler calls a read tool (lookup, recorded as an operation) and replies with an
echo of the turn's messages. --model-latency makes each turn take longer; --fail-every N makes
every turn of every Nth conversation fail, so its messages end as visible failures after 2
attempts.

Without BATON_DATABASE_URL it starts a throwaway PostgreSQL cluster (the machine's server
binaries, a temp dir, a free port); without BATON_NATS_URL an embedded NATS JetStream server.
Both are stopped and removed when the demo ends, also on Ctrl-C.

With BATON_DATABASE_URL set, the demo WRITES TO THAT DATABASE: it applies the migrations and
adds conversations, messages, outbox rows, runs and operations whose conversation and message
ids start with "demo-"; its relay uses the configured slot (BATON_SLOT) and publication,
creating the slot if it is missing; and its workers join the durable consumer "baton-workers"
and answer EVERY pending message in that database with an echo. Point it at a scratch database.
With BATON_NATS_URL set, it uses the configured streams (BATON_SUBJECT_PREFIX).

The summary ends the demo: sent, retries, relayed, replied, failed visibly, lost (accepted
messages with neither a reply nor a visible failure after the tail wait), duplicates (an event
stored twice in a stream, or a message answered twice) and commit→reply latency. Ctrl-C stops
sending, gives the workers a moment to answer what was accepted and reports the rest as
unfinished, not lost. Exit status 0 when nothing was lost or doubled, 1 otherwise. Logs go to
stderr at level warn (the workers' at error) unless BATON_LOG_LEVEL or --log-level say otherwise.

--console keeps everything running after the summary (the servers, the relay and the workers)
and serves the web console of baton console on --console-addr (BATON_CONSOLE_ADDR, default
127.0.0.1:8080), printing its URL, until Ctrl-C: chat with the echo agent and look at each
message's journey and the system's state.`

// demoOptions are the demo's own flags.
type demoOptions struct {
	messages      int
	conversations int
	rate          float64
	tailTimeout   time.Duration
	modelLatency  time.Duration
	failEvery     int
	console       bool
}

func runDemo(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	fs := newFlagSet("demo", demoDescription, stderr)
	var opts demoOptions
	fs.IntVar(&opts.messages, "messages", demo.DefaultMessages, "messages to send")
	fs.IntVar(&opts.conversations, "conversations", demo.DefaultConversations, "conversations to spread the messages over")
	fs.Float64Var(&opts.rate, "rate", demo.DefaultRate, "messages per second; 0 sends as fast as possible")
	fs.DurationVar(&opts.tailTimeout, "tail-timeout", demo.DefaultTailTimeout,
		"after the last send, how long to wait for every message's outcome")
	fs.DurationVar(&opts.modelLatency, "model-latency", 0, "how long each simulated model call of the workers takes")
	fs.IntVar(&opts.failEvery, "fail-every", 0,
		"make every turn of every `N`th conversation fail, ending in visible failures (0: none)")
	fs.BoolVar(&opts.console, "console", false, "after the run, keep the servers, the relay and the workers running and serve\n"+
		"the web console (baton console) on --console-addr until interrupted")
	consoleSettings, err := console.SettingsFromEnv()
	if err != nil {
		return err
	}
	fs.StringVar(&consoleSettings.Addr, "console-addr", consoleSettings.Addr, "with --console, the console's listen `host:port` [env "+console.EnvAddr+"]")
	cfg, log, err := configureDemo(fs, args, stderr)
	if err != nil {
		return err
	}
	var withConsole *console.Settings
	if opts.console {
		if err := consoleSettings.Resolve(); err != nil {
			return usageError{msg: err.Error()}
		}
		withConsole = &consoleSettings
	}
	switch {
	case opts.messages < 1:
		return usageError{msg: "--messages must be at least 1"}
	case opts.conversations < 1:
		return usageError{msg: "--conversations must be at least 1"}
	case opts.rate < 0:
		return usageError{msg: "--rate must not be negative (0 sends as fast as possible)"}
	case opts.tailTimeout <= 0:
		return usageError{msg: "--tail-timeout must be positive"}
	case opts.modelLatency < 0:
		return usageError{msg: "--model-latency must not be negative"}
	case opts.failEvery < 0:
		return usageError{msg: "--fail-every must not be negative (0 fails nothing)"}
	}
	log.Debug("configuration", "config", cfg)
	// The workers log every failed attempt at warn: with --fail-every that would bury the
	// progress line. They log at error unless the level was chosen.
	workerLog := log
	if os.Getenv(config.EnvLogLevel) == "" && cfg.Source(config.EnvLogLevel) == config.EnvLogLevel {
		wcfg := *cfg
		wcfg.LogLevel = "error"
		workerLog = wcfg.Logger(stderr)
	}
	d, err := demo.New(demo.Config{
		Messages:      opts.messages,
		Conversations: opts.conversations,
		Rate:          opts.rate,
		TailTimeout:   opts.tailTimeout,
		SubjectPrefix: cfg.SubjectPrefix,
		Slot:          cfg.Slot,
		Workers:       demoWorkerNames(),
		ModelLatency:  opts.modelLatency,
		MaxAttempts:   demoMaxAttempts,
		FailEvery:     opts.failEvery,
		Out:           stdout,
		TTY:           isTerminal(stdout),
		Logger:        log,
	})
	if err != nil {
		return err
	}
	return runDemoOn(ctx, d, *cfg, opts.modelLatency, log, workerLog, stdout, withConsole)
}

// configureDemo is configure with warn as the default log level, so the progress line stays
// readable; BATON_LOG_LEVEL and --log-level override it.
func configureDemo(fs *flag.FlagSet, args []string, stderr io.Writer) (*config.Config, *slog.Logger, error) {
	cfg, err := config.FromEnv()
	if err != nil {
		return nil, nil, err
	}
	if os.Getenv(config.EnvLogLevel) == "" {
		cfg.LogLevel = "warn"
	}
	cfg.BindFlags(fs, config.EnvDatabaseURL, config.EnvNATSURL, config.EnvSubjectPrefix, config.EnvSlot,
		config.EnvPublication, config.EnvSchema, config.EnvMetricsAddr, config.EnvLogLevel, config.EnvLogFormat)
	if err := parseFlags(fs, args); err != nil {
		return nil, nil, err
	}
	if err := cfg.Resolve(); err != nil {
		return nil, nil, fmt.Errorf("invalid configuration:\n%w", err)
	}
	return &cfg, cfg.Logger(stderr), nil
}

// isTerminal reports whether w is a character device (a terminal), where the progress line
// can update in place.
func isTerminal(w io.Writer) bool {
	f, ok := w.(*os.File)
	if !ok {
		return false
	}
	st, err := f.Stat()
	return err == nil && st.Mode()&os.ModeCharDevice != 0
}

// runDemoOn starts what cfg does not name (a throwaway PostgreSQL, an embedded NATS), applies
// the migrations, runs the relay and the workers in this process, runs d on them and prints
// its summary. Every resource it starts is released by a defer, on every path. cfg is a copy:
// the URLs of the servers it starts are filled in.
//
// With withConsole set, the workers keep running after the run: the summary is printed, then
// the console is served (on the demo's servers, with the relay and the workers still running,
// so messages sent from it are answered) until ctx ends.
func runDemoOn(ctx context.Context, d *demo.Demo, cfg config.Config, modelLatency time.Duration,
	log, workerLog *slog.Logger, out io.Writer, withConsole *console.Settings) (err error) {
	// Starting servers is not cut short by Ctrl-C: a half-started server would escape the
	// defers below. The checks after each step stop the demo instead.
	startCtx, cancelStart := context.WithTimeout(context.WithoutCancel(ctx), demo.StartTimeout)
	defer cancelStart()

	stopPostgres, err := demoPostgres(startCtx, &cfg, d.RunID(), out)
	if err != nil {
		return err
	}
	defer func() {
		if cerr := stopPostgres(); cerr != nil && err == nil {
			err = cerr
		}
	}()
	if ctx.Err() != nil {
		fmt.Fprintf(out, "interrupted before sending anything\n")
		return nil
	}
	stopNATS, err := demoNATS(&cfg, out)
	if err != nil {
		return err
	}
	defer func() {
		if cerr := stopNATS(); cerr != nil && err == nil {
			err = cerr
		}
	}()

	nc, err := connectNATS(&cfg, "baton-demo")
	if err != nil {
		return err
	}
	defer nc.Close()

	pcfg, err := pgxpool.ParseConfig(cfg.DatabaseURL)
	if err != nil {
		return fmt.Errorf("%s: not a usable PostgreSQL connection string: %s",
			cfg.Source(config.EnvDatabaseURL), config.Redact(cfg.DatabaseURL))
	}
	pcfg.MaxConns = demo.Senders + 2
	if pcfg.ConnConfig.ConnectTimeout == 0 {
		pcfg.ConnConfig.ConnectTimeout = connectTimeout
	}
	// The demo's own reads and the workers' statements find Baton's tables in its schema.
	pcfg.ConnConfig.RuntimeParams["search_path"] = pgx.Identifier{cfg.Schema}.Sanitize()
	pool, err := pgxpool.NewWithConfig(startCtx, pcfg)
	if err != nil {
		return fmt.Errorf("connect to PostgreSQL: %w", err)
	}
	defer pool.Close()
	if _, err := migrations.UpWith(startCtx, pool, migrations.Options{Schema: cfg.Schema, Publication: cfg.Publication}); err != nil {
		return fmt.Errorf("apply migrations: %w", err)
	}
	fmt.Fprintf(out, "  schema at version %d\n", migrations.Latest())

	reg := opsserver.NewRegistry()
	r, err := relay.New(relay.Config{
		DatabaseURL:   cfg.DatabaseURL,
		NATS:          nc,
		SubjectPrefix: cfg.SubjectPrefix,
		Slot:          cfg.Slot,
		Publication:   cfg.Publication,
		Schema:        cfg.Schema,
		Logger:        log,
		Registerer:    reg,
	})
	if err != nil {
		return err
	}
	prod, err := producer.New(producer.Config{Logger: log, Schema: cfg.Schema})
	if err != nil {
		return err
	}
	// The echo agent of examples/echoagent; --fail-every fails a turn once its lookup ran.
	agent := &echo.Agent{Latency: modelLatency, Hook: func(_ context.Context, point string, t *consumer.Turn) error {
		if point != echo.PointAfterRead {
			return nil
		}
		return d.TurnFailure(t.ConversationID)
	}}
	ws, err := newDemoWorkers(startCtx, &cfg, pcfg, agent.Handle, workerLog, reg)
	defer ws.close() // after the errgroup below: the workers have stopped
	if err != nil {
		return err
	}

	// The relay, the workers and the run go under runCtx, not ctx: after Ctrl-C the run stops
	// sending but still gives the workers and the relay a moment to finish what was committed,
	// then stops the workers and ends runCtx.
	runCtx, cancelRun := context.WithCancel(context.WithoutCancel(ctx))
	defer cancelRun()
	g, gctx := errgroup.WithContext(runCtx)
	g.Go(func() error {
		if err := r.Run(gctx); err != nil {
			return fmt.Errorf("relay: %w", err)
		}
		return nil
	})
	if cfg.MetricsAddr != "" {
		g.Go(func() error { return opsserver.Serve(gctx, log, cfg.MetricsAddr, reg, r.Ready) })
	}
	ws.start(gctx, g)
	var res *demo.Result
	summarized := false
	g.Go(func() error {
		defer cancelRun() // the run is done: stop the relay (it drains and confirms) and the rest
		stopWorkers := ws.stop
		if withConsole != nil {
			stopWorkers = func() {} // they answer the console's messages; cancelRun stops them
		}
		var err error
		res, err = d.Run(ctx, gctx, demo.Services{Relay: r, NATS: nc, Pool: pool, Producer: prod, StopWorkers: stopWorkers})
		if err != nil || withConsole == nil || ctx.Err() != nil || gctx.Err() != nil {
			return err
		}
		if res.Started {
			_ = demo.WriteSummary(out, res) // stdout: nothing to do when it fails
			summarized = true
		}
		// Until Ctrl-C (ctx) or the relay or a worker failing (gctx).
		cctx, cancel := context.WithCancel(gctx)
		defer cancel()
		defer context.AfterFunc(ctx, cancel)()
		fmt.Fprintf(out, "serving the console until interrupted; the relay and the workers keep running\n")
		return serveConsole(cctx, &cfg, *withConsole, log, func(url string) {
			fmt.Fprintf(out, "console on %s\n", url)
		})
	})
	err = g.Wait()
	if res != nil && res.Started && !summarized {
		_ = demo.WriteSummary(out, res) // stdout: nothing to do when it fails
	}
	if err != nil {
		return err
	}
	if res == nil {
		return nil
	}
	return res.Verdict()
}
