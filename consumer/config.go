package consumer

import (
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go"
	"github.com/prometheus/client_golang/prometheus"
	"go.opentelemetry.io/otel/trace"

	"github.com/batonhq/baton/internal/config"
	"github.com/batonhq/baton/wire"
)

// Defaults of Config's fields. Each is also the worker default of Baton's own configuration
// (internal/config), from which it takes its value, so the two cannot drift.
const (
	// DefaultDurable is Config.Durable's default: "baton-workers".
	DefaultDurable = config.DefaultWorkerDurable
	// DefaultDebounce is Config.Debounce's default: 5ms.
	DefaultDebounce = config.DefaultWorkerDebounce
	// DefaultLease is Config.Lease's default: 30s.
	DefaultLease = config.DefaultWorkerLease
	// DefaultMaxAttempts is Config.MaxAttempts's default: 3.
	DefaultMaxAttempts = config.DefaultWorkerMaxAttempts
	// DefaultBackoffBase is Config.BackoffBase's default: 1s.
	DefaultBackoffBase = config.DefaultWorkerBackoffBase
	// DefaultBackoffMax is Config.BackoffMax's default: 1m.
	DefaultBackoffMax = config.DefaultWorkerBackoffMax
	// DefaultMaxConcurrentTurns is Config.MaxConcurrentTurns's default: 128.
	DefaultMaxConcurrentTurns = config.DefaultWorkerMaxConcurrentTurns
	// DefaultPollInterval is Config.PollInterval's default: 250ms.
	DefaultPollInterval = config.DefaultWorkerPollInterval
	// DefaultSweepInterval is Config.SweepInterval's default: 15s.
	DefaultSweepInterval = config.DefaultWorkerSweepInterval
	// DefaultRecoveryInterval is Config.RecoveryInterval's default: 5s.
	DefaultRecoveryInterval = config.DefaultWorkerRecoveryInterval
	// DefaultAckWait is Config.AckWait's default: 30s.
	DefaultAckWait = config.DefaultWorkerAckWait
	// DefaultMaxAckPending is Config.MaxAckPending's default: 20000.
	DefaultMaxAckPending = config.DefaultWorkerMaxAckPending
	// DefaultShutdownGrace is Config.ShutdownGrace's default: 10s.
	DefaultShutdownGrace = config.DefaultWorkerShutdownGrace
	// DefaultMaxTurnMessages is Config.MaxTurnMessages's default: 100.
	DefaultMaxTurnMessages = config.DefaultWorkerMaxTurnMessages
	// DefaultMaxTurnBytes is Config.MaxTurnBytes's default: 8 MiB.
	DefaultMaxTurnBytes = config.DefaultWorkerMaxTurnBytes
)

