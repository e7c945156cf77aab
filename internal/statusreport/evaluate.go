package statusreport

import (
	"fmt"
	"time"
)

// Evaluate fills Attention, Warnings and OK from the report's contents. It is pure: the same
// report always gives the same verdict.
//
// Attention (exit 1): a section that could not be read; a missing, lost or about-to-be-lost
// slot, or one of another database or plugin; the oldest pending request older than
// StaleAfter; a lease expired for longer than StaleAfter (no worker recovers it); NATS
// unreachable; a missing stream or one without a leader; no schema.
//
// With shards (shard publications exist), each shard's slot is judged like the main slot,
// the main slot may be missing, a missing shard publication needs attention and a slot of a
// shard past the count is a warning.
//
// Warnings: no relay streaming (slot inactive: a relay between sessions or failing over is
// briefly inactive, so this alone does not page; pending work going stale does); WAL retained
// past max_wal_size; no workers' consumer yet; a stream replica offline or behind, or a
// clustered stream of one replica; a schema older or newer than this binary; a relay role
// that pg_hba.conf lets in over a physical replication connection (read only when the
// report's role may read pg_hba_file_rules), or relay roles that could not be read.
func (r *Report) Evaluate() {
	r.Attention, r.Warnings = []string{}, []string{}
	attn := func(format string, args ...any) { r.Attention = append(r.Attention, fmt.Sprintf(format, args...)) }
	warn := func(format string, args ...any) { r.Warnings = append(r.Warnings, fmt.Sprintf(format, args...)) }
	stale := time.Duration(r.StaleAfterSeconds * float64(time.Second))

	// Slot. With shards, the shard relays use slots of their own: the main slot may be gone.
	if s := r.Slot; r.Shards == nil || s.Exists || s.Error != "" {
		r.evaluateSlot(s, "`baton relay`", attn, warn)
	}
	r.evaluateShards(attn, warn)

	// Outbox.
	o := r.Outbox
	if o.Error != "" {
		attn("outbox: %s", o.Error)
	}
	if o.OldestPendingAgeSeconds != nil && secs(*o.OldestPendingAgeSeconds) > stale {
		attn("the oldest pending request is %s old (over --stale-after %s): %d pending; check that the relay and workers run", fmtSeconds(*o.OldestPendingAgeSeconds), stale, o.ByStatus.Pending)
	}
	if o.ExpiredLeaseAgeSeconds != nil && secs(*o.ExpiredLeaseAgeSeconds) > stale {
		attn("%d processing rows hold leases that expired up to %s ago: no worker is recovering them; start a worker", o.ExpiredLeases, fmtSeconds(*o.ExpiredLeaseAgeSeconds))
	}

	// Streams.
	st := r.Streams
	switch {
	case !st.Checked:
	case st.Error != "":
		attn("NATS: %s", st.Error)
	default:
		for _, s := range []*Stream{st.Turns, st.Outcomes} {
			switch {
			case s == nil:
			case s.Error != "":
				attn("stream: %s", s.Error)
			case !s.Exists:
				attn("stream %s does not exist: the relay creates it when it starts (check --subject-prefix)", s.Name)
			}
		}
		r.evaluateStreamClusters(attn, warn)
		if c := st.Consumer; c != nil && st.Turns != nil && st.Turns.Exists {
			switch {
			case c.Error != "":
				attn("consumer: %s", c.Error)
			case !c.Exists:
				warn("consumer %s does not exist on stream %s: no worker has started yet (or check --durable)", c.Name, c.Stream)
			}
		}
	}

	// Schema.
	sc := r.Schema
	switch {
	case sc.Error != "":
		attn("schema: %s", sc.Error)
	case sc.Version == 0:
		attn("no Baton schema in database %q: run `baton migrate`", r.Database)
	case sc.Version < sc.BinaryVersion:
		warn("schema at version %d, this binary expects %d: run `baton migrate`", sc.Version, sc.BinaryVersion)
	case sc.Version > sc.BinaryVersion:
		warn("schema at version %d is newer than this binary (%d): upgrade baton", sc.Version, sc.BinaryVersion)
	}

	// Replication access: a relay role that could copy the whole cluster. Advice, never a page.
	if a := r.ReplicationAccess; a.Error != "" {
		warn("replication access: %s", a.Error)
	}
	for _, role := range r.ReplicationAccess.Roles {
		if role.PhysicalRefused != nil && !*role.PhysicalRefused && role.HBALine != nil {
			warn("role %s may copy the whole cluster with pg_basebackup (every database, every role's password verifier): pg_hba.conf line %d lets its physical replication connections in; put `%s` before it, then SELECT pg_reload_conf()", role.Name, *role.HBALine, RejectLine(role.Name))
		}
	}

	r.OK = len(r.Attention) == 0
}

