// Package bench holds the logic of `baton bench`: it starts what a benchmark needs, drives load
// through Baton and measures it. cmd/baton only parses flags and wires the pieces that live in
// public packages (the workers), so that, as everywhere under internal/, nothing here imports
// relay or consumer.
package bench

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"slices"
	"strings"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/batonhq/baton/internal/config"
	"github.com/batonhq/baton/natsconn"
)

// Defaults of TurnsConfig's fields.
const (
	// DefaultTurnsTurns is TurnsConfig.Turns's default: messages per throughput phase.
	DefaultTurnsTurns = 10000
	// DefaultTurnsLatencyDuration is TurnsConfig.LatencyDuration's default.
	DefaultTurnsLatencyDuration = 10 * time.Second
	// DefaultTurnsRounds is TurnsConfig.Rounds's default.
	DefaultTurnsRounds = 1
)

// DefaultTurnsRates is TurnsConfig.Rates's default: turns per second of the latency phases.
var DefaultTurnsRates = []int{200, 1000}

// DefaultTurnsWorkers is TurnsConfig.Workers's default: worker counts of the throughput phases.
var DefaultTurnsWorkers = []int{1, 4}

// Sources of turns a worker can be fed from.
const (
	// TurnsSourceJetStream is the relay's path: producers → relay (its own process) → JetStream →
	// workers.
	TurnsSourceJetStream = "jetstream"
	// TurnsSourcePolling is the polling source: workers claim from agent_outbox, no relay.
	TurnsSourcePolling = "polling"
)

// TurnsSources lists the sources, in the order the bench runs them.
var TurnsSources = []string{TurnsSourceJetStream, TurnsSourcePolling}

// Kinds of phase, as --only names them.
const (
	// TurnsKindThroughput sends TurnsConfig.Turns messages, each to a conversation of its own, as
	// fast as 8 producers can, to workers with a handler that replies at once.
	TurnsKindThroughput = "throughput"
	// TurnsKindTools is TurnsKindThroughput with a handler that calls one read and one write tool per
	// turn, with the first worker count.
	TurnsKindTools = "tools"
	// TurnsKindLatency sends at each fixed rate for TurnsConfig.LatencyDuration to one worker (the
	// first worker count) and measures producer commit → reply commit.
	TurnsKindLatency = "latency"
)

// TurnsKinds lists the kinds of phase.
var TurnsKinds = []string{TurnsKindThroughput, TurnsKindTools, TurnsKindLatency}

// Fixed sizes of the bench. They are printed with the results.
const (
	// turnsProducers is how many producers send at once, each on a connection of its own.
	turnsProducers = 8
	// turnsWorkerConns is each worker's pool size.
	turnsWorkerConns = 16
	// turnsWarmupBatch is how many messages each warm-up batch sends.
	turnsWarmupBatch = 100
	// turnsWarmupLimit bounds the warm-up: every worker should have answered a turn by then.
	turnsWarmupLimit = 30 * time.Second
	// turnsStallLimit fails a phase whose unfinished rows stopped decreasing for this long.
	turnsStallLimit = time.Minute
	// turnsMinLatencyConversations is the fewest conversations a latency phase spreads its
	// messages over; at higher rates each conversation gets a message every 250ms on average
	// (rate/4 conversations), so that messages rarely wait for their conversation's previous
	// turn and the figure is the pipeline's, not a conversation's queue.
	turnsMinLatencyConversations = 50
)

// TurnsWorkerSpec is what the bench asks of one worker. TurnsConfig.NewWorker builds a
// consumer.Worker from it; the bench owns Pool and NATS and closes them after Run returned.
type TurnsWorkerSpec struct {
	// Name identifies the worker in agent_runs.
	Name string
	// Pool is the worker's own pool on the phase's database, search_path set to Baton's schema.
	Pool *pgxpool.Pool
	// NATS is the worker's own connection; nil selects the polling source.
	NATS *nats.Conn
	// SubjectPrefix is the phase's subject prefix (each phase has streams of its own).
	SubjectPrefix string
	// Tools selects the handler: false replies at once with the echo of the turn's messages
	// and calls no tool; true calls one read and one write tool through the turn's tool API
	// first (examples/echo's Agent with WriteTool).
	Tools bool
	// Debounce, PollInterval and MaxConcurrentTurns are the worker's settings of the same
	// names: the library's defaults, which the bench reports next to its figures.
	Debounce, PollInterval time.Duration
	MaxConcurrentTurns     int
	// Registerer receives the worker's metrics, which the bench reads.
	Registerer prometheus.Registerer
	// Logger is the worker's logger.
	Logger *slog.Logger
}

// TurnsWorker is a worker as the bench runs it: *consumer.Worker.
type TurnsWorker interface {
	// Run runs the worker until ctx ends.
	Run(ctx context.Context) error
}

