// Package statusreport builds what `baton status` shows: the relay's replication slot, the
// outbox, the JetStream streams and the workers' consumer, the schema version, and whether
// pg_hba.conf keeps the relay's role from copying the whole cluster, plus the list of things
// that need an operator's attention.
//
// Reading (Gather, GatherStreams) is kept apart from judging (Report.Evaluate) and printing
// (WriteText, WriteJSON), which are pure functions of a Report. Ages are computed by the
// database's clock, so a skewed client clock cannot make work look stale or fresh.
//
// The JSON form is a contract: its field names are the json tags below and do not change.
// Fields are added, never renamed or removed. Sizes are bytes, ages are seconds (float),
// times are RFC 3339, and a value that does not apply (no pending row, an inactive slot's pid)
// is null.
package statusreport

import (
	"time"

	"github.com/batonhq/baton/wire"
)

// Defaults of Options.
const (
	DefaultSlot          = "baton"
	DefaultPublication   = "baton"
	DefaultSubjectPrefix = wire.DefaultSubjectPrefix
	DefaultDurable       = "baton-workers"
	DefaultStaleAfter    = 5 * time.Minute
	DefaultRelayRole     = "baton_relay"
)

// Options says what to look at. Zero values take the defaults above.
type Options struct {
	// Slot is the relay's replication slot. Default "baton".
	Slot string
	// SubjectPrefix names the streams: wire.StreamName(prefix, "turns"|"outcomes").
	// Default "agent".
	SubjectPrefix string
	// Durable is the workers' durable consumer on the turns stream. Default "baton-workers".
	Durable string
	// StaleAfter is the age past which the oldest pending request, or an expired lease no
	// worker recovered, needs attention. Default 5m.
	StaleAfter time.Duration
	// Schema holds Baton's tables. The connection's search_path must find them there (as
	// `baton status` sets it); the schema version is read from it. Default "public".
	Schema string
	// Publication is the relay's publication (BATON_PUBLICATION): publications
	// <Publication>_<K> are the shards of `baton migrate --shards N`, whose relays stream from
	// slots <Slot>_<K>. Default "baton".
	Publication string
	// RelayRole is the relay's login role (deploy/postgres/roles.sql): its physical
	// replication access is checked, with that of the role of every walsender streaming from
	// the report's slots. Default "baton_relay".
	RelayRole string
}

func (o *Options) fill() {
	def := func(s *string, v string) {
		if *s == "" {
			*s = v
		}
	}
	def(&o.Slot, DefaultSlot)
	def(&o.SubjectPrefix, DefaultSubjectPrefix)
	def(&o.Durable, DefaultDurable)
	def(&o.Schema, "public")
	def(&o.Publication, DefaultPublication)
	def(&o.RelayRole, DefaultRelayRole)
	if o.StaleAfter <= 0 {
		o.StaleAfter = DefaultStaleAfter
	}
}

// Report is everything `baton status` shows. See the package doc for the JSON conventions.
type Report struct {
	// GeneratedAt is when the report was read (client clock).
	GeneratedAt time.Time `json:"generated_at"`
	// Database is the database the report read (current_database()).
	Database string `json:"database"`
	// StaleAfterSeconds is the threshold Evaluate judged ages against.
	StaleAfterSeconds float64 `json:"stale_after_seconds"`
	// OK is true when Attention is empty. Set by Evaluate.
	OK bool `json:"ok"`
	// Attention lists what needs an operator now; `baton status` exits 1 when it is not empty.
	Attention []string `json:"attention"`
	// Warnings lists what is unusual but not (yet) a problem.
	Warnings []string `json:"warnings"`

	Slot    Slot    `json:"slot"`
	Outbox  Outbox  `json:"outbox"`
	Streams Streams `json:"streams"`
	Schema  Schema  `json:"schema"`
	// Shards is the sharded relays' side; null when the database has no shard publications.
	Shards *Shards `json:"shards"`
	// ReplicationAccess is whether the relay's roles could copy the whole cluster.
	ReplicationAccess ReplicationAccess `json:"replication_access"`
}

