package relay

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/batonhq/baton/internal/config"
	"github.com/batonhq/baton/migrations"
	"github.com/batonhq/baton/wire"
)

// ErrSetup wraps misconfiguration that retrying cannot fix: a database URL that does not parse,
// a connection the server refuses (credentials, pg_hba.conf, a database that does not exist:
// see connectError), wal_level, the publication, the role's privileges, a slot of that name
// that Baton did not create (see Config.RecreateSlot), or a stream with incompatible settings.
// Run returns it.
var ErrSetup = errors.New("relay setup")

// ErrSlotLost is returned by Run when the slot was invalidated (wal_status "lost", typically
// after max_slot_wal_keep_size was exceeded): WAL the relay had not confirmed is gone. Recover
// by dropping the slot (SELECT pg_drop_replication_slot('baton')) and starting the relay: it
// recreates the slot and backfills every pending and processing outbox row.
var ErrSlotLost = errors.New("replication slot lost")

// parseError wraps a database URL the driver cannot parse. The driver masks the password in its
// message on a best-effort basis (it shows the part of a password after an '@'), so the message
// is masked again, and the driver's error, which holds the URL, is not wrapped.
func parseError(err error) error {
	return fmt.Errorf("%w: parse database url: %s", ErrSetup, config.RedactText(err.Error()))
}

// connectRefusals are the SQLSTATEs with which the server refuses a connection for a reason
// no retry changes, each with what to do about it.
var connectRefusals = map[string]string{
	"28P01": "check the user and password in the database URL",                                  // invalid_password
	"28000": "check the user name, that the role exists and may log in, and pg_hba.conf",        // invalid_authorization_specification
	"3D000": "create the database and run `baton migrate`, or fix the database name in the URL", // invalid_catalog_name
	"42501": "grant the role CONNECT on the database (GRANT CONNECT ON DATABASE ... TO ...)",    // insufficient_privilege
	"42704": "remove the parameter the server does not know from the database URL",              // undefined_object
}

// connectError wraps a failed connection attempt. A refusal no retry changes (connectRefusals:
// a wrong password, no pg_hba.conf entry, a role or database that does not exist, no CONNECT
// privilege) is ErrSetup, which Run returns instead of reconnecting forever. Anything else (a
// refused or dropped connection, a timeout, a server starting up or shutting down, too many
// connections) may pass and is retried. The errors of the driver and the server name the user
// and the database, never the password.
func connectError(err error) error {
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) {
		if hint, ok := connectRefusals[pgErr.Code]; ok {
			return fmt.Errorf("%w: connect to postgres: %w; %s", ErrSetup, err, hint)
		}
	}
	if untrustedServer(err) {
		return fmt.Errorf("%w: connect to postgres: %w; check sslrootcert (the CA that signed the server's certificate) and the host name in the database URL", ErrSetup, err)
	}
	return fmt.Errorf("connect to postgres: %w", err)
}

// untrustedServer reports whether err says the server's certificate failed verification
// (sslmode=verify-ca or verify-full): signed by another CA, for another host name, expired.
// A person has to change the URL or the server's certificate; retrying only repeats it.
// crypto/tls wraps verification errors in CertificateVerificationError; pgx's verify-ca check
// returns x509's errors as they are.
func untrustedServer(err error) bool {
	var verify *tls.CertificateVerificationError
	var authority x509.UnknownAuthorityError
	var host x509.HostnameError
	var invalid x509.CertificateInvalidError
	return errors.As(err, &verify) || errors.As(err, &authority) || errors.As(err, &host) || errors.As(err, &invalid)
}

