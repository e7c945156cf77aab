package bench

import (
	"errors"
	"fmt"
	"io"
	"log/slog"
	"slices"
	"strings"
	"time"

	"github.com/batonhq/baton/natsconn"
)

// Defaults of Config.
const (
	// DefaultRows is the backlog size of each catch-up, and the backfill's.
	DefaultRows = 200_000
	// DefaultRounds is how many interleaved rounds a run makes.
	DefaultRounds = 1
	// DefaultLatencyDuration is how long each latency run is measured, after its warm-up.
	DefaultLatencyDuration = 5 * time.Second
)

// DefaultRates are the commit rates of the latency runs, in transactions per second.
var DefaultRates = []int{1000, 5000}

// Parts of a run, for Config.Parts.
const (
	// PartCatchUp is the catch-up of the two backlogs over 1,000 conversations (1-row and
	// 100-row transactions) by every contender: decode ceilings, publish ceiling, plain relay,
	// Baton's relay.
	PartCatchUp = "catchup"
	// PartHot is the catch-up of the hot backlogs (every row in 1, or in 10, conversations) by
	// the plain relay and Baton's relay.
	PartHot = "hot"
	// PartLatency is commit → stored at steady rates, Baton's relay and the plain relay.
	PartLatency = "latency"
	// PartBackfill is a relay's first start on a backlog of pending rows, with no slot yet.
	PartBackfill = "backfill"
)

// AllParts are the parts of a run, in the order it runs them.
var AllParts = []string{PartCatchUp, PartHot, PartBackfill, PartLatency}

// warmup is the start of each latency run that is not counted.
const warmup = time.Second

// producers is how many connections commit in the latency runs.
const producers = 8

// Upper bounds of the sizes a run accepts. A run sets up what a size asks for (records of
// every paced commit, conversations, a backlog) before it measures, after it created its
// database: a size it cannot hold would end it out of memory, with no cleanup.
const (
	maxRate       = 100_000     // commits (or turns) per second of a latency run
	maxPaced      = 10_000_000  // commits of one latency run: rate × duration
	maxLatencyRun = time.Hour   // one latency run's measured duration
	maxRows       = 100_000_000 // rows of a backlog
	maxTurnsTurns = 10_000_000  // messages of a throughput phase
)

// checkPaced reports a rate named twice (its figures would overwrite each other), or a latency
// duration, or a rate × duration, beyond what a run accepts; nil when there is none.
func checkPaced(rates []int, d time.Duration) error {
	for i, r := range rates {
		if slices.Contains(rates[:i], r) {
			return fmt.Errorf("rate %d/s named twice", r)
		}
	}
	if d > maxLatencyRun {
		return fmt.Errorf("latency duration must be at most %v, not %v", maxLatencyRun, d)
	}
	for _, r := range rates {
		if r > 0 && r <= maxRate && d.Seconds()*float64(r) > maxPaced {
			return fmt.Errorf("rate %d/s for %v is more than %d commits in one latency run", r, d, maxPaced)
		}
	}
	return nil
}

// Bounds of waits.
const (
	startTimeout = 2 * time.Minute  // a relay process starting to stream
	stopGrace    = 15 * time.Second // a relay process draining after SIGTERM
)

// Config is one `baton bench relay` run.
type Config struct {
	// DatabaseURL is a PostgreSQL server (wal_level=logical) on which the run creates a
	// database of its own, dropped at the end, as a role that may create databases and
	// replicate. Required.
	DatabaseURL string
	// NATS is a NATS server with JetStream (its URL, login and TLS settings); the run's
	// streams are named BENCH_<run id>_…
	// and deleted at the end. Required.
	NATS natsconn.Settings
	// NATSInProcess says the NATS server runs in this process, so that this process's CPU
	// time during a relay's catch-up is the server's (plus the bench's polling). Default
	// false: NATS CPU is not reported.
	NATSInProcess bool
	// RelayCommand runs `baton relay` (os.Executable() followed by "relay" for the command),
	// configured through BATON_* variables. Required.
	RelayCommand []string
	// PlainRelayCommand runs RunPlainRelay as a process of its own (`baton bench
	// plain-relay`), configured through the same variables. Required.
	PlainRelayCommand []string
	// Rows is the size of each backlog, a multiple of 200. Default DefaultRows.
	Rows int
	// Rounds is how many interleaved rounds measure each figure. Default DefaultRounds.
	Rounds int
	// Rates are the commit rates of the latency runs, per second. Default DefaultRates.
	Rates []int
	// LatencyDuration is how long each latency run is measured after its 1 s warm-up.
	// Default DefaultLatencyDuration.
	LatencyDuration time.Duration
	// Parts are the parts to run (Part*). Default (empty): AllParts.
	Parts []string
	// ProfileDir, when set, is where a CPU profile of Baton's relay during an extra catch-up
	// of the 1-row, 1,000-conversation backlog is written (relay-catchup.pprof). Needs
	// PartCatchUp. Default: no profile.
	ProfileDir string
	// Progress receives progress lines; with ProgressTTY, one line updated in place.
	// Default: none.
	Progress    io.Writer
	ProgressTTY bool
	// Shards, when 2 or more, adds a contender to the 1,000-conversation catch-ups: that many
	// `baton relay --shard K/N` processes at once on the same backlog (the bench database gets
	// the shard publications), reported as their aggregate rate next to one relay's and as the
	// ratio of the two. Needs PartCatchUp. Default 0: none.
	Shards int
	// StreamReplicas is the replica count of the streams of the relays it runs (baton relay's
	// and the plain relay's): 3 measures them on a JetStream cluster (BATON_NATS_URL), where
	// the relay publishes in fenced atomic batches. The ceilings stay on one replica. Default
	// 1.
	StreamReplicas int
	// Logger receives warnings about cleaning up. Default: discard.
	Logger *slog.Logger
}

