package main

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"os"
	"strconv"
	"strings"

	"github.com/batonhq/baton/consumer"
	"github.com/batonhq/baton/examples/echo"
	"github.com/batonhq/baton/internal/bench"
	"github.com/batonhq/baton/internal/config"
)

const benchTurnsDescription = `Bench turns measures Baton's worker side end to end: producers commit messages, the relay
(a process of its own: baton relay) publishes them to JetStream, echo workers answer them. The
workers run in this process, each with a pool and a NATS connection of its own, as a worker
process would; so do the producers. Every phase runs on a database the bench creates (schema
migrated, removed afterwards with its replication slot) and on streams of its own (removed
afterwards), so the data of the servers it is given is never touched.

Phases, per source (jetstream: through the relay; polling: workers claim from Postgres, no relay):
  throughput  --turns messages, one conversation each, from 8 producers as fast as they go, to
              each worker count of --workers; a handler that replies at once (no tools).
              turns/s = messages / (first producer commit → last reply commit).
  tools       the same with the first worker count and a handler that calls one read and one
              write tool per turn through the turn's tool API (examples/echo with WriteTool);
              reported as a ratio to the zero-tool rate of the same round.
  latency     each rate of --rates for --latency-duration, to the first worker count;
              p50/p99 of producer commit (Send returned) → reply commit (the run's finished_at).
The figures are set against the turns targets (>= 2,800 turns/s with 1 worker, 4 workers >=
0.95 x 1 worker, p50 <= debounce + 3ms at 200/s, tools >= 0.7 x zero-tool), which decide nothing.

Without BATON_DATABASE_URL it starts a throwaway PostgreSQL cluster; without BATON_NATS_URL an
embedded NATS JetStream server (in this process). A given PostgreSQL needs wal_level=logical and
a role that may create databases and replicate.

Output: a table on stdout (with --rounds N, medians and each round's value in brackets), progress
on stderr. --json writes the report as JSON instead:
  settings            what ran: rounds, turns, rates, workers, latency_seconds, sources, only,
                      producers, worker_conns, max_concurrent_turns, debounce_ms,
                      poll_interval_ms, postgres, nats, relay (command line), profile
  throughput[]        per throughput or tools phase: source, workers, tools, complete (every
                      message replied in every round), and figures sent, done, failed, seconds,
                      turns_per_second, claim_batch, commit_batch (conversations per statement),
                      claim_conflicts, events_nacked, process_cpu_cores (CPU time of this
                      process, which holds workers, producers and an embedded NATS, / seconds)
  latency[]           per latency phase: source, workers, rate, conversations, complete, and
                      figures sent, done, failed, achieved_rate, p50_ms, p99_ms, wait_p50_ms,
                      wait_p99_ms (row written → claimed), turn_p50_ms, turn_p99_ms (claimed →
                      committed), clock_offset_ms (database clock − this process's)
  ratios[]            name and value: ratios of figures of the same round
  targets[]           name, want, value (null: not measured), met (null: not measured; false
                      when not complete), complete (every phase it counts got every reply)
  wall_seconds        the whole run
Every figure is {"median": m, "rounds": [one value per round]}.
Exit status 0 when every message got its reply, 1 otherwise. Logs go to stderr at level warn
unless BATON_LOG_LEVEL or --log-level say otherwise; the relay logs there too.`

// benchTurnsOptions are the flags of bench turns.
type benchTurnsOptions struct {
	turns    int
	rates    benchTurnsInts
	workers  benchTurnsInts
	sources  benchTurnsNames
	only     benchTurnsNames
	rounds   int
	jsonOut  bool
	profile  string
	relayBin string
}

