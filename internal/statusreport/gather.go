package statusreport

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/batonhq/baton/migrations"
	"github.com/batonhq/baton/wire"
)

// DB is what Gather reads Postgres with; *pgx.Conn and *pgxpool.Pool satisfy it.
type DB interface {
	migrations.Beginner
	QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
}

// Gather reads the database sections of a report: slot, outbox and schema. A section that
// cannot be read carries its error instead of failing the whole report. Streams are left
// unchecked: fill them with GatherStreams or StreamsSkipped / StreamsUnreachable.
func Gather(ctx context.Context, db DB, opts Options) *Report {
	opts.fill()
	r := &Report{
		GeneratedAt:       time.Now().UTC(),
		StaleAfterSeconds: opts.StaleAfter.Seconds(),
		Attention:         []string{},
		Warnings:          []string{},
		Slot:              Slot{Name: opts.Slot},
		Schema:            Schema{BinaryVersion: migrations.Latest()},
	}
	// When this fails, so does every section below, and each says why.
	_ = db.QueryRow(ctx, `SELECT current_database()`).Scan(&r.Database)
	readSchema(ctx, db, opts.Schema, &r.Schema)
	readSlot(ctx, db, &r.Slot)
	readOutbox(ctx, db, &r.Outbox)
	r.Shards = readShards(ctx, db, opts)
	readReplicationAccess(ctx, db, opts.RelayRole, r.streamingPIDs(), &r.ReplicationAccess)
	return r
}

// streamingPIDs are the walsenders streaming from the report's slots.
func (r *Report) streamingPIDs() []int {
	var pids []int
	slots := []Slot{r.Slot}
	if r.Shards != nil {
		slots = append(append(slots, r.Shards.Slots...), r.Shards.Stray...)
	}
	for _, s := range slots {
		if s.ActivePID != nil {
			pids = append(pids, *s.ActivePID)
		}
	}
	return pids
}

func readSchema(ctx context.Context, db DB, schema string, s *Schema) {
	versions, err := migrations.AppliedIn(ctx, db, schema)
	if err != nil {
		s.Error = err.Error()
		return
	}
	if len(versions) > 0 {
		s.Version = versions[len(versions)-1]
	}
}

// slotSQL reads one slot with the server's WAL position. pg_wal_lsn_diff gives numeric.
const slotSQL = `SELECT coalesce(s.database, ''), coalesce(s.plugin, ''), s.active, s.active_pid,
		coalesce(s.wal_status, ''), coalesce(s.restart_lsn::text, ''), coalesce(s.confirmed_flush_lsn::text, ''),
		w.lsn::text,
		pg_wal_lsn_diff(w.lsn, s.restart_lsn)::bigint,
		pg_wal_lsn_diff(w.lsn, s.confirmed_flush_lsn)::bigint,
		s.safe_wal_size
	FROM pg_replication_slots s, (SELECT pg_current_wal_lsn() AS lsn) w
	WHERE s.slot_name = $1`

func readSlot(ctx context.Context, db DB, s *Slot) {
	var pid *int32
	err := db.QueryRow(ctx, slotSQL, s.Name).Scan(&s.Database, &s.Plugin, &s.Active, &pid, &s.WALStatus,
		&s.RestartLSN, &s.ConfirmedLSN, &s.CurrentLSN, &s.RetainedWALBytes, &s.LagBytes, &s.SafeWALSizeBytes)
	switch {
	case errors.Is(err, pgx.ErrNoRows):
		return
	case err != nil:
		s.Error = fmt.Sprintf("read slot %s: %v", s.Name, err)
		return
	}
	s.Exists = true
	if pid != nil {
		p := int(*pid)
		s.ActivePID = &p
	}
}

// shardPubsSQL lists the shard numbers K of the publications <publication>_<K>.
var shardPubsSQL = `SELECT substr(p.pubname, length($1) + 2)::int FROM pg_publication p
	WHERE ` + migrations.ShardOfSQL("p.pubname") + `
		AND EXISTS (SELECT FROM pg_publication_tables t
			WHERE t.pubname = p.pubname AND t.schemaname = $2 AND t.tablename = 'agent_outbox')`