// checkDatabase verifies what logical replication of the outbox needs.
func checkDatabase(ctx context.Context, conn *pgx.Conn, cfg *Config) error {
	var walLevel string
	var canReplicate bool
	err := conn.QueryRow(ctx, `SELECT current_setting('wal_level'),
		(SELECT rolreplication OR rolsuper FROM pg_roles WHERE rolname = current_user)`).Scan(&walLevel, &canReplicate)
	if err != nil {
		return fmt.Errorf("check database: %w", err)
	}
	if walLevel != "logical" {
		return fmt.Errorf("%w: wal_level is %q; set wal_level = logical in postgresql.conf and restart Postgres", ErrSetup, walLevel)
	}
	if !canReplicate {
		return fmt.Errorf("%w: role may not replicate; ALTER ROLE ... WITH REPLICATION", ErrSetup)
	}
	var insert bool
	err = conn.QueryRow(ctx, `SELECT pubinsert FROM pg_publication WHERE pubname = $1`, cfg.Publication).Scan(&insert)
	if errors.Is(err, pgx.ErrNoRows) {
		if cfg.Shards != 0 {
			return fmt.Errorf("%w: publication %q does not exist; run `baton migrate --shards %d`", ErrSetup, cfg.Publication, cfg.Shards)
		}
		return fmt.Errorf("%w: publication %q does not exist; run `baton migrate`", ErrSetup, cfg.Publication)
	}
	if err != nil {
		return fmt.Errorf("check publication: %w", err)
	}
	if !insert {
		return fmt.Errorf("%w: publication %q does not publish inserts", ErrSetup, cfg.Publication)
	}
	rows, err := conn.Query(ctx, `SELECT tablename::text FROM pg_publication_tables
		WHERE pubname = $1 AND schemaname = $2`, cfg.Publication, cfg.Schema)
	if err != nil {
		return fmt.Errorf("check publication: %w", err)
	}
	tables, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		return fmt.Errorf("check publication: %w", err)
	}
	for _, want := range []string{tableOutbox, tableMessages} {
		if !slices.Contains(tables, want) {
			return fmt.Errorf("%w: publication %q does not cover %s.%s (it has %v)", ErrSetup, cfg.Publication, cfg.Schema, want, tables)
		}
	}
	return checkShardFilters(ctx, conn, cfg)
}

// checkShardFilters verifies, for a sharded relay, that its publication filters each table by
// its shard's predicate (migrations.ShardFilters): a publication made for another shard count
// (migrated with another --shards N) or changed by hand would make this relay publish other
// conversations than its backfill did, and leave some to no shard or to two. ErrSetup names
// the filter found and how to fix it. Row filters exist from PostgreSQL 15.
func checkShardFilters(ctx context.Context, conn *pgx.Conn, cfg *Config) error {
	if cfg.Shards == 0 {
		return nil
	}
	for table, want := range migrations.ShardFilters(cfg.Shards, cfg.Shard) {
		var have string
		err := conn.QueryRow(ctx, `SELECT coalesce(rowfilter, '') FROM pg_publication_tables
			WHERE pubname = $1 AND schemaname = $2 AND tablename = $3`, cfg.Publication, cfg.Schema, table).Scan(&have)
		var pgErr *pgconn.PgError
		if errors.As(err, &pgErr) && pgErr.Code == "42703" { // undefined column: before PostgreSQL 15
			return fmt.Errorf("%w: sharded relays need publication row filters, from PostgreSQL 15", ErrSetup)
		}
		if err != nil {
			return fmt.Errorf("check shard publication: %w", err)
		}
		if !migrations.SameFilter(have, want) {
			return fmt.Errorf("%w: publication %q filters %s.%s by %q, not by shard %d of %d (%s): it was made for another "+
				"shard count or changed; run `baton migrate --shards %d` (see README, \"Resharding\") or start the relay with the "+
				"--shard the publications were made for", ErrSetup, cfg.Publication, cfg.Schema, table, have, cfg.Shard, cfg.Shards,
				want, cfg.Shards)
		}
	}
	return nil
}

