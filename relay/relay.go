package relay

import (
	"context"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"strings"
	"sync/atomic"
	"time"

	"github.com/jackc/pglogrepl"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgproto3"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"golang.org/x/sync/errgroup"
)

// Relay streams the outbox publication to JetStream. Create it with New and call Run.
type Relay struct {
	cfg Config
	m   *metrics

	// streamsChecked is set once ensureStreams succeeded, with the server's maxPayload then,
	// and cleared when a publish found no stream for its subject (one was deleted) or was too
	// large (the server's limit went down): only Run's goroutine uses them.
	streamsChecked bool
	maxPayload     int64
	batched        bool // every stream takes fast-ingest batches (see batch.go)
	// fenced says which streams take the session fence (see fence.go), and fence holds this
	// session's, which its pipelines' sender raises.
	fenced [laneCount]fenceState
	fence  *sessionFence
	// atomic says a fenced stream is replicated: every stream is published to in atomic
	// batches (see atomic.go).
	atomic bool

	confirmed atomic.Uint64 // the LSN last made safe to confirm
	active    atomic.Bool   // streaming from the slot
	healthy   atomic.Bool   // connected and either streaming or standing by
}

// New validates cfg, fills its defaults and returns a Relay.
func New(cfg Config) (*Relay, error) {
	if err := cfg.fill(); err != nil {
		return nil, err
	}
	m := newMetrics(cfg.Registerer)
	for _, stream := range []string{cfg.TurnsStream, cfg.OutcomesStream, cfg.DeadLetterStream} {
		m.streamFull.WithLabelValues(stream).Set(0) // shown from the start
	}
	return &Relay{cfg: cfg, m: m}, nil
}

// Confirmed returns the LSN the relay has made safe to confirm to Postgres.
func (r *Relay) Confirmed() pglogrepl.LSN { return pglogrepl.LSN(r.confirmed.Load()) }

// Active reports whether this relay holds the slot and streams.
func (r *Relay) Active() bool { return r.active.Load() }

// Ready reports whether the relay is connected and streaming or standing by.
func (r *Relay) Ready() bool { return r.healthy.Load() }

// Run streams until ctx ends, then stops reading, waits up to DrainTimeout for the PubAcks of
// what it published, confirms them, and returns nil. Lost connections to Postgres or NATS are
// retried with capped, jittered backoff, resuming from the slot's confirmed LSN. It returns an
// error only for what retrying cannot fix: ErrSetup and ErrSlotLost.
func (r *Relay) Run(ctx context.Context) error {
	log := r.cfg.Logger
	backoff := r.cfg.MinBackoff
	for {
		started := time.Now()
		err := r.session(ctx)
		if errors.Is(err, errNoResponders) || errors.Is(err, nats.ErrMaxPayload) || errors.Is(err, errBatchRefused) ||
			errors.Is(err, errNoPubAck) && r.serverAnswers() ||
			// A stream scaled to replicas while the relay ran (pipelined checks refused), or
			// its atomic batches turned off: the fencing way is decided again.
			isAPIError(err, checkInProcess) || isAPIError(err, atomicDisabled) {
			r.streamsChecked = false // check the streams and the server's limit again
		}
		r.active.Store(false)
		r.m.active.Set(0)
		if ctx.Err() != nil {
			return nil
		}
		if errors.Is(err, ErrSetup) || errors.Is(err, ErrSlotLost) {
			r.healthy.Store(false)
			r.m.stopped(err)
			return err
		}
		r.healthy.Store(false)
		r.m.reconnects.Inc()
		if time.Since(started) > time.Minute {
			backoff = r.cfg.MinBackoff
		}
		var full *streamFullError
		var next time.Duration
		backoff, next = nextBackoff(backoff, r.cfg.MaxBackoff, errors.As(err, &full))
		wait := backoff/2 + rand.N(backoff/2+1) //nolint:gosec // G404: jitter needs no secrecy
		switch {
		case full != nil:
			r.streamFull(ctx, full, wait)
		case errors.Is(err, errFencedOut):
			log.Warn("a newer relay session fenced this one out of the streams; its unacknowledged events are left "+
				"to that session, and this relay takes the relay lock again or stands by", "error", err, "retry_in", wait)
		default:
			// Not nc.Buffered(): it waits for nats.go's lock, which a write stuck on a stalled
			// server holds for up to the flusher timeout.
			log.Warn("relay session ended; reconnecting", "error", err, "retry_in", wait)
		}
		if retryIn(ctx, wait) != nil {
			return nil
		}
		backoff = next
	}
}

