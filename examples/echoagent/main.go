// Command echoagent is a Baton worker to copy: the echo agent of package
// github.com/batonhq/baton/examples/echo (a deterministic echo "model", one read tool and an
// optional write tool) wired to the consumer package. Start from here and replace
// echo.Agent.Handle with your model loop.
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
// agent_outbox and needs no relay. The URLs may come from files (BATON_DATABASE_URL_FILE,
// BATON_NATS_URL_FILE), and the NATS login and TLS from BATON_NATS_CREDS, BATON_NATS_NKEY,
// BATON_NATS_CA, BATON_NATS_CERT and BATON_NATS_KEY (paths; see package natsconn). The pool size comes from the URL (pool_max_conns=...).
// With BATON_METRICS_ADDR (--metrics-addr) it serves Prometheus metrics at /metrics and
// probes at /healthz (alive) and /readyz (Postgres and, with JetStream, NATS reachable: 503
// and why otherwise). With OTEL_EXPORTER_OTLP_ENDPOINT (or the other OTEL_* variables of
// package tracing) it exports one span per turn, with its claim, tool and commit spans, in
// the trace of the message's sender. SIGINT, SIGTERM or SIGHUP stops it gracefully: running turns get
// --shutdown-grace (default 10s) to finish, then they are cancelled.
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
	"log/slog"
	"net"
	"net/http"
	"os"
	"os/signal"
	"strings"
	"syscall"
	"time"

	"github.com/caarlos0/env/v11"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"golang.org/x/sync/errgroup"

	"github.com/batonhq/baton/consumer"
	"github.com/batonhq/baton/examples/echo"
	"github.com/batonhq/baton/natsconn"
	"github.com/batonhq/baton/tracing"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM, syscall.SIGHUP)
	err := run(ctx)
	stop()
	if err != nil {
		fmt.Fprintln(os.Stderr, "echoagent:", err)
		os.Exit(1)
	}
}

// config is echoagent's configuration from the environment. An empty or unset variable takes
// the default; flags override the environment.
type config struct {
	DatabaseURL     string `env:"BATON_DATABASE_URL"`
	DatabaseURLFile string `env:"BATON_DATABASE_URL_FILE"`
	NATSURL         string `env:"BATON_NATS_URL"`
	NATSURLFile     string `env:"BATON_NATS_URL_FILE"`
	NATSCreds       string `env:"BATON_NATS_CREDS"`
	NATSNKey        string `env:"BATON_NATS_NKEY"`
	NATSCA          string `env:"BATON_NATS_CA"`
	NATSCert        string `env:"BATON_NATS_CERT"`
	NATSKey         string `env:"BATON_NATS_KEY"`
	SubjectPrefix   string `env:"BATON_SUBJECT_PREFIX" envDefault:"agent"`
	Schema          string `env:"BATON_SCHEMA" envDefault:"public"`
	MetricsAddr     string `env:"BATON_METRICS_ADDR"`
	LogLevel        string `env:"BATON_LOG_LEVEL" envDefault:"info"`
	LogFormat       string `env:"BATON_LOG_FORMAT" envDefault:"text"`
}