// evaluateSlot judges one relay slot, the main one or a shard's; start is the command that
// runs its relay.
func (r *Report) evaluateSlot(s Slot, start string, attn, warn func(string, ...any)) {
	switch {
	case s.Error != "":
		attn("slot: %s", s.Error)
	case !s.Exists:
		attn("replication slot %q does not exist: no relay has started on this database, or the slot was dropped; start %s (it creates the slot and backfills pending rows)", s.Name, start)
	case s.WALStatus == "lost":
		attn("replication slot %q is lost (wal_status lost): Postgres removed WAL the relay had not confirmed; run SELECT pg_drop_replication_slot('%s'); and restart the relay, which backfills every pending and processing row", s.Name, s.Name)
	default:
		if r.Database != "" && s.Database != "" && s.Database != r.Database {
			attn("replication slot %q belongs to database %q, not %q: use another --slot", s.Name, s.Database, r.Database)
		}
		if s.Plugin != "" && s.Plugin != "pgoutput" {
			attn("replication slot %q uses plugin %q, the relay needs pgoutput: use another --slot", s.Name, s.Plugin)
		}
		if s.WALStatus == "unreserved" {
			attn("replication slot %q is about to be lost (wal_status unreserved, %s retained): the relay must catch up before max_slot_wal_keep_size is exceeded", s.Name, fmtBytesPtr(s.RetainedWALBytes))
		}
		if s.WALStatus == "extended" {
			warn("replication slot %q retains more WAL than max_wal_size (%s)", s.Name, fmtBytesPtr(s.RetainedWALBytes))
		}
		if !s.Active {
			warn("no relay is streaming: slot %q is inactive and retains %s of WAL; start %s", s.Name, fmtBytesPtr(s.RetainedWALBytes), start)
		}
	}
}

// evaluateShards judges the shards: each shard's slot as the main slot is judged; a missing
// shard publication needs attention (its conversations reach no relay); a slot of a shard past
// the count (left by an earlier, larger count) is a warning, as it holds WAL.
func (r *Report) evaluateShards(attn, warn func(string, ...any)) {
	sh := r.Shards
	if sh == nil {
		return
	}
	if sh.Error != "" {
		attn("shards: %s", sh.Error)
	}
	for _, name := range sh.Missing {
		attn("shard publication %q does not exist (the highest shard makes %d shards): the conversations of that shard reach no relay; run `baton migrate --shards %d`", name, sh.Count, sh.Count)
	}
	for k, s := range sh.Slots {
		r.evaluateSlot(s, fmt.Sprintf("`baton relay --shard %d/%d`", k, sh.Count), attn, warn)
	}
	for _, s := range sh.Stray {
		warn("replication slot %q is not one of the %d shards' and retains %s of WAL: left from an earlier shard count? Drop it once no relay uses it: SELECT pg_drop_replication_slot('%s')", s.Name, sh.Count, fmtBytesPtr(s.RetainedWALBytes), s.Name)
	}
}

func secs(f float64) time.Duration { return time.Duration(f * float64(time.Second)) }