// streamFullMaxBackoff caps the wait between sessions while a stream refuses events for lack
// of room: it frees as the workers acknowledge turn events, and the relay should follow soon.
const streamFullMaxBackoff = time.Second

// nextBackoff returns the backoff to wait now (Run jitters it) after a session that ended
// with backoff cur, and the one after: doubling up to maxBackoff, and at most
// streamFullMaxBackoff when a stream refused an event for lack of room, whatever came before:
// room frees as the workers acknowledge, and the relay should follow soon.
func nextBackoff(cur, maxBackoff time.Duration, streamFull bool) (now, next time.Duration) {
	limit := maxBackoff
	if streamFull {
		limit = min(limit, streamFullMaxBackoff)
	}
	now = min(cur, limit)
	return now, min(2*now, limit)
}

// streamFull handles a session that ended because a stream refused an event for lack of room
// (see streamFullError): it raises baton_relay_stream_full for that stream and logs once at
// WARN per episode, naming the stream, its limits and what it holds; the retries of the same
// episode log at DEBUG. The gauge falls back to 0, with an INFO log, at the next PubAck from
// that stream (metrics.roomAgain). The slot's confirmed LSN stays before the refused event:
// nothing past it is confirmed until it is stored.
func (r *Relay) streamFull(ctx context.Context, full *streamFullError, retryIn time.Duration) {
	log := r.cfg.Logger
	if !r.m.streamIsFull(full.lane, full.stream, full.msgID) {
		log.Debug("stream still full; retrying", "stream", full.stream, "error", full, "retry_in", retryIn)
		return
	}
	args := []any{"stream", full.stream, "subject", full.subject, "error_code", int(full.err.ErrorCode),
		"error", full.err.Description, "lsn", r.Confirmed(), "retry_in", retryIn}
	// The stream's own limits and state: an existing stream may have others than configured.
	// The server just answered, so the API does not wait on a stuck publish.
	if js, err := jetstream.New(r.cfg.NATS); err == nil {
		ictx, cancel := context.WithTimeout(ctx, time.Second)
		if st, err := js.Stream(ictx, full.stream); err == nil {
			info := st.CachedInfo()
			args = append(args, "max_msgs", info.Config.MaxMsgs, "max_bytes", info.Config.MaxBytes,
				"msgs", info.State.Msgs, "bytes", info.State.Bytes)
		}
		cancel()
	}
	log.Warn("stream is full: holding the LSN and retrying until the workers' acknowledgements free room "+
		"(raise BATON_STREAM_MAX_MSGS / BATON_STREAM_MAX_BYTES, or add workers, if it persists)", args...)
}

// serverAnswers reports whether the NATS server answers a ping within a second. Publishes
// that got no PubAck from a server that answers point at a stream that stopped acknowledging
// (no_ack), worth checking again; from one that does not, at a stalled server or path, where
// the JetStream API would time out the same way and hold the relay in its setup instead of its
// session, which keeps reporting to Postgres. Nothing is stuck writing at that point (see
// errNoPubAck), so the ping cannot wait on a write holding nats.go's lock.
func (r *Relay) serverAnswers() bool {
	return r.cfg.NATS.FlushTimeout(time.Second) == nil
}