func run(ctx context.Context) error {
	cfg, err := env.ParseAs[config]()
	if err != nil {
		return fmt.Errorf("read configuration from the environment: %w", err)
	}
	flag.Var(envFlag{&cfg.DatabaseURL}, "database-url", "PostgreSQL `url` (postgres://... or key=value) [env BATON_DATABASE_URL]")
	flag.Var(envFlag{&cfg.DatabaseURLFile}, "database-url-file", "`file` holding the PostgreSQL url [env BATON_DATABASE_URL_FILE]")
	flag.Var(envFlag{&cfg.NATSURL}, "nats-url", "NATS server `url`s, comma-separated [env BATON_NATS_URL]")
	flag.Var(envFlag{&cfg.NATSURLFile}, "nats-url-file", "`file` holding the NATS url(s) [env BATON_NATS_URL_FILE]")
	flag.Var(envFlag{&cfg.NATSCreds}, "nats-creds", "NATS user credentials `file` (.creds) [env BATON_NATS_CREDS]")
	flag.Var(envFlag{&cfg.NATSNKey}, "nats-nkey", "`file` holding a NATS user nkey seed [env BATON_NATS_NKEY]")
	flag.Var(envFlag{&cfg.NATSCA}, "nats-ca", "PEM `file` of the CAs that verify the NATS server [env BATON_NATS_CA]")
	flag.Var(envFlag{&cfg.NATSCert}, "nats-cert", "PEM client certificate `file` for NATS [env BATON_NATS_CERT]")
	flag.Var(envFlag{&cfg.NATSKey}, "nats-key", "PEM private key `file` of --nats-cert [env BATON_NATS_KEY]")
	flag.Var(envFlag{&cfg.SubjectPrefix}, "subject-prefix", "subject `prefix` (default agent) [env BATON_SUBJECT_PREFIX]")
	flag.Var(envFlag{&cfg.MetricsAddr}, "metrics-addr", "metrics listen `addr`ess host:port (default off) [env BATON_METRICS_ADDR]")
	flag.Var(envFlag{&cfg.LogLevel}, "log-level", "log `level`: debug, info, warn, error (default info) [env BATON_LOG_LEVEL]")
	flag.Var(envFlag{&cfg.LogFormat}, "log-format", "log `format`: text or json (default text) [env BATON_LOG_FORMAT]")
	var agent echo.Agent
	flag.DurationVar(&agent.Latency, "model-latency", 0, "how long each simulated model call takes")
	var h hooks
	h.bindFlags(flag.CommandLine)
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
	log, err := newLogger(cfg.LogLevel, cfg.LogFormat)
	if err != nil {
		return err
	}
	// A URL may come from a file (a mounted secret); the NATS settings become options below.
	if cfg.DatabaseURL, err = natsconn.ValueOrFile("BATON_DATABASE_URL", cfg.DatabaseURL, "BATON_DATABASE_URL_FILE", cfg.DatabaseURLFile); err != nil {
		return err
	}
	if cfg.NATSURL, err = natsconn.ValueOrFile(natsconn.EnvURL, cfg.NATSURL, natsconn.EnvURLFile, cfg.NATSURLFile); err != nil {
		return err
	}
	if cfg.DatabaseURL == "" {
		return errors.New("BATON_DATABASE_URL is not set: set it or pass --database-url")
	}
	if cfg.MetricsAddr != "" {
		if _, _, err := net.SplitHostPort(cfg.MetricsAddr); err != nil {
			return fmt.Errorf("BATON_METRICS_ADDR (--metrics-addr) must be host:port or :port (got %q)", cfg.MetricsAddr)
		}
	}
	if err := h.check(); err != nil {
		return err
	}
	h.apply(&agent) // test hooks (hooks.go)
	if *source == "" {
		*source = "polling"
		if cfg.NATSURL != "" {
			*source = "jetstream"
		}
	}

	// user:password@host/db without postgres:// parses as key=value with the password in a key
	// the server then quotes in its error: refuse it.
	if key, _, _ := strings.Cut(cfg.DatabaseURL, "="); !strings.Contains(cfg.DatabaseURL, "://") && strings.ContainsAny(key, ":@/") {
		return errors.New("BATON_DATABASE_URL must be a postgres:// URL or key=value pairs")
	}
	pcfg, err := pgxpool.ParseConfig(cfg.DatabaseURL)
	if err != nil { // its text may quote the URL, password included
		return errors.New("BATON_DATABASE_URL is not a usable PostgreSQL connection string")
	}
	// The worker's statements name Baton's tables without a schema: search only BATON_SCHEMA.
	pcfg.ConnConfig.RuntimeParams["search_path"] = pgx.Identifier{cfg.Schema}.Sanitize()
	pool, err := pgxpool.NewWithConfig(ctx, pcfg)
	if err != nil {
		return fmt.Errorf("connect to Postgres: %w", err)
	}
	defer pool.Close()
	switch *source {
	case "jetstream":
		if cfg.NATSURL == "" {
			return errors.New("BATON_NATS_URL is not set: set it or pass --nats-url")
		}
		settings := natsconn.Settings{URL: cfg.NATSURL, Creds: cfg.NATSCreds, NKey: cfg.NATSNKey,
			CA: cfg.NATSCA, Cert: cfg.NATSCert, Key: cfg.NATSKey}
		// A refused login ends here, with an error naming the servers and the settings.
		nc, err := settings.Connect(nats.Name("echoagent"), nats.MaxReconnects(-1))
		if err != nil {
			return err
		}
		defer nc.Close()
		wc.NATS = nc
	case "polling":
	default:
		return fmt.Errorf("--source must be jetstream or polling, not %q", *source)
	}

	// Traces, when the OTEL_* variables ask for them; off otherwise. Flushed on the way out.
	shutdownTracing, err := tracing.Setup(ctx)
	if err != nil {
		return err
	}
	defer tracing.Stop(ctx, shutdownTracing, log)

	reg := prometheus.NewRegistry()
	reg.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	wc.Pool, wc.Handler, wc.SubjectPrefix, wc.Logger, wc.Registerer = pool, agent.Handle, cfg.SubjectPrefix, log, reg
	wc.Schema = cfg.Schema
	w, err := consumer.New(wc)
	if err != nil {
		return err
	}
	log.Info("echoagent started", "source", *source, "subject_prefix", cfg.SubjectPrefix, "metrics_addr", cfg.MetricsAddr)
	g, gctx := errgroup.WithContext(ctx)
	g.Go(func() error {
		if err := w.Run(gctx); err != nil {
			return err
		}
		return errStopped // stop the metrics server too
	})
	if cfg.MetricsAddr != "" {
		g.Go(func() error { return serveMetrics(gctx, log, cfg.MetricsAddr, reg, w.Ready) })
	}
	if err := g.Wait(); err != nil && !errors.Is(err, errStopped) {
		return err
	}
	log.Info("echoagent stopped")
	return nil
}