// ensureStreams creates the turns, outcomes and dead-letter streams or checks the existing ones
// (see StreamSettings for what each holds), and reports whether every one of them takes
// fast-ingest batches (see batch.go): unless cfg.ClassicPublish, it asks for allow_batched, on
// an existing stream too. A server older than 2.14 does not know the setting and leaves it off;
// the relay then publishes event by event. An existing stream whose settings break what the
// relay relies on is refused with ErrSetup naming each setting; one whose limits (max age,
// bytes, messages, replicas) differ from cfg.Streams is kept as it is, with a warning: the
// relay never rewrites an operator's limits.
func ensureStreams(ctx context.Context, js jetstream.JetStream, cfg *Config) (batched bool, fenced [laneCount]fenceState, err error) {
	batched = !cfg.ClassicPublish
	serverFences := serverFences(cfg.NATS.ConnectedServerVersion())
	if maxPayload := cfg.NATS.MaxPayload(); cfg.Streams.MaxBytes > 0 && cfg.Streams.MaxBytes < maxPayload {
		// A stream smaller than one event could refuse an event for good: "full" forever.
		return false, fenced, fmt.Errorf("%w: stream max bytes %d is below the NATS server's max_payload %d, the size of one event at most; "+
			"raise BATON_STREAM_MAX_BYTES", ErrSetup, cfg.Streams.MaxBytes, maxPayload)
	}
	for lane, want := range wantStreams(cfg) {
		st, err := js.Stream(ctx, want.Name)
		if errors.Is(err, jetstream.ErrStreamNotFound) {
			st, err = js.CreateStream(ctx, want)
			if errors.Is(err, jetstream.ErrStreamNameAlreadyInUse) {
				// Created by a concurrent relay (shard relays starting at once): checked as
				// found, so that this session fences it too.
				st, err = js.Stream(ctx, want.Name)
			}
			if err != nil {
				return false, fenced, fmt.Errorf("create stream %s: %w", want.Name, err)
			}
		}
		if err != nil {
			return false, fenced, fmt.Errorf("look up stream %s: %w", want.Name, err)
		}
		have := st.CachedInfo().Config
		if err := compatible(have, want, cfg.NATS.MaxPayload()); err != nil {
			return false, fenced, fmt.Errorf("%w: stream %s exists with %w; change it or set another stream name", ErrSetup, want.Name, err)
		}
		if diff := otherLimits(have, want); diff != "" {
			cfg.Logger.Warn("stream exists with other limits than configured; the relay keeps them (change them with `nats stream edit`)",
				"stream", want.Name, "differences", diff)
		}
		if batched && !have.AllowBatchPublish {
			have.AllowBatchPublish = true
			info, err := js.UpdateStream(ctx, have)
			batched = err == nil && info.CachedInfo().Config.AllowBatchPublish
			if err == nil {
				have = info.CachedInfo().Config
			}
		}
		fenced[lane] = fenceStream(ctx, js, cfg, have, want, serverFences)
	}
	return batched, fenced, nil
}

// fenceStream returns whether the stream have takes the session fence (see fence.go), adding
// the fence subjects (and Nats-Rollup, which keeps one fence message per slot) to a stream
// created before them. A stream the relay cannot fence is published to as before, with a
// warning that says why.
func fenceStream(ctx context.Context, js jetstream.JetStream, cfg *Config, have, want jetstream.StreamConfig, serverFences bool) fenceState {
	log := cfg.Logger
	switch {
	case !serverFences:
		log.Warn("the NATS server is older than 2.11: the relay cannot fence its streams, and a paused relay's late "+
			"publishes may be stored again after a takeover, beyond the duplicate window", "stream", have.Name,
			"server_version", cfg.NATS.ConnectedServerVersion())
		return fenceState{}
	}
	filter := want.Subjects[1]
	if !slices.Contains(have.Subjects, filter) || !have.AllowAtomicPublish {
		upd := have
		if !slices.Contains(upd.Subjects, filter) {
			upd.Subjects = append(slices.Clone(upd.Subjects), filter)
		}
		// For atomic publishing (atomic.go), which a replicated stream needs; a server older
		// than 2.12 leaves it off.
		upd.AllowAtomicPublish = true
		info, err := js.UpdateStream(ctx, upd)
		if err != nil {
			log.Warn("could not add the fence subjects to the stream: its late publishes are not fenced", "stream", have.Name,
				"subject", filter, "error", err)
			return fenceState{}
		}
		have = info.CachedInfo().Config
	}
	st := fenceState{on: slices.Contains(have.Subjects, filter), rollup: have.AllowRollup && !have.DenyPurge,
		replicated: have.Replicas > 1, atomic: have.AllowAtomicPublish}
	if have.Discard == jetstream.DiscardOld { // it drops its oldest messages: the fence too, in time
		st.maxMsgs, st.maxBytes, st.maxAge = max(0, have.MaxMsgs), max(0, have.MaxBytes), have.MaxAge
	}
	return st
}