// shardSlotsSQL lists the shard numbers K of this database's slots <slot>_<K> (slot names are
// the cluster's: another database's are not this one's strays).
var shardSlotsSQL = `SELECT substr(slot_name, length($1) + 2)::int FROM pg_replication_slots
	WHERE database = current_database() AND ` + migrations.ShardOfSQL("slot_name")

// readShards reads the shard publications and each shard's slot, or returns nil when there
// is no shard publication.
func readShards(ctx context.Context, db DB, opts Options) *Shards {
	pubs, err := collectInts(ctx, db, shardPubsSQL, opts.Publication, opts.Schema)
	if err != nil {
		return &Shards{Publication: opts.Publication, Error: fmt.Sprintf("read shard publications: %v", err)}
	}
	if len(pubs) == 0 {
		return nil
	}
	sh := &Shards{Publication: opts.Publication, Missing: []string{}, Slots: []Slot{}, Stray: []Slot{}}
	have := map[int]bool{}
	for _, k := range pubs {
		have[k] = true
		sh.Count = max(sh.Count, k+1)
	}
	for k := range sh.Count {
		if !have[k] {
			sh.Missing = append(sh.Missing, migrations.ShardName(opts.Publication, k))
		}
		s := Slot{Name: migrations.ShardName(opts.Slot, k)}
		readSlot(ctx, db, &s)
		sh.Slots = append(sh.Slots, s)
	}
	slots, err := collectInts(ctx, db, shardSlotsSQL, opts.Slot)
	if err != nil {
		sh.Error = fmt.Sprintf("read shard slots: %v", err)
		return sh
	}
	slices.Sort(slots)
	for _, k := range slots {
		if k >= sh.Count {
			s := Slot{Name: migrations.ShardName(opts.Slot, k)}
			readSlot(ctx, db, &s)
			sh.Stray = append(sh.Stray, s)
		}
	}
	return sh
}

// collectInts runs a query of one integer column.
func collectInts(ctx context.Context, db DB, sql string, args ...any) ([]int, error) {
	tx, err := db.Begin(ctx)
	if err != nil {
		return nil, err
	}
	defer func() { _ = tx.Rollback(ctx) }()
	rows, err := tx.Query(ctx, sql, args...)
	if err != nil {
		return nil, err
	}
	return pgx.CollectRows(rows, pgx.RowTo[int])
}

// outboxSQL counts rows by status in one scan, with the ages of the oldest pending row and of
// the oldest expired lease, by the database's clock.
const outboxSQL = `SELECT
		count(*) FILTER (WHERE status = 'pending'),
		count(*) FILTER (WHERE status = 'processing'),
		count(*) FILTER (WHERE status = 'done'),
		count(*) FILTER (WHERE status = 'error'),
		min(created_at) FILTER (WHERE status = 'pending'),
		extract(epoch FROM now() - min(created_at) FILTER (WHERE status = 'pending'))::float8,
		count(*) FILTER (WHERE status = 'processing' AND lease_expires_at < now()),
		extract(epoch FROM now() - min(lease_expires_at) FILTER (WHERE status = 'processing' AND lease_expires_at < now()))::float8
	FROM agent_outbox`

// claimSQL finds when the run holding the oldest processing row started.
const claimSQL = `SELECT min(r.started_at), extract(epoch FROM now() - min(r.started_at))::float8
	FROM agent_outbox o JOIN agent_runs r ON r.run_id = o.run_id
	WHERE o.status = 'processing'`

func readOutbox(ctx context.Context, db DB, o *Outbox) {
	c := &o.ByStatus
	if err := db.QueryRow(ctx, outboxSQL).Scan(&c.Pending, &c.Processing, &c.Done, &c.Error,
		&o.OldestPendingAt, &o.OldestPendingAgeSeconds, &o.ExpiredLeases, &o.ExpiredLeaseAgeSeconds); err != nil {
		o.Error = fmt.Sprintf("read agent_outbox: %v", err)
		return
	}
	if c.Processing == 0 {
		return
	}
	if err := db.QueryRow(ctx, claimSQL).Scan(&o.OldestProcessingAt, &o.OldestProcessingAgeSeconds); err != nil {
		o.Error = fmt.Sprintf("read agent_runs: %v", err)
	}
}