// session connects, becomes the active relay (or waits as standby), prepares the slot and
// streams until an error or ctx ends.
func (r *Relay) session(ctx context.Context) error {
	cfg := &r.cfg
	log := cfg.Logger
	connCfg, err := pgx.ParseConfig(cfg.DatabaseURL)
	if err != nil {
		return parseError(err)
	}
	pinSession(connCfg.RuntimeParams)
	setKeepalives(connCfg.RuntimeParams)
	// The relay's own statements (baton_relay_slots) name Baton's tables as the migrations
	// created them: in Schema, and nowhere else.
	connCfg.RuntimeParams["search_path"] = pgx.Identifier{cfg.Schema}.Sanitize()
	if connCfg.ConnectTimeout == 0 { // connect_timeout in the URL wins
		connCfg.ConnectTimeout = cfg.SetupTimeout
	}
	conn, err := pgx.ConnectConfig(ctx, connCfg)
	if err != nil {
		r.m.errors.WithLabelValues("postgres").Inc()
		return connectError(err)
	}
	defer func() { closeConn(ctx, conn.PgConn()) }()
	if err := r.bounded(ctx, func(ctx context.Context) error { return checkDatabase(ctx, conn, cfg) }); err != nil {
		return err
	}

	// Checked once, not at every session start: a session that ended because NATS stopped
	// reading would otherwise start the next one blocked on the JetStream API (or on reading
	// the server's max payload), behind nats.go's connection lock that the stuck publish
	// holds, and there no SIGTERM reaches it.
	if !r.streamsChecked {
		js, err := jetstream.New(cfg.NATS)
		if err != nil {
			return fmt.Errorf("jetstream: %w", err)
		}
		batched, fenced, err := ensureStreams(ctx, js, cfg)
		if err != nil {
			r.m.errors.WithLabelValues("nats").Inc()
			return err
		}
		atomic := publishAtomic(&fenced, log)
		if batched != r.batched || atomic != r.atomic || !r.streamsChecked {
			mode := "in fast-ingest batches"
			switch {
			case atomic:
				mode = "in atomic batches, one at a time per stream (a replicated stream is fenced that way)"
			case !batched:
				mode = "event by event (the streams take no fast-ingest batches: nats-server 2.14 or later, allow_batched)"
			}
			log.Info("publishing "+mode, "classic_publish", cfg.ClassicPublish)
		}
		r.streamsChecked, r.maxPayload, r.batched, r.fenced, r.atomic = true, cfg.NATS.MaxPayload(), batched, fenced, atomic
		if batched {
			r.m.batched.Set(1)
		} else {
			r.m.batched.Set(0)
		}
	}

	replCfg := connCfg.Config.Copy()
	replCfg.RuntimeParams["replication"] = "database"
	replCfg.RuntimeParams["application_name"] = "baton-relay"

	// Which relay streams is the slot's to decide (standby.go): this one stands by while
	// another streams from it or runs its first start, and tries again every StandbyPoll.
	for standby := false; ; standby = true {
		// A standby polls with one query on its session: while a walsender streams from the
		// slot, no fence read and no replication connection (a walsender forked and ended
		// every poll) is spent on an attempt that would find it busy.
		err := r.slotStreaming(ctx, conn)
		if err == nil {
			// Raised by the sender of the session's first pipeline, before it publishes
			// anything: from then on, what an older session of this slot still sends to a
			// fenced stream is refused. Read before each attempt at the slot (see
			// sessionFence.read).
			r.fence = r.newSessionFence()
			if r.fence != nil {
				r.fence.read(cfg.SetupTimeout)
			}
			err = r.stream(ctx, conn, replCfg)
		}
		if !errors.Is(err, errSlotBusy) {
			return err
		}
		r.healthy.Store(true)
		if !standby {
			log.Info("another relay is active; standing by", "slot", cfg.Slot, "reason", err)
		}
		if err := retryIn(ctx, cfg.StandbyPoll); err != nil {
			return err
		}
	}
}

// slotStreaming returns errSlotBusy while a walsender streams from the slot (readSlot's view of
// it), and nil when an attempt at the slot may succeed.
func (r *Relay) slotStreaming(ctx context.Context, conn *pgx.Conn) error {
	var slot slotInfo
	if err := r.bounded(ctx, func(ctx context.Context) (err error) {
		slot, err = readSlot(ctx, conn, &r.cfg)
		return err
	}); err != nil {
		return err
	}
	return slot.busy()
}

// sessionParams are sent as startup parameters on every connection the relay opens. Settings a
// client sends at startup take precedence over ALTER DATABASE and ALTER ROLE settings, which
// apply to replication sessions too: pgoutput prints each value with its session's settings
// (DateStyle 'SQL, DMY' prints "29/02/2024 23:59:58 UTC"), and the decoder reads them in the
// forms these settings give: ISO timestamps in UTC, postgres-style intervals, and floats with
// every digit.
var sessionParams = map[string]string{
	"datestyle":          "ISO, MDY",
	"intervalstyle":      "postgres",
	"extra_float_digits": "3",
	"timezone":           "UTC",
}

// keepaliveParams are sent as startup parameters on every connection the relay opens, unless
// the database URL sets them. They make the server notice a relay host that vanished without
// closing its sockets in about tcp_keepalives_idle + interval × count (25s) instead of the
// kernel's default of over two hours, and give up on unacknowledged writes to it after
// tcp_user_timeout (ms). Until it notices, that host's backends keep the relay lock: see
// StaleLockAfter for what a standby does then. The server ignores them on Unix sockets.
var keepaliveParams = map[string]string{
	"tcp_keepalives_idle":     "10",
	"tcp_keepalives_interval": "5",
	"tcp_keepalives_count":    "3",
	"tcp_user_timeout":        "30000",
}

// setKeepalives sets keepaliveParams in params where the database URL did not set them.
func setKeepalives(params map[string]string) {
	set := map[string]bool{}
	for k := range params {
		set[strings.ToLower(k)] = true
	}
	for k, v := range keepaliveParams {
		if !set[k] {
			params[k] = v
		}
	}
}