// ReplicationAccess is the physical replication access of the relay's roles. A role with
// REPLICATION that pg_hba.conf lets in over a physical replication connection (its
// `replication` lines) can copy the whole cluster with pg_basebackup: every database and every
// role's password verifier. The relay needs only logical replication connections, which match
// pg_hba.conf's database lines, so a line `host replication <role> all reject` before the
// others takes that away and leaves the relay working.
type ReplicationAccess struct {
	// Roles are the login roles with REPLICATION, superusers aside (they may read everything
	// anyway), that are the relay's: Options.RelayRole and the role of each walsender streaming
	// from the report's slots. Empty when there is none.
	Roles []ReplicationRole `json:"roles"`
	// HBAChecked is true when pg_hba.conf's rules were read (pg_hba_file_rules: superusers
	// only, by default) and had no error; HBANote says why they were not otherwise. The rules
	// are those of the file on disk, which the server loads when reloaded.
	HBAChecked bool   `json:"hba_checked"`
	HBANote    string `json:"hba_note,omitempty"`
	// Error is set when the roles could not be read.
	Error string `json:"error,omitempty"`
}

// ReplicationRole is one of the relay's roles and what pg_hba.conf says to its physical
// replication connections over TCP.
type ReplicationRole struct {
	Name string `json:"name"`
	// PhysicalRefused is true when pg_hba.conf refuses them from every address (a `host
	// replication` reject line for the role, or for all, before any line that lets it in; or no
	// line for it), false when a line lets some in; null when the rules were not checked.
	PhysicalRefused *bool `json:"physical_refused"`
	// HBALine is the line number that decides: the reject line or the first line that lets
	// the role in; null when no line does or the rules were not checked.
	HBALine *int `json:"hba_line"`
}

// Shards are the shard publications of `baton migrate --shards N` and the slots of their
// relays (`baton relay --shard K/N`).
type Shards struct {
	// Publication is the base name; the shards are <publication>_0 … <publication>_<count−1>.
	Publication string `json:"publication"`
	// Count is N: one more than the highest shard publication's K.
	Count int `json:"count"`
	// Missing lists shard publications below Count that do not exist.
	Missing []string `json:"missing"`
	// Slots holds slot <slot>_K of each shard K < Count, in order.
	Slots []Slot `json:"slots"`
	// Stray holds slots <slot>_K with K ≥ Count: left by relays of an earlier, larger shard
	// count; they hold WAL until dropped.
	Stray []Slot `json:"stray"`
	// Error is set when the shards could not be read.
	Error string `json:"error,omitempty"`
}

// Slot is the relay's logical replication slot (pg_replication_slots).
type Slot struct {
	Name string `json:"name"`
	// Exists is false when no slot has that name: no relay ever started here, or it was dropped.
	Exists bool `json:"exists"`
	// Database and Plugin are the slot's; a relay needs this database and pgoutput.
	Database string `json:"database,omitempty"`
	Plugin   string `json:"plugin,omitempty"`
	// Active is true while a relay streams from the slot; ActivePID is its walsender's pid.
	Active    bool `json:"active"`
	ActivePID *int `json:"active_pid"`
	// WALStatus is reserved, extended, unreserved or lost.
	WALStatus string `json:"wal_status,omitempty"`
	// RestartLSN, ConfirmedLSN (confirmed_flush_lsn) and CurrentLSN (pg_current_wal_lsn()).
	RestartLSN   string `json:"restart_lsn,omitempty"`
	ConfirmedLSN string `json:"confirmed_lsn,omitempty"`
	CurrentLSN   string `json:"current_lsn,omitempty"`
	// RetainedWALBytes is current − restart_lsn: the WAL the slot keeps on disk.
	RetainedWALBytes *int64 `json:"retained_wal_bytes"`
	// LagBytes is current − confirmed_flush_lsn: WAL the relay has not confirmed.
	LagBytes *int64 `json:"lag_bytes"`
	// SafeWALSizeBytes is how much more WAL may be written before the slot is lost; null when
	// max_slot_wal_keep_size is unlimited.
	SafeWALSizeBytes *int64 `json:"safe_wal_size_bytes"`
	// Error is set when the slot could not be read.
	Error string `json:"error,omitempty"`
}