// errStopped ends the errgroup when the worker returned cleanly.
var errStopped = errors.New("stopped")

// serveMetrics serves Prometheus metrics at /metrics and the probes /healthz ("ok" while the
// process runs) and /readyz ("ok" while ready, consumer.Worker.Ready, else 503 and why) on
// addr until ctx ends, logging the address it bound ("metrics listening", addr).
func serveMetrics(ctx context.Context, log *slog.Logger, addr string, reg *prometheus.Registry, ready func(context.Context) error) error {
	mux := http.NewServeMux()
	mux.Handle("GET /metrics", promhttp.HandlerFor(reg, promhttp.HandlerOpts{Registry: reg}))
	mux.HandleFunc("GET /healthz", func(w http.ResponseWriter, _ *http.Request) { _, _ = w.Write([]byte("ok\n")) })
	mux.HandleFunc("GET /readyz", func(w http.ResponseWriter, r *http.Request) {
		rctx, cancel := context.WithTimeout(r.Context(), 2*time.Second)
		defer cancel()
		if err := ready(rctx); err != nil {
			http.Error(w, err.Error(), http.StatusServiceUnavailable)
			return
		}
		_, _ = w.Write([]byte("ok\n"))
	})
	var lc net.ListenConfig
	ln, err := lc.Listen(ctx, "tcp", addr)
	if err != nil {
		return fmt.Errorf("metrics listener: %w", err)
	}
	// With port 0 the system picks a free port: the log line says which.
	log.Info("metrics listening", "addr", ln.Addr().String())
	srv := &http.Server{Handler: mux, ReadHeaderTimeout: 5 * time.Second}
	stop := context.AfterFunc(ctx, func() {
		sctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		_ = srv.Shutdown(sctx)
	})
	defer stop()
	if err := srv.Serve(ln); !errors.Is(err, http.ErrServerClosed) {
		return fmt.Errorf("metrics server: %w", err)
	}
	return nil
}

// envFlag is a flag that overrides a value read from the environment. Its String is empty, so
// -h never prints the value, which may hold a password.
type envFlag struct{ p *string }

func (f envFlag) String() string     { return "" }
func (f envFlag) Set(s string) error { *f.p = s; return nil }

// newLogger returns a logger writing to stderr at level ("debug", "info", "warn", "error")
// in format ("text" or "json").
func newLogger(level, format string) (*slog.Logger, error) {
	var l slog.Level
	if err := l.UnmarshalText([]byte(level)); err != nil {
		return nil, fmt.Errorf("BATON_LOG_LEVEL (--log-level) must be debug, info, warn or error (got %q)", level)
	}
	opts := &slog.HandlerOptions{Level: l}
	switch format {
	case "text":
		return slog.New(slog.NewTextHandler(os.Stderr, opts)), nil
	case "json":
		return slog.New(slog.NewJSONHandler(os.Stderr, opts)), nil
	}
	return nil, fmt.Errorf("BATON_LOG_FORMAT (--log-format) must be text or json (got %q)", format)
}