// bounded runs a setup step (a query, START_REPLICATION) with a deadline of SetupTimeout, so
// that a path that drops packets fails the session instead of hanging it.
func (r *Relay) bounded(ctx context.Context, step func(context.Context) error) error {
	return within(ctx, r.cfg.SetupTimeout, step)
}

// within runs step with a deadline of d.
func within(ctx context.Context, d time.Duration, step func(context.Context) error) error {
	ctx, cancel := context.WithTimeout(ctx, d)
	defer cancel()
	return step(ctx)
}

// closeConn closes a connection, waiting at most closeTimeout for the goodbye to be written: on
// a dead path the socket is closed anyway.
func closeConn(ctx context.Context, c *pgconn.PgConn) {
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), closeTimeout)
	defer cancel()
	_ = c.Close(ctx)
}

// closeTimeout bounds how long closing a connection waits.
const closeTimeout = 5 * time.Second

// pinSession sets sessionParams in params, replacing what the database URL set.
func pinSession(params map[string]string) {
	for k := range params {
		if _, pinned := sessionParams[strings.ToLower(k)]; pinned {
			delete(params, k) // "DateStyle" and "datestyle" would both be sent
		}
	}
	for k, v := range sessionParams {
		params[k] = v
	}
}

// stream prepares the slot (creating and backfilling it on first start) and streams from it.
func (r *Relay) stream(ctx context.Context, conn *pgx.Conn, replCfg *pgconn.Config) error {
	cfg := &r.cfg
	log := cfg.Logger
	var frames *cutFrames
	replCfg.BuildFrontend = func(r io.Reader, w io.Writer) *pgproto3.Frontend {
		frames = newCutFrames(r, cfg.MaxChangeBytes)
		return pgproto3.NewFrontend(frames, w)
	}
	repl, err := pgconn.ConnectConfig(ctx, replCfg)
	if err != nil {
		r.m.errors.WithLabelValues("postgres").Inc()
		return fmt.Errorf("replication connection: %w", err)
	}
	defer func() { closeConn(ctx, repl) }()
	frames.waitOn(repl.Conn())
	r.fence.takeSlot(ctx) // the fences are read before the slot is created or streamed from

	var slot slotInfo
	if err := r.bounded(ctx, func(ctx context.Context) (err error) {
		slot, err = readSlot(ctx, conn, cfg)
		return err
	}); err != nil {
		return err
	}
	action, err := decideSlot(slot, cfg.Slot, cfg.RecreateSlot)
	if errors.Is(err, ErrSlotLost) {
		r.m.slotLost.Set(1)
	}
	if err != nil {
		return err
	}
	if err := slot.busy(); err != nil {
		return err
	}
	if action != slotStream {
		claim, fctx, err := r.claimFirstStart(ctx, conn)
		if err != nil {
			return err
		}
		if claim == nil {
			return fmt.Errorf("%w: another relay runs its first start", errSlotBusy)
		}
		err = r.firstStart(fctx, conn, repl, action, slot, claim.token)
		lost := claim.lost.Load()
		claim.release(ctx)
		if err != nil && lost {
			// The session ends (its connection may have lost a query to the cancel); the
			// next one finds the claim another's and stands by.
			return fmt.Errorf("lost the claim of the slot's first start to another relay: %w", err)
		}
		if err != nil {
			return err
		}
	}
	switch action {
	case slotStream:
		// The slot's position is the truth at every session start, also when it is behind
		// what this process confirmed before: after a restore or a failover the slot may have
		// gone back, and the transactions after its position are replayed. Keeping a higher
		// LSN from memory would confirm them to the server before they were published again.
		lsn, err := pglogrepl.ParseLSN(slot.confirmed)
		if err != nil {
			return fmt.Errorf("slot %s confirmed_flush_lsn %q: %w", cfg.Slot, slot.confirmed, err)
		}
		r.confirmed.Store(uint64(lsn))
		r.m.confirmedLSN.Set(float64(lsn))
	}

	err = r.bounded(ctx, func(ctx context.Context) error {
		return pglogrepl.StartReplication(ctx, repl, cfg.Slot, 0, pglogrepl.StartReplicationOptions{
			Mode: pglogrepl.LogicalReplication,
			PluginArgs: []string{"proto_version '1'", "publication_names '" + cfg.Publication + "'",
				"messages 'true'"},
		})
	})
	if err != nil {
		var pgErr *pgconn.PgError
		if errors.As(err, &pgErr) && pgErr.Code == "55000" {
			r.m.slotLost.Set(1)
			return fmt.Errorf("%w: %w", ErrSlotLost, err)
		}
		if errors.As(err, &pgErr) && pgErr.Code == "55006" { // object_in_use: another walsender has it
			return fmt.Errorf("%w: %w", errSlotBusy, err)
		}
		return fmt.Errorf("start replication on slot %s: %w", cfg.Slot, err)
	}
	// What the server had flushed now that this session holds the slot: the backlog the
	// walsender sends without waiting (see reader.backlogEnd), and the end of the replay an
	// earlier session may have stored events of past the slot's position (replay.go).
	var flushed pglogrepl.LSN
	if err := r.bounded(ctx, func(ctx context.Context) error {
		return conn.QueryRow(ctx, `SELECT CASE WHEN pg_is_in_recovery() THEN pg_last_wal_replay_lsn()
			ELSE pg_current_wal_flush_lsn() END::text`).Scan(&lsnText{&flushed})
	}); err != nil {
		return fmt.Errorf("read the WAL position: %w", err)
	}
	var replay *replayCheck
	if action == slotStream {
		if replay, err = r.newReplayCheck(conn, flushed); err != nil {
			return err
		}
	}
	log.Info("streaming", "slot", cfg.Slot, "lsn", r.Confirmed())
	r.active.Store(true)
	r.healthy.Store(true)
	r.m.active.Set(1)
	return r.replicate(ctx, conn, repl, frames, replay, flushed)
}

