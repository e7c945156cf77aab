package relay

import (
	"errors"
	"fmt"
	"io"
	"log/slog"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/batonhq/baton/internal/pgname"
	"github.com/batonhq/baton/migrations"
	"github.com/batonhq/baton/wire"
)

// Config configures a Relay. Zero values take the defaults named on each field.
type Config struct {
	// DatabaseURL is the Postgres connection string (URL or key=value form). The relay opens a
	// replication connection and a regular one from it. Required.
	DatabaseURL string
	// NATS is the connection to publish on; the caller owns it. Connect it with
	// nats.MaxReconnects(-1) so a NATS restart is survived, and with a nats.FlusherTimeout of
	// seconds (baton relay uses 10s): a publish to a server that stops reading blocks for that
	// long holding the connection. The relay never waits on such a publish (status updates, the
	// ack timeout and Run's return go on without it), but until it gives up nothing else can
	// use the connection. Required.
	NATS *nats.Conn

	// SubjectPrefix is the first part of every subject. Default "agent".
	SubjectPrefix string
	// Slot is the logical replication slot: lowercase letters, digits and underscores, at most
	// 63 (the rule of BATON_SLOT). Default "baton".
	Slot string
	// Publication is the publication to stream: a lowercase identifier, at most 63 (the rule
	// of BATON_PUBLICATION). Default "baton".
	Publication string
	// Schema holds the Baton tables. Default "public".
	Schema string
	// Shards, when set, makes this relay one of Shards sharded relays (baton relay --shard
	// Shard/Shards): it streams publication <Publication>_<Shard> from slot <Slot>_<Shard>,
	// both named by migrations.ShardName, and its first-start backfill publishes only the rows
	// of its shard's conversations (migrations.ShardPredicate). The publication must exist
	// with that shard's row filter (baton migrate --shards N, migrations.EnsureShards): the
	// relay checks it at every session's start and returns ErrSetup otherwise. 1…256 (the
	// shard names must stay within 63 bytes); Shard is 0…Shards−1. Default 0: not sharded,
	// Shard ignored.
	Shards int
	// Shard is this relay's shard, 0…Shards−1 (see Shards). Default 0.
	Shard int

	// TurnsStream and OutcomesStream name the JetStream streams. Defaults: the prefix in upper
	// case with dots as underscores, plus "_TURNS" / "_OUTCOMES" ("AGENT_TURNS").
	TurnsStream    string
	OutcomesStream string
	// DeadLetterStream names the stream of changes the relay set aside because no retry could
	// publish them (subjects <prefix>.deadletter.<kind>, see wire.DeadLetter). Default: the prefix in
	// upper case with dots as underscores, plus "_DEADLETTER" ("AGENT_DEADLETTER").
	DeadLetterStream string
	// DeadLetterMaxAge drops dead-letter records older than this. Default 30 days
	// (DefaultDeadLetterMaxAge): long enough to notice and inspect them.
	DeadLetterMaxAge time.Duration
	// Streams configures the streams the relay creates or verifies.
	Streams StreamSettings

	// MaxInFlight bounds the events published and not yet acknowledged plus those queued behind
	// an earlier event of the same conversation. Default 8192.
	MaxInFlight int
	// MaxChangeBytes bounds the replication messages the relay receives whole. pgoutput sends
	// every inserted value and every logical message in full, and any role may emit a logical
	// message of up to 1 GB: a larger message is cut as it arrives (its first 65 KiB kept),
	// and its change, when it is the relay's, set aside in the dead-letter stream. At least
	// 65 KiB. Default 64 MiB.
	MaxChangeBytes int
	// MaxInFlightBytes bounds the bytes of those same events (bodies, plus a small allowance
	// for headers): with MaxInFlight it bounds the relay's memory when NATS is slow or away,
	// since an outcome may be as large as the server's max payload. An event larger than the
	// bound is published alone. Default 64 MiB.
	MaxInFlightBytes int
	// AckTimeout is how long a publish may wait for its PubAck before the session restarts from
	// the confirmed LSN. Default 10s.
	AckTimeout time.Duration
	// StatusInterval is how often the confirmed LSN is reported to Postgres. Default 1s.
	StatusInterval time.Duration
	// MinSilence is the least time a status update may go unanswered before the relay looks
	// at its walsender from its other connection: busy decoding (a neighbour's large
	// transaction) it waits on, anything else ends the session. The bound is max(3 ×
	// StatusInterval, MinSilence). Default 10s.
	MinSilence time.Duration
	// StandbyPoll is how often a standby relay checks whether the slot became free. Default 1s.
	StandbyPoll time.Duration
	// StaleLockAfter is no longer used: a standby takes over once the slot is free, which
	// Postgres ensures within wal_sender_timeout of the active relay going silent (see
	// standby.go). Earlier versions took an advisory lock, any role could hold it, and a
	// standby broke a holder idle this long. Kept so that configurations that set it still
	// build.
	//
	// Deprecated: takeover follows the slot.
	StaleLockAfter time.Duration
	// SetupTimeout bounds each connection attempt to Postgres and each setup step of a session
	// (checks, the lock query, reading the slot, START_REPLICATION, and on first start the
	// statements that record the slot or drop a stale one), so that a path that drops packets
	// fails the session instead of hanging it. Default 10s.
	SetupTimeout time.Duration
	// FirstStartTimeout bounds the first start's slower steps: CREATE_REPLICATION_SLOT, which
	// Postgres finishes only once every transaction running at that moment has ended (so this
	// is the longest transaction the first start waits out), and each page of the backfill,
	// which may scan a large outbox for its unfinished rows. Past it the session fails and the
	// next one starts over. Default 5m.
	FirstStartTimeout time.Duration
	// MinBackoff and MaxBackoff bound the jittered, exponential wait between reconnects.
	// Defaults 100ms and 10s.
	MinBackoff, MaxBackoff time.Duration
	// ClassicPublish publishes event by event, each after the PubAck of the previous event of
	// its conversation, even when the streams take fast-ingest batches (nats-server 2.14 or
	// later; see batch.go), which the relay otherwise uses while it is behind. Default false.
	ClassicPublish bool
	// alwaysBatches publishes in batches even while the relay keeps up (tests).
	alwaysBatches bool
	// DrainTimeout bounds how long a stopping relay waits for PubAcks of what it published
	// before it confirms and returns. Default 10s.
	DrainTimeout time.Duration
	// RecreateSlot allows the relay to drop a slot with its name that Baton did not create (no
	// row in baton_relay_slots: made by an operator or another tool) and to create its own in
	// its place, with the first-start backfill. Default false: such a slot is refused with
	// ErrSetup and left as it is. Baton's own slots are never dropped for this setting.
	RecreateSlot bool
	// BackfillBatch is how many rows each query of the first-start backfill reads: the backfill
	// reads the slot's snapshot in pages in id order, and publishes a page while it reads the
	// next. It bounds the rows held in memory at once. Default 1000.
	BackfillBatch int

	// Logger receives structured logs. Default: discard.
	Logger *slog.Logger
	// Registerer receives the relay's metrics. Default: none registered (metrics are still kept).
	Registerer prometheus.Registerer
}