// runBenchTurns runs `baton bench turns`.
func runBenchTurns(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	fs := newFlagSet("bench turns", benchTurnsDescription, stderr)
	opts := benchTurnsOptions{
		rates:   benchTurnsInts(bench.DefaultTurnsRates),
		workers: benchTurnsInts(bench.DefaultTurnsWorkers),
		sources: benchTurnsNames(bench.TurnsSources),
		only:    benchTurnsNames(bench.TurnsKinds),
	}
	fs.IntVar(&opts.turns, "turns", bench.DefaultTurnsTurns, "messages per throughput phase")
	fs.Var(&opts.rates, "rates", "turns per second of the latency phases: a comma-separated `list`")
	fs.Var(&opts.workers, "workers", "worker counts of the throughput phases: a comma-separated `list`; the first is also\n"+
		"the count of the tools and latency phases")
	latency := fs.Duration("latency-duration", bench.DefaultTurnsLatencyDuration, "how long each latency phase sends")
	fs.Var(&opts.sources, "sources", "sources to run: a comma-separated `list` of "+strings.Join(bench.TurnsSources, ", "))
	fs.Var(&opts.only, "only", "kinds of phase to run: a comma-separated `list` of "+strings.Join(bench.TurnsKinds, ", "))
	fs.IntVar(&opts.rounds, "rounds", bench.DefaultTurnsRounds, "run every phase this many times and report medians")
	fs.BoolVar(&opts.jsonOut, "json", false, "write the report as JSON")
	fs.StringVar(&opts.profile, "profile", "", "write a CPU profile of this process (workers, producers) during the first\n"+
		"throughput or tools phase to `dir`/worker.pprof")
	fs.StringVar(&opts.relayBin, "relay-binary", "", "the baton `program` to run `relay` with (default: this program)")
	cfg, log, err := configureBenchTurns(fs, args, stderr)
	if err != nil {
		return err
	}
	switch {
	case opts.turns < 1:
		return usageError{msg: "--turns must be at least 1"}
	case opts.rounds < 1:
		return usageError{msg: "--rounds must be at least 1"}
	case *latency <= 0:
		return usageError{msg: "--latency-duration must be positive"}
	}
	relayBin := opts.relayBin
	if relayBin == "" {
		if relayBin, err = os.Executable(); err != nil {
			return fmt.Errorf("find this program to run the relay with (or give --relay-binary): %w", err)
		}
	}
	b, err := bench.NewTurns(bench.TurnsConfig{
		DatabaseURL:     cfg.DatabaseURL,
		NATS:            cfg.NATS(),
		RelayCommand:    []string{relayBin, "relay"},
		NewWorker:       benchTurnsWorker,
		Turns:           opts.turns,
		Rates:           opts.rates,
		Workers:         opts.workers,
		LatencyDuration: *latency,
		Sources:         opts.sources,
		Only:            opts.only,
		Rounds:          opts.rounds,
		ProfileDir:      opts.profile,
		Progress:        stderr,
		Logger:          log,
		LogLevel:        cfg.LogLevel,
		LogFormat:       cfg.LogFormat,
	})
	if err != nil {
		return usageError{msg: err.Error()}
	}
	rep, err := b.Run(ctx)
	if err != nil {
		if ctx.Err() != nil {
			return errors.New("interrupted; what the bench started was stopped and removed")
		}
		return err
	}
	if opts.jsonOut {
		enc := json.NewEncoder(stdout)
		enc.SetIndent("", "  ")
		if err := enc.Encode(rep); err != nil {
			return fmt.Errorf("write the report: %w", err)
		}
	} else if err := rep.WriteTable(stdout); err != nil {
		return err
	}
	if !rep.Complete() {
		return errors.New("some messages got no reply or failed (see the report)")
	}
	return nil
}

// configureBenchTurns is configure for the database and NATS URLs, with warn as the default
// log level so that the progress lines stay readable; BATON_LOG_LEVEL and --log-level override it.
func configureBenchTurns(fs *flag.FlagSet, args []string, stderr io.Writer) (*config.Config, *slog.Logger, error) {
	cfg, err := config.FromEnv()
	if err != nil {
		return nil, nil, err
	}
	if os.Getenv(config.EnvLogLevel) == "" {
		cfg.LogLevel = "warn"
	}
	cfg.BindFlags(fs, config.EnvDatabaseURL, config.EnvNATSURL, config.EnvLogLevel, config.EnvLogFormat)
	if err := parseFlags(fs, args); err != nil {
		return nil, nil, err
	}
	if err := cfg.Resolve(); err != nil {
		return nil, nil, fmt.Errorf("invalid configuration:\n%w", err)
	}
	return &cfg, cfg.Logger(stderr), nil
}

// benchTurnsWorker builds a bench worker: a consumer.Worker with the echo handler, with or
// without tools.
func benchTurnsWorker(spec bench.TurnsWorkerSpec) (bench.TurnsWorker, error) {
	handler := benchTurnsEcho
	if spec.Tools {
		handler = (&echo.Agent{WriteTool: true}).Handle
	}
	w, err := consumer.New(consumer.Config{
		Pool:               spec.Pool,
		NATS:               spec.NATS,
		Handler:            handler,
		Name:               spec.Name,
		SubjectPrefix:      spec.SubjectPrefix,
		Debounce:           spec.Debounce,
		PollInterval:       spec.PollInterval,
		MaxConcurrentTurns: spec.MaxConcurrentTurns,
		Registerer:         spec.Registerer,
		Logger:             spec.Logger,
	})
	if err != nil {
		return nil, err
	}
	return w, nil
}

// benchTurnsEcho replies at once with the echo of the turn's messages and calls no tool.
func benchTurnsEcho(_ context.Context, t *consumer.Turn) (consumer.Reply, error) {
	return consumer.Reply{Content: echo.Reply(t.Messages)}, nil
}

// benchTurnsInts is a flag holding comma-separated positive integers.
type benchTurnsInts []int

func (v *benchTurnsInts) String() string {
	if v == nil {
		return ""
	}
	s := make([]string, len(*v))
	for i, n := range *v {
		s[i] = strconv.Itoa(n)
	}
	return strings.Join(s, ",")
}

func (v *benchTurnsInts) Set(s string) error {
	var out []int
	for part := range strings.SplitSeq(s, ",") {
		n, err := strconv.Atoi(strings.TrimSpace(part))
		if err != nil || n < 1 {
			return fmt.Errorf("%q is not a positive integer", part)
		}
		out = append(out, n)
	}
	*v = out
	return nil
}

// benchTurnsNames is a flag holding comma-separated names.
type benchTurnsNames []string

func (v *benchTurnsNames) String() string {
	if v == nil {
		return ""
	}
	return strings.Join(*v, ",")
}

func (v *benchTurnsNames) Set(s string) error {
	var out []string
	for part := range strings.SplitSeq(s, ",") {
		if part = strings.TrimSpace(part); part != "" {
			out = append(out, part)
		}
	}
	if len(out) == 0 {
		return errors.New("no name given")
	}
	*v = out
	return nil
}