// relayRolesSQL lists the relay's login roles with REPLICATION ($1, and the users of the
// walsenders $2), superusers aside, each with the roles it is a member of. pg_roles and
// pg_stat_activity's usename are readable by every role.
const relayRolesSQL = `SELECT r.rolname, ARRAY(SELECT g.rolname FROM pg_roles g
		WHERE g.oid <> r.oid AND pg_has_role(r.oid, g.oid, 'MEMBER') ORDER BY 1)
	FROM pg_roles r
	WHERE r.rolreplication AND r.rolcanlogin AND NOT r.rolsuper
		AND (r.rolname = $1 OR r.rolname IN (SELECT usename FROM pg_stat_activity WHERE pid = ANY ($2::int[])))
	ORDER BY 1`

// hbaReadableSQL says whether this role may read pg_hba_file_rules (superusers, unless
// granted).
const hbaReadableSQL = `SELECT has_function_privilege('pg_catalog.pg_hba_file_rules()', 'EXECUTE')
	AND has_table_privilege('pg_catalog.pg_hba_file_rules', 'SELECT')`

// hbaRulesSQL reads pg_hba.conf's rules in the order they apply: by rule_number where the
// server has it (PostgreSQL 16, whose included files number their lines each from 1), by
// line number otherwise.
const hbaRulesSQL = `SELECT h.line_number, coalesce(h.type, ''), coalesce(h.database, '{}'), coalesce(h.user_name, '{}'),
		coalesce(h.address, ''), coalesce(h.auth_method, ''), coalesce(h.error, '')
	FROM pg_hba_file_rules h
	ORDER BY coalesce((to_jsonb(h) ->> 'rule_number')::int, h.line_number), h.line_number`

// readReplicationAccess finds the relay's roles with REPLICATION and, when this role may read
// pg_hba.conf's rules, whether they refuse those roles' physical replication connections.
func readReplicationAccess(ctx context.Context, db DB, relayRole string, pids []int, a *ReplicationAccess) {
	a.Roles = []ReplicationRole{}
	tx, err := db.Begin(ctx)
	if err != nil {
		a.Error = fmt.Sprintf("read replication roles: %v", err)
		return
	}
	defer func() { _ = tx.Rollback(ctx) }()
	if pids == nil {
		pids = []int{}
	}
	rows, err := tx.Query(ctx, relayRolesSQL, relayRole, pids)
	if err != nil {
		a.Error = fmt.Sprintf("read replication roles: %v", err)
		return
	}
	type role struct {
		name     string
		memberOf []string
	}
	roles, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (role, error) {
		var x role
		err := r.Scan(&x.name, &x.memberOf)
		return x, err
	})
	if err != nil {
		a.Error = fmt.Sprintf("read replication roles: %v", err)
		return
	}
	if len(roles) == 0 {
		return
	}
	for _, x := range roles {
		a.Roles = append(a.Roles, ReplicationRole{Name: x.name})
	}
	var readable bool
	if err := tx.QueryRow(ctx, hbaReadableSQL).Scan(&readable); err != nil {
		a.HBANote = fmt.Sprintf("could not tell whether pg_hba_file_rules is readable: %v", err)
		return
	}
	if !readable {
		a.HBANote = "only superusers may read pg_hba_file_rules"
		return
	}
	rows, err = tx.Query(ctx, hbaRulesSQL)
	if err != nil {
		a.HBANote = fmt.Sprintf("read pg_hba_file_rules: %v", err)
		return
	}
	rules, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (hbaRule, error) {
		var h hbaRule
		err := r.Scan(&h.Line, &h.Type, &h.Database, &h.User, &h.Address, &h.Method, &h.Error)
		return h, err
	})
	if err != nil {
		a.HBANote = fmt.Sprintf("read pg_hba_file_rules: %v", err)
		return
	}
	for _, h := range rules {
		if h.Error != "" {
			a.HBANote = fmt.Sprintf("pg_hba.conf line %d has an error (%s): the server keeps the rules it loaded before, which cannot be read", h.Line, h.Error)
			return
		}
	}
	a.HBAChecked = true
	for i, x := range roles {
		refused, line := physicalAccess(rules, x.name, x.memberOf)
		a.Roles[i].PhysicalRefused = &refused
		if line > 0 {
			a.Roles[i].HBALine = &line
		}
	}
}