// StreamSettings are the JetStream settings the relay applies to the streams it creates and
// checks on streams that exist (see ensureStreams). The streams differ in retention:
//
//   - Turns (TurnsStream): work-queue retention, discard new, no age limit. A turn event stays
//     until the workers' consumer acknowledges it, which they do only once its outbox row is
//     terminal, and then JetStream deletes it: space frees as work finishes. When the stream is
//     full (MaxMsgs or MaxBytes) JetStream refuses new events instead of dropping unfinished
//     ones; the relay then holds its LSN, raises baton_relay_stream_full and retries until
//     there is room. A work-queue stream takes one consumer per subject: other readers follow
//     the outcomes stream instead.
//   - Outcomes (OutcomesStream): limits retention, discard old: the oldest outcomes go first
//     once MaxAge, MaxBytes or MaxMsgs is reached, so the relay never waits on subscribers.
//   - Dead letter (DeadLetterStream): limits retention, discard old, DeadLetterMaxAge, MaxBytes.
type StreamSettings struct {
	// Duplicates is the Nats-Msg-Id deduplication window of every stream. Default 2m
	// (DefaultStreamDuplicates). It also applies to turn events the workers acknowledged,
	// which a work-queue stream deletes: a replay within the window is still dropped.
	Duplicates time.Duration
	// MaxAge drops outcomes older than this from the outcomes stream. It never applies to the
	// turns stream: an age limit there would drop unfinished work. Default 7 days
	// (DefaultOutcomesMaxAge); negative: no age limit.
	MaxAge time.Duration
	// MaxBytes caps the size of each stream: the turns stream refuses new events past it, the
	// outcomes and dead-letter streams drop their oldest. Default 1 GiB
	// (DefaultStreamMaxBytes); negative: no cap.
	MaxBytes int64
	// MaxMsgs caps the messages of the turns and outcomes streams, like MaxBytes. Default
	// 1,000,000 (DefaultStreamMaxMsgs); negative: no cap.
	MaxMsgs int64
	// Replicas is the stream replica count (1, or 3 or 5 on a JetStream cluster). Default 1.
	Replicas int
}

// Defaults of StreamSettings.
const (
	DefaultStreamDuplicates = 2 * time.Minute
	DefaultOutcomesMaxAge   = 7 * 24 * time.Hour
	DefaultStreamMaxBytes   = 1 << 30
	DefaultStreamMaxMsgs    = 1_000_000
)