// Config configures a Worker. Zero values take the defaults named on each field.
type Config struct {
	// Pool is the Postgres pool the worker claims and commits with. Required.
	Pool *pgxpool.Pool
	// Handler runs each turn. Required.
	Handler Handler

	// NATS selects the JetStream source: a durable pull consumer on the turns stream, with a
	// slow sweep of Postgres for anything no event woke. Nil selects the polling source, which
	// claims straight from agent_outbox. Both run the same claim, turn and commit code.
	NATS *nats.Conn
	// SubjectPrefix is the relay's subject prefix. Default wire.DefaultSubjectPrefix ("agent").
	SubjectPrefix string
	// Stream is the turns stream. Default: the relay's default for the prefix ("AGENT_TURNS").
	Stream string
	// Durable names the shared durable consumer. Default DefaultDurable ("baton-workers").
	Durable string
	// Name identifies this worker in agent_runs. Default: host name and process id.
	Name string
	// Schema is the Postgres schema holding Baton's tables (BATON_SCHEMA; see
	// migrations.Options). The worker's statements name the tables without a schema: Pool's
	// search_path must find them there first (set "search_path" in the pool config's
	// ConnConfig.RuntimeParams), which Run checks. Default: "public".
	Schema string

	// Debounce is how long after the first message of an idle conversation was written a worker
	// claims, so a burst of messages becomes one turn. The time the event took to reach the
	// worker counts toward it; a worker never waits longer than Debounce. Default
	// DefaultDebounce (5ms).
	Debounce time.Duration
	// Lease is how long a claim holds its rows without renewal; it is renewed every Lease/3
	// while the turn runs. Default DefaultLease (30s).
	Lease time.Duration
	// MaxAttempts caps claims of a row; the last failure commits a visible error. Default
	// DefaultMaxAttempts (3).
	MaxAttempts int
	// BackoffBase and BackoffMax shape the wait before a failed row is claimable again:
	// BackoffBase doubled per attempt, at most BackoffMax. Defaults DefaultBackoffBase (1s) and
	// DefaultBackoffMax (1m).
	BackoffBase, BackoffMax time.Duration
	// MaxConcurrentTurns bounds the turns this worker runs at once. Turns mostly wait on a
	// model, and the claims and final commits of concurrent turns share statements, so more
	// of them in flight costs Postgres less per turn (measured with a zero-latency handler:
	// 32 -> 1,350 turns/s, 128 -> 2,000 on 2 cores). Default DefaultMaxConcurrentTurns (128).
	MaxConcurrentTurns int
	// PollInterval is how often the polling source looks for pending rows. Default
	// DefaultPollInterval (250ms).
	PollInterval time.Duration
	// SweepInterval is how often the JetStream source sweeps Postgres for pending rows that no
	// event woke (older than the interval). Default DefaultSweepInterval (15s).
	SweepInterval time.Duration
	// RecoveryInterval is how often expired leases are recovered. Default DefaultRecoveryInterval (5s).
	RecoveryInterval time.Duration
	// AckWait is the consumer's ack wait; held events get InProgress every AckWait/3.
	// Default DefaultAckWait (30s).
	AckWait time.Duration
	// MaxAckPending bounds the events held by all workers of the durable. Default
	// DefaultMaxAckPending (20000).
	MaxAckPending int
	// ShutdownGrace is how long running turns may finish after the worker is told to stop;
	// then their context is cancelled and their rows are released for another worker, the
	// attempt not counted, unless a Write tool ran or may have run: such a turn ends as a
	// visible failure. Default DefaultShutdownGrace (10s).
	ShutdownGrace time.Duration
	// MaxTurnMessages caps the messages one claim takes; the rest go to the next turn.
	// Default DefaultMaxTurnMessages (100).
	MaxTurnMessages int
	// MaxTurnBytes caps the content one claim takes, in bytes, beyond its first message; the
	// rest go to the next turn. A single message larger than this ends as a visible failure
	// (ErrMessageTooLarge) without a handler call. Default DefaultMaxTurnBytes (8 MiB).
	MaxTurnBytes int
	// FailureMessage returns the text of the error message a user sees when a request fails
	// for good. Its error wraps ErrSideEffect, ErrAttemptsExhausted, ErrWorkerLost or
	// ErrMessageTooLarge, and the handler's error where there was one; it must not put
	// internal detail in front of users. The detail, secrets masked, goes to the outbox row's
	// last_error, agent_runs.error and the logs. Default DefaultFailureMessage.
	FailureMessage func(error) string

	// Logger receives structured logs. Default: discard.
	Logger *slog.Logger
	// Registerer receives the worker's metrics. Default: none registered.
	Registerer prometheus.Registerer
	// TracerProvider makes the turns' spans (see TracerName). Default (nil): the global one,
	// otel.GetTracerProvider(), which records nothing until an application installs one.
	TracerProvider trace.TracerProvider
}

// ErrConfig wraps every configuration error.
var ErrConfig = errors.New("consumer config")

func (c *Config) fill() error {
	if c.Schema == "" {
		c.Schema = "public"
	}
	if c.Pool == nil {
		return fmt.Errorf("%w: Pool is required", ErrConfig)
	}
	if c.Handler == nil {
		return fmt.Errorf("%w: Handler is required", ErrConfig)
	}
	if c.SubjectPrefix == "" {
		c.SubjectPrefix = wire.DefaultSubjectPrefix
	}
	if err := wire.ValidatePrefix(c.SubjectPrefix); err != nil {
		return fmt.Errorf("%w: %w", ErrConfig, err)
	}
	if c.Stream == "" {
		c.Stream = wire.StreamName(c.SubjectPrefix, wire.KindTurns)
	}
	if c.Durable == "" {
		c.Durable = DefaultDurable
	}
	if c.Name == "" {
		host, _ := os.Hostname()
		c.Name = fmt.Sprintf("%s-%d", host, os.Getpid())
	}
	dur := func(d *time.Duration, v time.Duration) {
		if *d <= 0 {
			*d = v
		}
	}
	dur(&c.Debounce, DefaultDebounce)
	dur(&c.Lease, DefaultLease)
	dur(&c.BackoffBase, DefaultBackoffBase)
	dur(&c.BackoffMax, DefaultBackoffMax)
	dur(&c.PollInterval, DefaultPollInterval)
	dur(&c.SweepInterval, DefaultSweepInterval)
	dur(&c.RecoveryInterval, DefaultRecoveryInterval)
	dur(&c.AckWait, DefaultAckWait)
	dur(&c.ShutdownGrace, DefaultShutdownGrace)
	num := func(n *int, v int) {
		if *n <= 0 {
			*n = v
		}
	}
	num(&c.MaxAttempts, DefaultMaxAttempts)
	num(&c.MaxConcurrentTurns, DefaultMaxConcurrentTurns)
	num(&c.MaxTurnMessages, DefaultMaxTurnMessages)
	num(&c.MaxTurnBytes, DefaultMaxTurnBytes)
	num(&c.MaxAckPending, DefaultMaxAckPending)
	if c.FailureMessage == nil {
		c.FailureMessage = DefaultFailureMessage
	}
	if c.Logger == nil {
		c.Logger = slog.New(slog.NewTextHandler(io.Discard, nil))
	}
	return nil
}

func (c *Config) backoff(attempt int) time.Duration {
	d := c.BackoffBase
	for i := 1; i < attempt && d < c.BackoffMax; i++ {
		d *= 2
	}
	return min(d, c.BackoffMax)
}