// TurnsWorkerFunc builds a worker.
type TurnsWorkerFunc func(spec TurnsWorkerSpec) (TurnsWorker, error)

// TurnsConfig configures the turns benchmark. Zero values take the defaults named on each field.
type TurnsConfig struct {
	// DatabaseURL names a PostgreSQL server (wal_level=logical) as a role that may create
	// databases and replicate. The bench creates a database of its own for every phase
	// there and drops it afterwards, with its replication slot; it never writes to the
	// database the URL names. Default: empty, a throwaway cluster started by the bench.
	DatabaseURL string
	// NATS names a NATS server with JetStream (its URL, login and TLS settings). Every phase
	// uses streams of its own (a subject prefix of its own), deleted afterwards. Default: no
	// URL, an embedded server started in this process.
	NATS natsconn.Settings
	// RelayCommand runs `baton relay`: the program and its arguments. The bench gives it its
	// configuration in BATON_* environment variables (the caller's BATON_* are not passed on)
	// and stops it with SIGTERM. Required.
	RelayCommand []string
	// NewWorker builds the workers, which run in this process. Required.
	NewWorker TurnsWorkerFunc

	// Turns is how many messages each throughput phase sends. Default DefaultTurnsTurns.
	Turns int
	// Rates are the turns per second of the latency phases. Default DefaultTurnsRates.
	Rates []int
	// Workers are the worker counts of the throughput phases; the first is also the count of
	// the tools and latency phases, and the base of the scaling ratios. Default
	// DefaultTurnsWorkers.
	Workers []int
	// LatencyDuration is how long each latency phase sends. Default DefaultTurnsLatencyDuration.
	LatencyDuration time.Duration
	// Sources are the sources to run, of TurnsSources. Default: both.
	Sources []string
	// Only are the kinds of phase to run, of TurnsKinds. Default: all.
	Only []string
	// Rounds is how many times every phase runs; the report gives medians and the raw values.
	// Default DefaultTurnsRounds.
	Rounds int
	// ProfileDir, when set, receives worker.pprof: a CPU profile of this process (workers,
	// producers and, when embedded, the NATS server) during the first round's first
	// throughput or tools phase (zero-tool throughput unless Only leaves it out). Default:
	// empty, no profile.
	ProfileDir string

	// Progress receives a line per phase. Default: discard.
	Progress io.Writer
	// Logger receives the bench's and the workers' logs. Default: discard.
	Logger *slog.Logger
	// LogLevel and LogFormat are given to the relay process (BATON_LOG_LEVEL,
	// BATON_LOG_FORMAT). Default: "warn" and "text".
	LogLevel, LogFormat string
}

// Turns is the turns benchmark.
type Turns struct {
	cfg    TurnsConfig
	phases []turnsPhase
}

// NewTurns fills cfg's defaults and validates it.
func NewTurns(cfg TurnsConfig) (*Turns, error) {
	if len(cfg.RelayCommand) == 0 {
		return nil, errors.New("bench turns: RelayCommand is required")
	}
	if cfg.NewWorker == nil {
		return nil, errors.New("bench turns: NewWorker is required")
	}
	if cfg.Turns == 0 {
		cfg.Turns = DefaultTurnsTurns
	}
	if cfg.Rates == nil {
		cfg.Rates = DefaultTurnsRates
	}
	if cfg.Workers == nil {
		cfg.Workers = DefaultTurnsWorkers
	}
	if cfg.LatencyDuration == 0 {
		cfg.LatencyDuration = DefaultTurnsLatencyDuration
	}
	if cfg.Sources == nil {
		cfg.Sources = TurnsSources
	}
	if cfg.Only == nil {
		cfg.Only = TurnsKinds
	}
	if cfg.Rounds == 0 {
		cfg.Rounds = DefaultTurnsRounds
	}
	if cfg.Progress == nil {
		cfg.Progress = io.Discard
	}
	cfg.Progress = &turnsSyncWriter{w: cfg.Progress} // the relay's logs go there too
	if cfg.Logger == nil {
		cfg.Logger = slog.New(slog.DiscardHandler)
	}
	if cfg.LogLevel == "" {
		cfg.LogLevel = "warn"
	}
	if cfg.LogFormat == "" {
		cfg.LogFormat = config.LogFormatText
	}
	var errs []error
	if cfg.Turns < 1 || cfg.Turns > maxTurnsTurns {
		errs = append(errs, fmt.Errorf("turns must be 1…%d, not %d", maxTurnsTurns, cfg.Turns))
	}
	if len(cfg.Rates) == 0 || slices.ContainsFunc(cfg.Rates, func(r int) bool { return r < 1 || r > maxRate }) {
		errs = append(errs, fmt.Errorf("rates must be one or more rates of 1…%d per second, not %v", maxRate, cfg.Rates))
	}
	errs = append(errs, checkPaced(cfg.Rates, cfg.LatencyDuration))
	if len(cfg.Workers) == 0 || slices.ContainsFunc(cfg.Workers, func(w int) bool { return w < 1 }) {
		errs = append(errs, fmt.Errorf("workers must be one or more counts of at least 1, not %v", cfg.Workers))
	}
	if cfg.LatencyDuration < 0 {
		errs = append(errs, fmt.Errorf("latency duration must be positive, not %v", cfg.LatencyDuration))
	}
	if cfg.Rounds < 1 {
		errs = append(errs, fmt.Errorf("rounds must be at least 1, not %d", cfg.Rounds))
	}
	errs = append(errs, turnsCheckNames("source", cfg.Sources, TurnsSources), turnsCheckNames("phase kind", cfg.Only, TurnsKinds))
	if err := errors.Join(errs...); err != nil {
		return nil, fmt.Errorf("bench turns: %w", err)
	}
	b := &Turns{cfg: cfg}
	b.phases = b.plan()
	return b, nil
}