// wantStreams returns the configuration of the turns, outcomes and dead-letter streams.
func wantStreams(cfg *Config) []jetstream.StreamConfig {
	s := cfg.Streams
	stream := func(name, kind, desc string) jetstream.StreamConfig {
		return jetstream.StreamConfig{
			Name:        name,
			Description: desc,
			// Events, then the relay's fences (see fence.go): compatible and fenceStream rely on the order.
			Subjects:   []string{wire.StreamFilter(cfg.SubjectPrefix, kind), wire.FenceFilter(cfg.SubjectPrefix, kind)},
			Storage:    jetstream.FileStorage,
			Retention:  jetstream.LimitsPolicy,
			Discard:    jetstream.DiscardOld,
			Duplicates: s.Duplicates,
			MaxBytes:   s.MaxBytes,
			MaxMsgs:    s.MaxMsgs,
			Replicas:   s.Replicas,
			// Stays false on a server that does not know it; checked in ensureStreams.
			AllowBatchPublish: !cfg.ClassicPublish,
			// For the fence's atomic batches (atomic.go; 2.12 and later, else it stays false).
			// Set at creation: an update right after it raced the workers' consumer creation
			// inside nats-server 2.15.2 (fileStore.UpdateConfig against ConsumerStore, seen
			// by the race detector with an embedded server).
			AllowAtomicPublish: true,
		}
	}
	// Turn events leave the stream when the workers acknowledge them, never by age, and a
	// full stream refuses new ones: nothing unfinished is dropped (DESIGN invariant 8).
	turns := stream(cfg.TurnsStream, wire.KindTurns, "Baton turns events relayed from Postgres")
	turns.Retention, turns.Discard, turns.MaxAge = jetstream.WorkQueuePolicy, jetstream.DiscardNew, 0
	outcomes := stream(cfg.OutcomesStream, wire.KindOutcomes, "Baton outcomes events relayed from Postgres")
	outcomes.MaxAge = s.MaxAge
	deadLetter := stream(cfg.DeadLetterStream, wire.KindDeadLetter, "Baton relay: changes set aside because no retry could publish them")
	deadLetter.MaxAge, deadLetter.MaxMsgs = cfg.DeadLetterMaxAge, -1
	return []jetstream.StreamConfig{turns, outcomes, deadLetter}
}

// compatible reports the settings of have that break what the relay relies on. Each of them
// would fail every publish, or leave it without a PubAck, on every retry, or drop unfinished
// turn events: the relay refuses to start instead. maxPayload is the server's: the relay sizes
// events to fit it.
func compatible(have, want jetstream.StreamConfig, maxPayload int64) error {
	var bad []string
	if !slices.Contains(have.Subjects, want.Subjects[0]) {
		bad = append(bad, fmt.Sprintf("subjects %v (want %v)", have.Subjects, want.Subjects))
	}
	if have.Storage != want.Storage {
		bad = append(bad, fmt.Sprintf("storage %s (want %s)", have.Storage, want.Storage))
	}
	turns := want.Retention == jetstream.WorkQueuePolicy
	if have.Retention != want.Retention {
		why := ""
		if turns || have.Retention == jetstream.WorkQueuePolicy {
			// JetStream cannot change retention to or from work queue on an existing stream.
			why = "; JetStream cannot change it in place: stop every relay, let the workers drain the stream " +
				"(no pending or processing outbox rows, and `nats consumer info` shows nothing pending or awaiting ack), " +
				"delete it with `nats stream rm " + have.Name + "`, and start the relay, which creates it (see README, stream settings)"
		}
		bad = append(bad, fmt.Sprintf("retention %s (want %s%s)", have.Retention, want.Retention, why))
	}
	if have.Discard != want.Discard {
		why := "discarding new events would stall the relay once the stream is full"
		if turns {
			why = "discarding old events would drop unfinished turn events when the stream is full"
		}
		bad = append(bad, fmt.Sprintf("discard %s (want %s: %s; `nats stream edit %s --discard %s`)", have.Discard, want.Discard, why,
			have.Name, strings.TrimPrefix(strings.ToLower(want.Discard.String()), "discard")))
	}
	if turns && have.MaxAge > 0 {
		bad = append(bad, fmt.Sprintf("max_age %s (want none: an age limit would drop unfinished turn events)", have.MaxAge))
	}
	if turns && have.MaxMsgsPerSubject > 0 {
		bad = append(bad, fmt.Sprintf("max_msgs_per_subject %d (want -1: a conversation's newer turn event would drop its "+
			"older unfinished one, or with discard_new_per_subject one busy conversation would stall the relay)", have.MaxMsgsPerSubject))
	}
	if have.Duplicates < want.Duplicates {
		bad = append(bad, fmt.Sprintf("duplicate window %s (want at least %s)", have.Duplicates, want.Duplicates))
	}
	if have.DenyDelete != want.DenyDelete || have.Sealed {
		bad = append(bad, "sealed or deny-delete")
	}
	if have.NoAck {
		bad = append(bad, "no_ack true (want false: the relay confirms nothing without a PubAck)")
	}
	if have.MaxMsgSize > 0 && int64(have.MaxMsgSize) < maxPayload {
		bad = append(bad, fmt.Sprintf("max_msg_size %d (want -1 or at least the server's max_payload %d: "+
			"the relay sizes events to the server's limit)", have.MaxMsgSize, maxPayload))
	}
	if len(bad) == 0 {
		return nil
	}
	return errors.New(strings.Join(bad, ", "))
}

