package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	"github.com/batonhq/baton/internal/bench"
	"github.com/batonhq/baton/internal/config"
	"github.com/batonhq/baton/internal/throwaway"
)

const benchSummary = "measure Baton on this machine: bench relay (the relay against baselines), bench turns"

const benchUsage = `usage: baton bench <benchmark> [flags]

Bench measures Baton on this machine, on throwaway servers unless BATON_DATABASE_URL and
BATON_NATS_URL name servers of your own (it then creates a database and streams of its own
there, and removes them at the end).

benchmarks:
  relay     the relay, as a process of its own, against baselines measured in the same run:
            decode and publish ceilings and a plain relay (baton bench relay -h)
  turns     the workers' turns (baton bench turns -h)
`

// benchPlainRelay is the hidden benchmark that runs the plain relay, the baseline of `baton
// bench relay`, which starts it as a process of its own.
const benchPlainRelay = "plain-relay"

// runBench dispatches `baton bench <benchmark>`.
func runBench(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	if len(args) == 0 {
		fmt.Fprint(stderr, benchUsage)
		return usageError{}
	}
	switch args[0] {
	case "-h", "-help", "--help":
		fmt.Fprint(stderr, benchUsage)
		return flag.ErrHelp
	case "relay":
		return runBenchRelay(ctx, args[1:], stdout, stderr)
	case "turns":
		return runBenchTurns(ctx, args[1:], stdout, stderr)
	case benchPlainRelay:
		return runBenchPlainRelay(ctx, args[1:], stderr)
	}
	return usageError{msg: fmt.Sprintf("unknown benchmark %q (benchmarks: relay, turns)", args[0])}
}

const benchRelayDescription = `Bench relay measures ` + "`baton relay`" + `, run as its own process the way users run it, against
baselines measured in the same run, on the same backlog, one at a time:

  decode ceiling   a bare pgoutput client that parses every message and does nothing else:
                   one reading eagerly, and one per pause (100, 200, 400 µs) reading the
                   socket in bulk (the walsender sends faster to a client that lets it
                   fill); the highest is the ceiling
  publish ceiling  bare JetStream async publishing of as many turn-shaped events
  plain relay      the simplest correct pipelined relay (` + "`baton bench plain-relay`" + `, a process too)

Parts (--only): catchup (backlogs of --rows rows over 1,000 conversations, 1-row and 100-row
transactions, already in the slot: rows/s, confirm time, CPU per row of the relay, its
walsender and NATS, peak RSS; a CPU profile with --profile), hot (every row in 10 and in 1
conversation: the relay and the plain relay), backfill (a relay's first start on --rows pending
rows) and latency (commit → stored in JetStream at each --rates, p50/p99/max after a 1 s
warm-up, the relay and the plain relay). --rounds N repeats everything N times, interleaved,
and reports each figure's median with each round's value: only same-run ratios over rounds
mean much on a shared machine. --shards N (2…16) adds N shard relays at once to the
catch-ups (baton relay --shard K/N, each a process, on the bench database's shard publications)
and reports their aggregate rows/s next to one relay's in the same run.

Without BATON_DATABASE_URL it starts a throwaway PostgreSQL cluster (the machine's server
binaries), without BATON_NATS_URL an embedded NATS server; both are removed at the end. With
them set, it creates a database baton_bench_<id> on that server (the role must create
databases and replicate), and streams BENCH_<id>_* on that NATS server, and removes both at
the end, also on Ctrl-C. The table (or --json) goes to stdout, progress to stderr.`

// benchRelayOptions are bench relay's own flags.
type benchRelayOptions struct {
	rows, rounds int
	rates, only  string
	latency      time.Duration
	json         bool
	plot         string
	profile      string
	binary       string
	shards       int
}