// Outbox is agent_outbox by status, with the ages that show stuck work.
type Outbox struct {
	ByStatus StatusCounts `json:"by_status"`
	// OldestPendingAt and OldestPendingAgeSeconds describe the oldest pending row (created_at).
	OldestPendingAt         *time.Time `json:"oldest_pending_at"`
	OldestPendingAgeSeconds *float64   `json:"oldest_pending_age_seconds"`
	// OldestProcessingAt and OldestProcessingAgeSeconds describe the longest-held claim: when
	// the run holding the oldest processing row started (agent_runs.started_at).
	OldestProcessingAt         *time.Time `json:"oldest_processing_at"`
	OldestProcessingAgeSeconds *float64   `json:"oldest_processing_age_seconds"`
	// ExpiredLeases counts processing rows whose lease ran out; workers recover them within
	// seconds. ExpiredLeaseAgeSeconds is how long ago the oldest one expired.
	ExpiredLeases          int64    `json:"expired_leases"`
	ExpiredLeaseAgeSeconds *float64 `json:"expired_lease_age_seconds"`
	// Error is set when the outbox could not be read.
	Error string `json:"error,omitempty"`
}

// StatusCounts counts agent_outbox rows by status.
type StatusCounts struct {
	Pending    int64 `json:"pending"`
	Processing int64 `json:"processing"`
	Done       int64 `json:"done"`
	Error      int64 `json:"error"`
}

// Streams is the JetStream side: the relay's two streams and the workers' consumer.
type Streams struct {
	// Checked is false when no NATS URL was given; Note says so.
	Checked bool   `json:"checked"`
	Note    string `json:"note,omitempty"`
	// URL is the NATS URL, password redacted.
	URL string `json:"url,omitempty"`
	// Error is set when NATS could not be reached.
	Error    string    `json:"error,omitempty"`
	Turns    *Stream   `json:"turns"`
	Outcomes *Stream   `json:"outcomes"`
	Consumer *Consumer `json:"consumer"`
}

// Stream is one JetStream stream's state.
type Stream struct {
	Name   string `json:"name"`
	Exists bool   `json:"exists"`
	// Messages and Bytes are what the stream holds now.
	Messages uint64     `json:"messages"`
	Bytes    uint64     `json:"bytes"`
	FirstSeq uint64     `json:"first_seq"`
	LastSeq  uint64     `json:"last_seq"`
	LastTime *time.Time `json:"last_time"`
	// Consumers counts the stream's consumers.
	Consumers int `json:"consumers"`
	// Cluster is the stream's replica count, leader and other replicas; null when the stream
	// does not exist or could not be read.
	Cluster *StreamCluster `json:"cluster"`
	Error   string         `json:"error,omitempty"`
}

// Consumer is the workers' durable consumer on the turns stream.
type Consumer struct {
	Name   string `json:"name"`
	Stream string `json:"stream"`
	Exists bool   `json:"exists"`
	// NumPending is events not yet delivered to any worker.
	NumPending uint64 `json:"num_pending"`
	// NumAckPending is events delivered and not acked: turns running or waiting for their rows
	// to become terminal.
	NumAckPending int `json:"num_ack_pending"`
	// NumRedelivered is unacked events delivered more than once.
	NumRedelivered int `json:"num_redelivered"`
	// NumWaiting is open pull requests: workers connected and asking for events.
	NumWaiting int    `json:"num_waiting"`
	Error      string `json:"error,omitempty"`
}

// Schema is the database's migration version against this binary's.
type Schema struct {
	// Version is the highest applied migration; 0 when none is.
	Version int `json:"version"`
	// BinaryVersion is the newest migration this binary embeds.
	BinaryVersion int    `json:"binary_version"`
	Error         string `json:"error,omitempty"`
}