// otherLimits describes the limits of have that differ from want's without breaking anything
// (the relay keeps them), or returns "".
func otherLimits(have, want jetstream.StreamConfig) string {
	var diff []string
	if have.MaxAge != want.MaxAge && want.Retention != jetstream.WorkQueuePolicy {
		diff = append(diff, fmt.Sprintf("max_age %s (configured %s)", have.MaxAge, want.MaxAge))
	}
	if have.MaxBytes != want.MaxBytes {
		diff = append(diff, fmt.Sprintf("max_bytes %d (configured %d)", have.MaxBytes, want.MaxBytes))
	}
	if have.MaxMsgs != want.MaxMsgs {
		diff = append(diff, fmt.Sprintf("max_msgs %d (configured %d)", have.MaxMsgs, want.MaxMsgs))
	}
	if have.Replicas != want.Replicas {
		diff = append(diff, fmt.Sprintf("replicas %d (configured %d)", have.Replicas, want.Replicas))
	}
	return strings.Join(diff, ", ")
}

// slotInfo is the slot's row in pg_replication_slots and Baton's record of it.
type slotInfo struct {
	exists       bool
	plugin       string
	database     string
	ours         bool // database is the one connected to: current_database(), which a URL may leave unnamed
	walStatus    string
	confirmed    string
	active       bool // a walsender that still exists streams from it
	recorded     bool // baton_relay_slots has a row for it: a relay created it
	backfillDone bool // and that relay finished its first-start backfill
}

// busy returns errSlotBusy when a walsender streams from the slot.
func (s slotInfo) busy() error {
	if s.active {
		return fmt.Errorf("%w: a walsender streams from it", errSlotBusy)
	}
	return nil
}

func readSlot(ctx context.Context, conn *pgx.Conn, cfg *Config) (slotInfo, error) {
	var s slotInfo
	err := conn.QueryRow(ctx, `SELECT coalesce(plugin, ''), coalesce(database, ''), database IS NOT DISTINCT FROM current_database(),
			coalesce(wal_status, ''), coalesce(confirmed_flush_lsn::text, ''),
			active AND EXISTS (SELECT 1 FROM pg_stat_activity w WHERE w.pid = active_pid)
		FROM pg_replication_slots WHERE slot_name = $1`, cfg.Slot).Scan(&s.plugin, &s.database, &s.ours, &s.walStatus, &s.confirmed, &s.active)
	switch {
	case errors.Is(err, pgx.ErrNoRows):
	case err != nil:
		return s, fmt.Errorf("read slot %s: %w", cfg.Slot, err)
	default:
		s.exists = true
	}
	err = conn.QueryRow(ctx, `SELECT backfill_done FROM baton_relay_slots WHERE slot_name = $1`, cfg.Slot).Scan(&s.backfillDone)
	var pgErr *pgconn.PgError
	switch {
	case errors.Is(err, pgx.ErrNoRows):
	case errors.As(err, &pgErr) && (pgErr.Code == "42P01" || pgErr.Code == "42703"): // undefined table or column
		return s, fmt.Errorf("%w: read baton_relay_slots: %w; the schema is behind this relay: run `baton migrate`", ErrSetup, err)
	case err != nil:
		return s, fmt.Errorf("read baton_relay_slots: %w", err)
	default:
		s.recorded = true
	}
	return s, nil
}

