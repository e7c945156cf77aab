// Command echoagent is a Baton worker to copy: a deterministic echo "model", one read tool
// and an optional write tool, wired to the consumer package. Start from here and replace
// agent.handle with your model loop.
//
// Run it next to the relay (configuration comes from BATON_* variables; flags override them):
//
//	export BATON_DATABASE_URL=postgres://baton@localhost:5432/baton
//	export BATON_NATS_URL=nats://localhost:4222
//	baton migrate
//	baton relay &
//	go run ./examples/echoagent --model-latency 200ms
//
// Start as many as you like: at most one turn per conversation runs at a time across all of
// them. Without BATON_NATS_URL (or with --source polling) the worker claims straight from
// agent_outbox and needs no relay. The pool size comes from the URL (pool_max_conns=...).
// SIGINT or SIGTERM stops it gracefully: running turns get --shutdown-grace (default 10s) to
// finish, then they are cancelled.
//
// hooks.go holds the test hooks --write-tool, --fail and --pause-at <point>, which tests use
// to hold a turn at a point (model, after-read, during-write, after-write, before-commit) and
// kill, stop or freeze the process exactly there.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"os"
	"os/signal"
	"strings"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go"
	"golang.org/x/sync/errgroup"

	"github.com/batonhq/baton/consumer"
	"github.com/batonhq/baton/internal/config"
	"github.com/batonhq/baton/internal/opsserver"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	err := run(ctx)
	stop()
	if err != nil {
		fmt.Fprintln(os.Stderr, "echoagent:", err)
		os.Exit(1)
	}
}

func run(ctx context.Context) error {
	cfg, err := config.FromEnv()
	if err != nil {
		return err
	}
	cfg.BindFlags(flag.CommandLine, config.EnvDatabaseURL, config.EnvNATSURL, config.EnvSubjectPrefix,
		config.EnvMetricsAddr, config.EnvLogLevel, config.EnvLogFormat)
	var a agent
	flag.DurationVar(&a.latency, "model-latency", 0, "how long each simulated model call takes")
	a.hooks.bindFlags(flag.CommandLine)
	source := flag.String("source", "", "`source` of turns: jetstream or polling (default jetstream when a NATS URL is set)")
	var wc consumer.Config
	flag.DurationVar(&wc.Debounce, "debounce", 0, "wait after a conversation's first event before claiming (default 5ms)")
	flag.DurationVar(&wc.Lease, "lease", 0, "lease of a claim, renewed while the turn runs (default 30s)")
	flag.IntVar(&wc.MaxAttempts, "max-attempts", 0, "claims of a request before it fails visibly (default 3)")
	flag.IntVar(&wc.MaxConcurrentTurns, "concurrency", 0, "turns this worker runs at once (default 128)")
	flag.DurationVar(&wc.RecoveryInterval, "recovery-interval", 0, "how often expired leases are recovered (default 5s)")
	flag.DurationVar(&wc.AckWait, "ack-wait", 0, "JetStream ack wait of the shared durable consumer (default 30s)")
	flag.DurationVar(&wc.ShutdownGrace, "shutdown-grace", 0, "how long running turns may finish after SIGTERM before they are cancelled (default 10s)")
	flag.Parse()
	if flag.NArg() > 0 {
		return fmt.Errorf("unexpected argument %q", flag.Arg(0))
	}
	if err := cfg.Validate(); err != nil {
		return err
	}
	if err := cfg.Require(config.EnvDatabaseURL); err != nil {
		return err
	}
	if err := a.hooks.check(); err != nil {
		return err
	}
	if *source == "" {
		*source = "polling"
		if cfg.NATSURL != "" {
			*source = "jetstream"
		}
	}
	log := cfg.Logger(os.Stderr)

	pool, err := pgxpool.New(ctx, cfg.DatabaseURL)
	if err != nil {
		return fmt.Errorf("connect to Postgres at %s: %w", config.Redact(cfg.DatabaseURL), err)
	}
	defer pool.Close()
	switch *source {
	case "jetstream":
		if err := cfg.Require(config.EnvNATSURL); err != nil {
			return err
		}
		nc, err := nats.Connect(cfg.NATSURL, nats.Name("echoagent"), nats.MaxReconnects(-1))
		if err != nil {
			return fmt.Errorf("connect to NATS at %s: %w", config.Redact(cfg.NATSURL), err)
		}
		defer nc.Close()
		wc.NATS = nc
	case "polling":
	default:
		return fmt.Errorf("--source must be jetstream or polling, not %q", *source)
	}

	reg := opsserver.NewRegistry()
	wc.Pool, wc.Handler, wc.SubjectPrefix, wc.Logger, wc.Registerer = pool, a.handle, cfg.SubjectPrefix, log, reg
	w, err := consumer.New(wc)
	if err != nil {
		return err
	}
	log.Info("echoagent started", "source", *source, "config", cfg)
	g, gctx := errgroup.WithContext(ctx)
	g.Go(func() error {
		if err := w.Run(gctx); err != nil {
			return err
		}
		return errStopped // stop the metrics server too
	})
	if cfg.MetricsAddr != "" {
		g.Go(func() error { return opsserver.Serve(gctx, cfg.MetricsAddr, reg, nil) })
	}
	if err := g.Wait(); err != nil && !errors.Is(err, errStopped) {
		return err
	}
	log.Info("echoagent stopped")
	return nil
}