// fill sets the defaults of the zero fields and turns "negative: none" into JetStream's -1 (0
// for MaxAge).
func (s *StreamSettings) fill() error {
	if s.Duplicates < 0 {
		return fmt.Errorf("%w: stream duplicate window %s is negative", ErrConfig, s.Duplicates)
	}
	if s.Duplicates == 0 {
		s.Duplicates = DefaultStreamDuplicates
	}
	switch {
	case s.MaxAge == 0:
		s.MaxAge = DefaultOutcomesMaxAge
	case s.MaxAge < 0:
		s.MaxAge = 0 // JetStream's "no age limit"
	}
	if s.MaxAge > 0 && s.Duplicates > s.MaxAge {
		return fmt.Errorf("%w: stream duplicate window %s is longer than the outcomes' max age %s", ErrConfig, s.Duplicates, s.MaxAge)
	}
	for _, v := range []struct {
		n   *int64
		def int64
	}{{&s.MaxBytes, DefaultStreamMaxBytes}, {&s.MaxMsgs, DefaultStreamMaxMsgs}} {
		switch {
		case *v.n == 0:
			*v.n = v.def
		case *v.n < 0:
			*v.n = -1
		}
	}
	if s.Replicas == 0 {
		s.Replicas = 1
	}
	if s.Replicas < 0 || s.Replicas > 5 {
		return fmt.Errorf("%w: stream replicas %d: want 1 to 5", ErrConfig, s.Replicas)
	}
	return nil
}

// DefaultDeadLetterMaxAge is the default of Config.DeadLetterMaxAge.
const DefaultDeadLetterMaxAge = 30 * 24 * time.Hour

// DefaultMaxChangeBytes is the default of Config.MaxChangeBytes.
const DefaultMaxChangeBytes = 64 << 20

// DefaultMaxInFlightBytes is the default of Config.MaxInFlightBytes.
const DefaultMaxInFlightBytes = 64 << 20

// ErrConfig wraps every configuration error.
var ErrConfig = errors.New("relay config")

func (c *Config) fill() error {
	if c.DatabaseURL == "" {
		return fmt.Errorf("%w: DatabaseURL is required", ErrConfig)
	}
	if c.NATS == nil {
		return fmt.Errorf("%w: NATS connection is required", ErrConfig)
	}
	def := func(s *string, v string) {
		if *s == "" {
			*s = v
		}
	}
	def(&c.SubjectPrefix, wire.DefaultSubjectPrefix)
	def(&c.Slot, "baton")
	def(&c.Publication, "baton")
	def(&c.Schema, "public")
	if err := wire.ValidatePrefix(c.SubjectPrefix); err != nil {
		return fmt.Errorf("%w: subject prefix: %w", ErrConfig, err)
	}
	if c.Shards != 0 {
		if err := migrations.CheckShard(c.Shard, c.Shards); err != nil {
			return fmt.Errorf("%w: %w", ErrConfig, err)
		}
		c.Slot, c.Publication = migrations.ShardName(c.Slot, c.Shard), migrations.ShardName(c.Publication, c.Shard)
	}
	if err := pgname.Slot(c.Slot); err != nil {
		return fmt.Errorf("%w: slot %w", ErrConfig, err)
	}
	if err := pgname.Publication(c.Publication); err != nil {
		return fmt.Errorf("%w: publication %w", ErrConfig, err)
	}
	def(&c.TurnsStream, wire.StreamName(c.SubjectPrefix, wire.KindTurns))
	def(&c.OutcomesStream, wire.StreamName(c.SubjectPrefix, wire.KindOutcomes))
	def(&c.DeadLetterStream, wire.StreamName(c.SubjectPrefix, wire.KindDeadLetter))
	if c.DeadLetterMaxAge <= 0 {
		c.DeadLetterMaxAge = DefaultDeadLetterMaxAge
	}
	if err := c.Streams.fill(); err != nil {
		return err
	}
	defDur := func(d *time.Duration, v time.Duration) {
		if *d <= 0 {
			*d = v
		}
	}
	defDur(&c.AckTimeout, 10*time.Second)
	defDur(&c.StatusInterval, time.Second)
	defDur(&c.MinSilence, 10*time.Second)
	defDur(&c.StandbyPoll, time.Second)
	defDur(&c.StaleLockAfter, 10*time.Second)
	defDur(&c.SetupTimeout, 10*time.Second)
	defDur(&c.FirstStartTimeout, 5*time.Minute)
	defDur(&c.MinBackoff, 100*time.Millisecond)
	defDur(&c.MaxBackoff, 10*time.Second)
	defDur(&c.DrainTimeout, 10*time.Second)
	if c.MaxInFlight <= 0 {
		c.MaxInFlight = 8192
	}
	if c.MaxChangeBytes == 0 {
		c.MaxChangeBytes = DefaultMaxChangeBytes
	}
	if c.MaxChangeBytes < cutKeep {
		return fmt.Errorf("%w: MaxChangeBytes %d is below the minimum of %d", ErrConfig, c.MaxChangeBytes, cutKeep)
	}
	if c.MaxInFlightBytes <= 0 {
		c.MaxInFlightBytes = DefaultMaxInFlightBytes
	}
	if c.BackfillBatch <= 0 {
		c.BackfillBatch = 1000
	}
	if c.Logger == nil {
		c.Logger = slog.New(slog.NewTextHandler(io.Discard, nil))
	}
	return nil
}