// turnsCheckNames reports names that are not in allowed, or repeated, or none at all.
func turnsCheckNames(what string, names, allowed []string) error {
	if len(names) == 0 {
		return fmt.Errorf("no %s chosen (of %s)", what, strings.Join(allowed, ", "))
	}
	for i, n := range names {
		if !slices.Contains(allowed, n) {
			return fmt.Errorf("unknown %s %q (of %s)", what, n, strings.Join(allowed, ", "))
		}
		if slices.Contains(names[:i], n) {
			return fmt.Errorf("%s %q named twice", what, n)
		}
	}
	return nil
}

// turnsPhase is one measurement, run on a database, streams and workers of its own.
type turnsPhase struct {
	kind    string // TurnsKindThroughput, TurnsKindTools or TurnsKindLatency
	source  string
	workers int
	rate    int // TurnsKindLatency only
}

func (p turnsPhase) String() string {
	switch p.kind {
	case TurnsKindLatency:
		return fmt.Sprintf("latency %s %d/s", p.source, p.rate)
	default:
		return fmt.Sprintf("%s %s %d %s", p.kind, p.source, p.workers, turnsPlural(p.workers, "worker"))
	}
}

func turnsPlural(n int, word string) string {
	if n == 1 {
		return word
	}
	return word + "s"
}

// plan lists the phases of one round: per source, the throughput phases with the tools phase
// right after the throughput phase it is compared to (so little drifts between them), then
// the latency phases.
func (b *Turns) plan() []turnsPhase {
	var out []turnsPhase
	for _, src := range b.cfg.Sources {
		for i, w := range b.cfg.Workers {
			if b.runs(TurnsKindThroughput) {
				out = append(out, turnsPhase{kind: TurnsKindThroughput, source: src, workers: w})
			}
			if i == 0 && b.runs(TurnsKindTools) {
				out = append(out, turnsPhase{kind: TurnsKindTools, source: src, workers: w})
			}
		}
	}
	if b.runs(TurnsKindLatency) {
		for _, src := range b.cfg.Sources {
			for _, r := range b.cfg.Rates {
				out = append(out, turnsPhase{kind: TurnsKindLatency, source: src, workers: b.cfg.Workers[0], rate: r})
			}
		}
	}
	return out
}

func (b *Turns) runs(kind string) bool { return slices.Contains(b.cfg.Only, kind) }

// Run runs every phase Rounds times and returns the report. It starts the servers the
// configuration does not name and removes everything it created before it returns, also when
// ctx ends (Ctrl-C), which stops the bench with ctx's error.
func (b *Turns) Run(ctx context.Context) (rep *TurnsReport, err error) {
	start := time.Now()
	env, err := startTurnsEnv(ctx, &b.cfg)
	if err != nil {
		return nil, err
	}
	defer func() {
		if cerr := env.close(); cerr != nil && err == nil {
			err = cerr
		}
	}()
	results := make([][]turnsResult, b.cfg.Rounds)
	profiled := false
	for round := range b.cfg.Rounds {
		for i, ph := range b.phases {
			b.progressf("round %d/%d, phase %d/%d: %s\n", round+1, b.cfg.Rounds, i+1, len(b.phases), ph)
			profile := ""
			if b.cfg.ProfileDir != "" && !profiled && ph.kind != TurnsKindLatency {
				profile, profiled = b.cfg.ProfileDir, true
			}
			res, err := b.runPhase(ctx, env, ph, profile)
			if err != nil {
				return nil, fmt.Errorf("round %d, %s: %w", round+1, ph, err)
			}
			b.progressf("  %s\n", res.summary(ph))
			results[round] = append(results[round], res)
		}
	}
	return b.report(env, results, time.Since(start)), nil
}

func (b *Turns) progressf(format string, args ...any) {
	_, _ = fmt.Fprintf(b.cfg.Progress, format, args...) // progress only: nothing to do when it fails
}