// errStopped ends the errgroup when the worker returned cleanly.
var errStopped = errors.New("stopped")

// agent is the turn handler: a model call, a read tool, optionally a write tool, then the reply.
type agent struct {
	latency time.Duration
	hooks   // test hooks (hooks.go)
}

func (a *agent) handle(ctx context.Context, t *consumer.Turn) (consumer.Reply, error) {
	if err := a.failure(); err != nil {
		return consumer.Reply{}, err
	}
	reply, err := a.model(ctx, t)
	if err != nil {
		return consumer.Reply{}, err
	}
	// Tools go through t.Tool, which records each call before it runs. A read tool only looks,
	// so a turn that called it may be replayed.
	if _, err := t.Tool(ctx, "lookup", consumer.Read, map[string]string{"conversation_id": t.ConversationID},
		func(ctx context.Context) (any, error) {
			history, err := t.History(ctx, 100)
			if err != nil {
				return nil, err
			}
			return map[string]int{"history_messages": len(history)}, nil
		}); err != nil {
		return consumer.Reply{}, err
	}
	if err := a.pause(ctx, "after-read", t); err != nil {
		return consumer.Reply{}, err
	}
	// A write tool changes the world (an email, a payment): once it ran, a lost or failed turn
	// ends as a visible error instead of a replay.
	if a.writeTool {
		if _, err := t.Tool(ctx, "notify", consumer.Write, map[string]string{"text": reply},
			func(ctx context.Context) (any, error) {
				if err := a.pause(ctx, "during-write", t); err != nil {
					return nil, err // cancelled mid-call: it may or may not have been sent
				}
				return map[string]bool{"sent": true}, nil // a real tool would call out here
			}); err != nil {
			return consumer.Reply{}, err
		}
		if err := a.pause(ctx, "after-write", t); err != nil {
			return consumer.Reply{}, err
		}
	}
	if err := a.pause(ctx, "before-commit", t); err != nil {
		return consumer.Reply{}, err
	}
	return consumer.Reply{Content: reply}, nil
}

// model stands in for an LLM call: it takes --model-latency and echoes the turn's messages.
func (a *agent) model(ctx context.Context, t *consumer.Turn) (string, error) {
	if err := a.pause(ctx, "model", t); err != nil {
		return "", err
	}
	select {
	case <-time.After(a.latency):
	case <-ctx.Done():
		return "", ctx.Err()
	}
	parts := make([]string, len(t.Messages))
	for i, m := range t.Messages {
		parts[i] = m.Content
	}
	return "echo: " + strings.Join(parts, " | "), nil
}