// withDefaults returns cfg with its defaults filled in, or an error naming what is wrong.
func (cfg Config) withDefaults() (Config, error) {
	if cfg.Rows == 0 {
		cfg.Rows = DefaultRows
	}
	if cfg.Rounds == 0 {
		cfg.Rounds = DefaultRounds
	}
	if len(cfg.Rates) == 0 {
		cfg.Rates = DefaultRates
	}
	if cfg.LatencyDuration == 0 {
		cfg.LatencyDuration = DefaultLatencyDuration
	}
	if len(cfg.Parts) == 0 {
		cfg.Parts = AllParts
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.New(slog.DiscardHandler)
	}
	if cfg.Progress == nil {
		cfg.Progress = io.Discard
	}
	var errs []error
	if cfg.DatabaseURL == "" || cfg.NATS.URL == "" {
		errs = append(errs, errors.New("a database URL and a NATS URL are required"))
	}
	if len(cfg.RelayCommand) == 0 || len(cfg.PlainRelayCommand) == 0 {
		errs = append(errs, errors.New("the relay and plain relay commands are required"))
	}
	return cfg, errors.Join(append(errs, cfg.check()...)...)
}

// Validate reports what is wrong with cfg's sizes, rates and parts (defaults filled in), so
// that a command can refuse them before it starts servers; Run checks them again with the
// rest.
func (cfg Config) Validate() error {
	cfg, _ = cfg.withDefaults()
	return errors.Join(cfg.check()...)
}

// check returns what is wrong with cfg's sizes, rates and parts.
func (cfg Config) check() []error {
	var errs []error
	if cfg.Rows < 200 || cfg.Rows%200 != 0 || cfg.Rows > maxRows {
		errs = append(errs, fmt.Errorf("rows must be a positive multiple of 200 (2 writers × 100-row transactions) up to %d, not %d", maxRows, cfg.Rows))
	}
	if cfg.Rounds < 1 {
		errs = append(errs, fmt.Errorf("rounds must be at least 1, not %d", cfg.Rounds))
	}
	for _, r := range cfg.Rates {
		if r < 1 || r > maxRate {
			errs = append(errs, fmt.Errorf("rate %d/s is out of 1…%d", r, maxRate))
		}
	}
	if cfg.LatencyDuration <= 0 {
		errs = append(errs, fmt.Errorf("latency duration must be positive, not %v", cfg.LatencyDuration))
	}
	errs = append(errs, checkPaced(cfg.Rates, cfg.LatencyDuration))
	for _, p := range cfg.Parts {
		if !slices.Contains(AllParts, p) {
			errs = append(errs, fmt.Errorf("unknown part %q (parts: %s)", p, strings.Join(AllParts, ", ")))
		}
	}
	if cfg.ProfileDir != "" && !cfg.has(PartCatchUp) {
		errs = append(errs, fmt.Errorf("a profile is taken during the %s part, which is not selected", PartCatchUp))
	}
	return append(errs, cfg.checkShards()...)
}

// has reports whether part is selected.
func (cfg *Config) has(part string) bool { return slices.Contains(cfg.Parts, part) }

// slotsNeeded returns how many replication slots the run holds at once at most: one per
// contender that reads a slot and round on a backlog (they all exist before it is written),
// plus the profiled relay's.
func (cfg *Config) slotsNeeded() int {
	n := 0
	if cfg.has(PartCatchUp) {
		n = cfg.Rounds * len(catchUpReaders)
		if cfg.Shards > 1 {
			n += cfg.Rounds * cfg.Shards
		}
		if cfg.ProfileDir != "" {
			n++
		}
	}
	if cfg.has(PartHot) {
		n = max(n, cfg.Rounds*len(hotReaders))
	}
	if cfg.has(PartBackfill) || cfg.has(PartLatency) {
		n = max(n, 1)
	}
	return n
}