// slotAction is what a session does with the slot it found.
type slotAction int

const (
	slotStream   slotAction = iota // stream from it
	slotCreate                     // create it and backfill
	slotRecreate                   // drop it, then create it and backfill
	slotBackfill                   // keep it, backfill from a snapshot taken now, then stream from it
)

// decideSlot applies the slot rules to what readSlot found:
//   - No slot: create one, with the first-start backfill.
//   - A lost slot (wal_status "lost") ends the relay with ErrSlotLost: its WAL is gone.
//   - A slot of another database is never touched (ErrSetup).
//   - Baton's slot (a baton_relay_slots row, plugin pgoutput) whose backfill finished: stream.
//   - Baton's slot whose backfill did not finish, left by a relay that died during its first
//     start or a session that failed in it (a full turns stream, NATS away): keep it and
//     backfill again from a snapshot taken now. Nothing was confirmed from the slot, so it
//     still holds every change since its consistent point, replies included, which a new slot
//     would not; a row unfinished at that point and still unfinished now is in the new
//     snapshot, one finished meanwhile is owed nothing, and one committed after the point is
//     in both (the second copy is dropped by its Nats-Msg-Id or by the workers). The row is
//     written before the slot is created, so a kill at any point of the first start leaves a
//     slot that is recognised as Baton's.
//   - Any other slot (no row, or another plugin) belongs to someone else, an operator or
//     another tool: refused with ErrSetup and left as it is, unless recreate allows dropping it.
func decideSlot(s slotInfo, name string, recreate bool) (slotAction, error) {
	if !s.exists {
		return slotCreate, nil
	}
	if s.walStatus == "lost" {
		return 0, fmt.Errorf("%w: slot %s has wal_status lost: drop it with SELECT pg_drop_replication_slot('%s') "+
			"and restart the relay to recreate it and backfill unfinished rows", ErrSlotLost, name, name)
	}
	if !s.ours {
		return 0, fmt.Errorf("%w: slot %s belongs to database %q, not to this one; set another slot name (BATON_SLOT)",
			ErrSetup, name, s.database)
	}
	if s.recorded && s.plugin == "pgoutput" {
		if s.backfillDone {
			return slotStream, nil
		}
		return slotBackfill, nil
	}
	if recreate {
		return slotRecreate, nil
	}
	why := "it has no row in baton_relay_slots"
	if s.plugin != "pgoutput" {
		why = fmt.Sprintf("it uses plugin %q", s.plugin)
	}
	return 0, fmt.Errorf("%w: slot %s exists but Baton did not create it (%s); the relay leaves it alone. "+
		"Set another slot name (BATON_SLOT), drop it (SELECT pg_drop_replication_slot('%s')), or start the relay with "+
		"--recreate-slot (Config.RecreateSlot) to drop it and create Baton's, with a first-start backfill",
		ErrSetup, name, why, name)
}

// retryIn waits d or until ctx ends.
func retryIn(ctx context.Context, d time.Duration) error {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}

// publishAtomic decides whether the relay publishes in atomic batches (atomic.go): when a
// fenced stream is replicated, since its events cannot each carry the fence. Every fenced stream
// is then published to that way; one that takes no atomic batches (a server older than 2.12)
// goes unfenced, with a warning.
func publishAtomic(fenced *[laneCount]fenceState, log *slog.Logger) bool {
	atomic := false
	for _, st := range fenced {
		atomic = atomic || st.on && st.replicated
	}
	if !atomic {
		return false
	}
	for lane := range fenced {
		if st := &fenced[lane]; st.on && !st.atomic {
			log.Warn("a replicated stream is fenced with atomic batches, which this stream does not take (nats-server 2.12 or later): "+
				"it is not fenced, and a paused relay's late publishes may be stored again after a takeover, beyond the duplicate window",
				"lane", laneKinds[lane])
			*st = fenceState{}
		}
	}
	for _, st := range fenced {
		if st.on && st.replicated {
			return true
		}
	}
	return false
}