// firstStart runs the slot's first start that action says, under the claim token: creating
// the slot (after dropping a foreign one, as RecreateSlot allows) and backfilling, or
// backfilling again a slot whose backfill did not finish.
func (r *Relay) firstStart(ctx context.Context, conn *pgx.Conn, repl *pgconn.PgConn, action slotAction, slot slotInfo, token string) error {
	cfg := &r.cfg
	log := cfg.Logger
	switch action {
	case slotBackfill:
		log.Warn("slot has no finished backfill; backfilling again from a snapshot taken now, keeping the slot",
			"slot", cfg.Slot, "consistent_point", slot.confirmed)
		lsn, err := pglogrepl.ParseLSN(slot.confirmed)
		if err != nil {
			return fmt.Errorf("slot %s confirmed_flush_lsn %q: %w", cfg.Slot, slot.confirmed, err)
		}
		r.confirmed.Store(uint64(lsn))
		r.m.confirmedLSN.Set(float64(lsn))
		return r.backfillAgain(ctx, conn, slot.confirmed, token)
	case slotRecreate:
		log.Warn("dropping a slot Baton did not create, as RecreateSlot allows", "slot", cfg.Slot, "plugin", slot.plugin)
		if err := r.bounded(ctx, func(ctx context.Context) error {
			return pglogrepl.DropReplicationSlot(ctx, repl, cfg.Slot, pglogrepl.DropReplicationSlotOptions{})
		}); err != nil {
			return fmt.Errorf("drop slot %s: %w", cfg.Slot, err)
		}
	}
	return r.createAndBackfill(ctx, conn, repl, token)
}

// lsnText scans an LSN printed as text ("0/16B3748").
type lsnText struct{ lsn *pglogrepl.LSN }

func (l lsnText) Scan(src any) error {
	s, ok := src.(string)
	if !ok {
		return fmt.Errorf("LSN: got %T", src)
	}
	v, err := pglogrepl.ParseLSN(s)
	*l.lsn = v
	return err
}

// replicate runs the reader (which owns the replication connection, and conn while it
// streams) and the pipeline until one fails or ctx ends.
func (r *Relay) replicate(ctx context.Context, conn *pgx.Conn, repl *pgconn.PgConn, frames *cutFrames, replay *replayCheck, flushed pglogrepl.LSN) error {
	cfg := &r.cfg
	p := newPipeline(cfg, r.m, &r.confirmed, natsSender(cfg.NATS), r.batched)
	p.fence, p.atomic = r.fence, r.atomic
	p.deferKicks = true
	frames.readInBulk(&p.behind, p.flushOut)
	g, gctx := errgroup.WithContext(context.WithoutCancel(ctx))
	stopping := ctx.Done()
	g.Go(func() error {
		err := p.run(gctx.Done(), stopping, cfg.DrainTimeout)
		if errors.Is(err, errDrainTimeout) {
			cfg.Logger.Warn("stopping without every PubAck; the unacknowledged events will be replayed", "in_flight", p.pending())
			return nil
		}
		return err
	})
	rd := r.newReader(repl, frames, p)
	rd.replay, rd.backlogEnd, rd.side = replay, flushed, conn
	g.Go(func() error { return rd.run(ctx, gctx) })
	return g.Wait()
}