// StreamsSkipped is the streams section when NATS is not configured; note says so.
func StreamsSkipped(note string) Streams {
	return Streams{Note: note}
}

// StreamsUnreachable is the streams section when NATS could not be reached at url (redacted).
func StreamsUnreachable(url string, err error) Streams {
	return Streams{Checked: true, URL: url, Error: err.Error()}
}

// GatherStreams reads the turns and outcomes streams and the workers' durable consumer. url
// (redacted) is only shown.
func GatherStreams(ctx context.Context, js jetstream.JetStream, url string, opts Options) Streams {
	opts.fill()
	s := Streams{Checked: true, URL: url}
	s.Turns = readStream(ctx, js, opts.SubjectPrefix, wire.KindTurns)
	s.Outcomes = readStream(ctx, js, opts.SubjectPrefix, wire.KindOutcomes)
	s.Consumer = readConsumer(ctx, js, s.Turns.Name, opts.Durable)
	return s
}

// StreamReadTimeout bounds each JetStream API request of GatherStreams. On a cluster, a
// request that reached a server as it went away, or a stream's leader during an election, is
// never answered: it fails after this instead of taking the whole report's time.
const StreamReadTimeout = 5 * time.Second

// readStream reads the state of the stream of kind under prefix. Its message count is of
// events: the relay's fence messages (wire.FenceSubject) are left out.
func readStream(ctx context.Context, js jetstream.JetStream, prefix, kind string) *Stream {
	ctx, cancel := context.WithTimeout(ctx, StreamReadTimeout)
	defer cancel()
	name := wire.StreamName(prefix, kind)
	st := &Stream{Name: name}
	stream, err := js.Stream(ctx, name)
	switch {
	case errors.Is(err, jetstream.ErrStreamNotFound):
		return st
	case err != nil:
		st.Error = fmt.Sprintf("read stream %s: %v", name, err)
		return st
	}
	st.Exists = true
	state := stream.CachedInfo().State
	st.Messages, st.Bytes = state.Msgs, state.Bytes
	if n, err := wire.StreamEvents(ctx, stream, prefix, kind); err == nil {
		st.Messages = n
	}
	st.FirstSeq, st.LastSeq, st.Consumers = state.FirstSeq, state.LastSeq, state.Consumers
	st.Cluster = streamCluster(stream.CachedInfo())
	if !state.LastTime.IsZero() && state.Msgs > 0 {
		t := state.LastTime.UTC()
		st.LastTime = &t
	}
	return st
}

func readConsumer(ctx context.Context, js jetstream.JetStream, stream, durable string) *Consumer {
	ctx, cancel := context.WithTimeout(ctx, StreamReadTimeout)
	defer cancel()
	c := &Consumer{Name: durable, Stream: stream}
	cons, err := js.Consumer(ctx, stream, durable)
	switch {
	case errors.Is(err, jetstream.ErrConsumerNotFound), errors.Is(err, jetstream.ErrStreamNotFound):
		return c
	case err != nil:
		c.Error = fmt.Sprintf("read consumer %s: %v", durable, err)
		return c
	}
	info := cons.CachedInfo()
	c.Exists = true
	c.NumPending, c.NumAckPending = info.NumPending, info.NumAckPending
	c.NumRedelivered, c.NumWaiting = info.NumRedelivered, info.NumWaiting
	return c
}