func runBenchRelay(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	fs := newFlagSet("bench relay", benchRelayDescription, stderr)
	var o benchRelayOptions
	fs.IntVar(&o.rows, "rows", bench.DefaultRows, "rows in each backlog, a multiple of 200")
	fs.IntVar(&o.rounds, "rounds", bench.DefaultRounds, "interleaved rounds; figures are their medians")
	fs.StringVar(&o.rates, "rates", joinInts(bench.DefaultRates), "commit rates of the latency runs, per second, comma-separated")
	fs.DurationVar(&o.latency, "latency-duration", bench.DefaultLatencyDuration, "how long each latency run is measured, after its 1s warm-up")
	fs.StringVar(&o.only, "only", strings.Join(bench.AllParts, ","), "parts to run, comma-separated: "+strings.Join(bench.AllParts, ", "))
	fs.BoolVar(&o.json, "json", false, "print the figures as JSON (fields: see the package doc of internal/bench)")
	fs.StringVar(&o.plot, "plot", "", "write an SVG of the latency distributions to this `file`")
	fs.StringVar(&o.profile, "profile", "", "write a CPU profile of the relay's catch-up to this `dir`ectory (relay-catchup.pprof)")
	fs.IntVar(&o.shards, "shards", 0, "also run `N` shard relays at once in the catch-ups (2…16; 0: none)")
	fs.StringVar(&o.binary, "baton-binary", "", "the baton `program` whose relay (and plain relay) is measured (default: this program)")
	cfg, log, err := configure(fs, args, stderr, config.EnvDatabaseURL, config.EnvNATSURL, config.EnvStreamReplicas)
	if err != nil {
		return err
	}
	rates, err := parseInts(o.rates)
	if err != nil {
		return usageError{msg: "--rates: " + err.Error()}
	}
	switch {
	case o.rows < 200 || o.rows%200 != 0:
		return usageError{msg: "--rows must be a positive multiple of 200"}
	case o.rounds < 1:
		return usageError{msg: "--rounds must be at least 1"}
	case o.latency < 100*time.Millisecond:
		return usageError{msg: "--latency-duration must be at least 100ms"}
	}
	bin := o.binary
	if bin == "" {
		if bin, err = os.Executable(); err != nil {
			return fmt.Errorf("find this program to run its relay: %w", err)
		}
	}
	var parts []string
	for p := range strings.SplitSeq(o.only, ",") {
		parts = append(parts, strings.TrimSpace(p))
	}
	bcfg := bench.Config{
		RelayCommand:      []string{bin, "relay"},
		PlainRelayCommand: []string{bin, "bench", benchPlainRelay},
		Rows:              o.rows,
		Rounds:            o.rounds,
		Rates:             rates,
		LatencyDuration:   o.latency,
		Parts:             parts,
		ProfileDir:        o.profile,
		Shards:            o.shards,
		StreamReplicas:    cfg.Streams().Replicas,
		Progress:          stderr,
		ProgressTTY:       isTerminal(stderr),
		Logger:            log,
	}
	if err := bcfg.Validate(); err != nil {
		return usageError{msg: err.Error()}
	}
	rep, err := runBenchOn(ctx, *cfg, bcfg, stderr)
	if err != nil && ctx.Err() != nil {
		return errors.New("interrupted; what the bench created is removed")
	}
	if err != nil {
		return err
	}
	if o.plot != "" {
		if err := writePlot(rep, o.plot); err != nil {
			return err
		}
	}
	if o.json {
		if rep.Profile != "" { // the table says it; JSON readers get it on stderr
			fmt.Fprintf(stderr, "CPU profile of baton relay's catch-up: %s\n  read it with: go tool pprof -top %s\n", rep.Profile, rep.Profile)
		}
		return rep.WriteJSON(stdout)
	}
	return rep.WriteTable(stdout)
}

// runBenchOn starts what cfg does not name (a throwaway PostgreSQL, an embedded NATS), runs
// the benchmark on them and stops them. cfg is a copy: the URLs of the servers it starts are
// filled in.
func runBenchOn(ctx context.Context, cfg config.Config, bcfg bench.Config, out io.Writer) (rep *bench.Report, err error) {
	// Starting servers is not cut short by Ctrl-C: a half-started server would escape the
	// defers below.
	startCtx, cancelStart := context.WithTimeout(context.WithoutCancel(ctx), 2*time.Minute)
	defer cancelStart()
	// On TCP, as relays reach their database in production (a Unix socket is faster).
	stopPostgres, err := localPostgres(startCtx, &cfg, throwaway.PostgresOptions{TCP: true},
		"the bench creates a database baton_bench_<id> there and drops it at the end",
		func(err error) error {
			return noPostgresErrorFor("the bench", "the bench creates a database of its own there and drops it at the end", err)
		}, out)
	if err != nil {
		return nil, err
	}
	defer func() {
		if cerr := stopPostgres(); cerr != nil && err == nil {
			err = cerr
		}
	}()
	stopNATS, inProcess, err := localNATS(&cfg, "bench", out)
	if err != nil {
		return nil, err
	}
	defer func() {
		if cerr := stopNATS(); cerr != nil && err == nil {
			err = cerr
		}
	}()
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	bcfg.DatabaseURL, bcfg.NATS, bcfg.NATSInProcess = cfg.DatabaseURL, cfg.NATS(), inProcess
	return bench.Run(ctx, bcfg)
}

func writePlot(rep *bench.Report, path string) error {
	f, err := os.Create(filepath.Clean(path))
	if err != nil {
		return fmt.Errorf("--plot: %w", err)
	}
	if err := rep.WritePlot(f); err != nil {
		_ = f.Close()
		return err
	}
	if err := f.Close(); err != nil {
		return fmt.Errorf("--plot: %w", err)
	}
	return nil
}

// runBenchPlainRelay runs the plain relay on BATON_SLOT until SIGTERM. Only `baton bench
// relay` starts it.
func runBenchPlainRelay(ctx context.Context, args []string, stderr io.Writer) error {
	fs := newFlagSet("bench "+benchPlainRelay, "Plain-relay runs the baseline relay of baton bench relay, which starts it.", stderr)
	cfg, log, err := configure(fs, args, stderr, config.EnvDatabaseURL, config.EnvNATSURL, config.EnvSlot, config.EnvSubjectPrefix)
	if err != nil {
		return err
	}
	if err := cfg.Require(config.EnvDatabaseURL, config.EnvNATSURL); err != nil {
		return err
	}
	return bench.RunPlainRelay(ctx, bench.PlainRelayConfig{DatabaseURL: cfg.DatabaseURL, NATS: cfg.NATS(),
		Slot: cfg.Slot, SubjectPrefix: cfg.SubjectPrefix, Replicas: cfg.Streams().Replicas, Logger: log})
}

func joinInts(xs []int) string {
	s := make([]string, len(xs))
	for i, x := range xs {
		s[i] = strconv.Itoa(x)
	}
	return strings.Join(s, ",")
}

func parseInts(s string) ([]int, error) {
	var xs []int
	for f := range strings.SplitSeq(s, ",") {
		x, err := strconv.Atoi(strings.TrimSpace(f))
		if err != nil {
			return nil, fmt.Errorf("%q is not a whole number", f)
		}
		xs = append(xs, x)
	}
	return xs, nil
}
