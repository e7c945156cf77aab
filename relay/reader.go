package relay

import (
	"context"
	"errors"
	"fmt"
	"net"
	"sync/atomic"
	"time"

	"github.com/jackc/pglogrepl"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgproto3"
	"github.com/nats-io/nats.go"

	"github.com/batonhq/baton/wire"
)

// reader receives the replication stream, decodes it into the pipeline, and reports the
// confirmed LSN to Postgres every StatusInterval and whenever the server asks (see run).
//
// It owns the replication connection: only its goroutine reads from or writes to it. Reads
// wait with a network deadline at the next status time (set once per period, not per
// message), and ending the session's contexts moves that deadline to now.
//
// Its methods take two contexts: ctx, whose end is a graceful stop (stop reading, drain the
// pipeline, report what it confirmed), and gctx, the session's group context, which ends when
// the pipeline failed and bounds every write to the connection.
type reader struct {
	cfg       *Config
	m         *metrics
	repl      *pgconn.PgConn
	conn      net.Conn // repl's, for read deadlines
	p         *pipeline
	dec       *decoder
	frames    *cutFrames     // between repl's socket and its protocol reader: says which messages it cut
	copies    uint64         // CopyData messages received, as frames counts them
	confirmed *atomic.Uint64 // what the pipeline made safe to confirm, reported in status updates

	// replay, while not nil, holds the replay's items for the replay check (see replay.go).
	replay *replayCheck
	// txLSN is the open transaction's commit LSN as its events' wire.HeaderCommitLSN carries it.
	txLSN []string

	live       liveness // whether the walsender answered the status updates
	heardBytes int64    // frames.received when the reader last counted bytes as life
	// side is the session's other connection, which the reader owns while it streams:
	// where it looks at its walsender when the stream is silent (see walsenderBusy).
	side       *pgx.Conn
	busy       bool // the last look found the walsender busy
	answersDue int  // status updates sent whose answer (a keepalive) has not arrived
	// backlogEnd is the WAL the server had flushed when the session took the slot: the
	// walsender sends all of it without waiting, so a keepalive before it is no sign of
	// being caught up, whatever answersDue says (see handleCopyData).
	backlogEnd pglogrepl.LSN
	nextStatus time.Time // when the next status update is due; reads wait until then
}

// newReader returns the reader of one replication session on repl, feeding p.
func (r *Relay) newReader(repl *pgconn.PgConn, frames *cutFrames, p *pipeline) *reader {
	cfg := &r.cfg
	return &reader{
		cfg:        cfg,
		m:          r.m,
		repl:       repl,
		conn:       repl.Conn(),
		p:          p,
		frames:     frames,
		dec:        newDecoder(cfg.Schema, cfg.SubjectPrefix, r.eventPayload()).inShard(cfg.Shard, cfg.Shards),
		confirmed:  &r.confirmed,
		live:       liveness{bound: silenceBound(cfg.StatusInterval, cfg.MinSilence)},
		nextStatus: time.Now(),
	}
}

// errSilent ends a session whose replication stream went silent: no CopyData arrived within
// silenceBound of a status update that asked for a reply.
var errSilent = errors.New("replication stream silent")

// run reads until an error, until the pipeline stops (gctx ends, or an add finds it stopped:
// it returns nil, the pipeline's error being the session's), or until ctx ends: then it stops
// reading and drains, and returns the error of the last status update, if any.
func (rd *reader) run(ctx, gctx context.Context) error {
	wake := func() { _ = rd.conn.SetReadDeadline(time.Now()) }
	defer context.AfterFunc(ctx, wake)()
	defer context.AfterFunc(gctx, wake)()
	for {
		if ctx.Err() != nil {
			return rd.drain(gctx)
		}
		if gctx.Err() != nil {
			return nil // the pipeline failed; its error is the session's
		}
		if err := rd.statusDue(gctx); err != nil {
			return err
		}
		if ctx.Err() != nil || gctx.Err() != nil {
			continue // the deadline just set may have overwritten a wake-up
		}
		if err := rd.receive(ctx, gctx); err != nil {
			return stoppedIsNil(err)
		}
	}
}

// drain ends the session gracefully: it closes the pipeline's input, waits for the pipeline
// to finish (see pipeline.run), and reports what it confirmed. An unfinished transaction is
// never confirmed: it is replayed from the confirmed LSN, which never passes it, and its
// events already published are deduplicated.
func (rd *reader) drain(gctx context.Context) error {
	rd.p.closeInput()
	select {
	case <-rd.p.done:
	case <-time.After(rd.cfg.DrainTimeout + time.Second):
	}
	err := rd.sendStatus(gctx)
	rd.cfg.Logger.Info("relay stopped", "lsn", pglogrepl.LSN(rd.confirmed.Load()))
	return err
}

// receive reads one message, waiting at most until the read deadline, and handles it. A read
// that timed out is no error unless the stream went silent (see checkSilence).
func (rd *reader) receive(ctx, gctx context.Context) error {
	raw, err := rd.repl.ReceiveMessage(context.Background())
	if err != nil {
		if pgconn.Timeout(err) {
			if _, err := rd.decideReplay(ctx, gctx); err != nil {
				return err
			}
			return rd.checkSilence(gctx, time.Now())
		}
		rd.m.errors.WithLabelValues("postgres").Inc()
		return fmt.Errorf("receive replication message: %w", err)
	}
	switch msg := raw.(type) {
	case *pgproto3.CopyData:
		return rd.handleCopyData(ctx, gctx, msg.Data)
	case *pgproto3.ErrorResponse:
		rd.m.errors.WithLabelValues("postgres").Inc()
		return fmt.Errorf("replication stream: %w", pgconn.ErrorResponseToPgError(msg))
	case *pgproto3.CopyDone:
		return errors.New("server ended the replication stream")
	}
	return nil
}

// checkSilence is called when a read found nothing to read before its deadline. A dead path
// (a host or middlebox that drops packets and keeps the socket open) looks like this forever;
// an idle database does not, because the walsender answers every status update. Neither does
// a slow path bringing one huge message: bytes arriving are life, whole messages or not. Once
// the oldest unanswered update is older than the liveness bound, the reader looks at its
// walsender from its other connection: busy decoding, it waits another bound; anything else
// (gone, waiting on the relay's socket or for WAL, or no answer from the server within the
// look's own deadline) ends the session with errSilent.
func (rd *reader) checkSilence(gctx context.Context, now time.Time) error {
	if rd.frames.received != rd.heardBytes {
		rd.heardBytes = rd.frames.received
		rd.live.heard()
		return nil
	}
	dead, waited := rd.live.dead(now)
	if !dead {
		return nil
	}
	look, err := rd.walsenderBusy(gctx)
	if err == nil && look.busy {
		rd.live.waitedOn(now)
		if !rd.busy {
			rd.cfg.Logger.Info("the walsender is busy decoding (a large transaction?) and answers no status update meanwhile; waiting",
				"pid", rd.repl.PID(), "wait_event", look.waitEvent, "decoded_lsn", look.sentLSN, "silent_for", waited.Round(time.Millisecond))
		}
		rd.busy = true
		rd.m.walsenderBusy.Set(1)
		return nil
	}
	rd.m.errors.WithLabelValues("liveness").Inc()
	why := look.String()
	if err != nil {
		why = err.Error()
	}
	return fmt.Errorf("%w: no answer from the walsender for %s (bound %s), and it is not busy decoding (%s); reconnecting",
		errSilent, waited.Round(time.Millisecond), rd.live.bound, why)
}

// walsenderLook is what the session's other connection saw of its walsender.
type walsenderLook struct {
	found               bool
	busy                bool
	state               string
	waitType, waitEvent string
	sentLSN             string
}

func (l walsenderLook) String() string {
	if !l.found {
		return "its backend is gone"
	}
	return fmt.Sprintf("state %q, wait event %q/%q", l.state, l.waitType, l.waitEvent)
}

// walsenderLookTimeout bounds the look at the walsender: a path that lost the replication
// connection's packets may well lose the other connection's too.
const walsenderLookTimeout = 5 * time.Second

// walsenderBusy looks at the session's walsender (the replication connection's backend) in
// pg_stat_activity, which shows every column of a role's own sessions to that role. It is
// busy when it works on something of its own: on the CPU (no wait event), reading WAL or
// spilled changes, or waiting on a lock. It is not when it waits on the relay's socket (wait
// type Client: a path that stopped carrying its bytes) or sits in its main loop or waiting for
// WAL, where it would have read and answered the status updates.
func (rd *reader) walsenderBusy(gctx context.Context) (walsenderLook, error) {
	var look walsenderLook
	if rd.side == nil {
		return look, errors.New("no connection to look at the walsender from")
	}
	ctx, cancel := context.WithTimeout(gctx, walsenderLookTimeout)
	defer cancel()
	var state, waitType, waitEvent, sent *string
	err := rd.side.QueryRow(ctx, `SELECT a.state, a.wait_event_type, a.wait_event, r.sent_lsn::text
		FROM pg_stat_activity a LEFT JOIN pg_stat_replication r ON r.pid = a.pid
		WHERE a.pid = $1`, rd.repl.PID()).Scan(&state, &waitType, &waitEvent, &sent)
	if errors.Is(err, pgx.ErrNoRows) {
		return look, nil
	}
	if err != nil {
		rd.m.errors.WithLabelValues("postgres").Inc()
		return look, fmt.Errorf("look at the walsender (pid %d): %w", rd.repl.PID(), err)
	}
	deref := func(s *string) string {
		if s == nil {
			return ""
		}
		return *s
	}
	look = walsenderLook{found: true, state: deref(state), waitType: deref(waitType), waitEvent: deref(waitEvent), sentLSN: deref(sent)}
	switch {
	case state == nil:
		// Another role's session: its state is not shown (no pg_read_all_stats).
	case look.waitType == "Client", look.waitEvent == "WalSenderMain", look.waitEvent == "WalSenderWaitForWAL":
	default:
		look.busy = true
	}
	return look, nil
}

// handleCopyData parses one CopyData message and hands its item to the pipeline. A keepalive
// also updates the slot lag and, when the server asks, is answered with a status update.
func (rd *reader) handleCopyData(ctx, gctx context.Context, data []byte) error {
	rd.live.heard()
	rd.heardBytes = rd.frames.received
	if rd.busy {
		rd.busy = false
		rd.m.walsenderBusy.Set(0)
	}
	rd.copies++
	var cd copyData
	var err error
	if size, cut := rd.frames.takeCut(rd.copies, data); cut {
		cd, err = rd.dec.parseCutCopyData(data, size, rd.cfg.MaxChangeBytes)
	} else {
		cd, err = rd.dec.parseCopyData(data)
	}
	if err != nil {
		rd.m.errors.WithLabelValues("decode").Inc() // a change, or a keepalive or XLogData frame
		return err
	}
	switch it := cd.it; it.kind {
	case itemNone:
		return nil
	case itemKeepalive:
		switch {
		case rd.answersDue > 0:
			rd.answersDue--
			it.answer = true
		case cd.replyRequested:
			// The walsender's own ping (nothing heard from the relay for half of
			// wal_sender_timeout): sent caught up or not, so no sign of either.
			it.answer = true
		case it.lsn < rd.backlogEnd:
			// Still in the backlog. The walsender pings once when it first reads WAL, before
			// it has read the relay's first status update (WalSndWaitForWal: its flush
			// position is not known yet); counted as that update's answer, it leaves the
			// real answer, which comes once the walsender reads its socket, to pass for
			// "caught up" in the middle of a catch-up (seen 1 run in 4 of
			// TestAdvModeStatusReplyEndsBatchesMidCatchUp).
			it.answer = true
		}
		if c := rd.confirmed.Load(); uint64(it.lsn) > c {
			rd.m.slotLagBytes.Set(float64(uint64(it.lsn) - c))
		}
		// The walsender has sent what it had, and the keepalive's WAL end may be confirmed:
		// what the replay check holds goes first.
		if ok, err := rd.decideReplay(ctx, gctx); !ok || err != nil {
			return err
		}
		if err := rd.put(ctx, gctx, it); err != nil {
			return err
		}
		if cd.replyRequested {
			return rd.sendStatus(gctx)
		}
		return nil
	default:
		switch {
		case it.kind == itemBegin:
			rd.frames.committed = it.commitTime // how far behind the next reads are (see bulkPause)
			rd.txLSN = []string{it.lsn.String()}
		case it.kind == itemEvent && it.msg != nil:
			if it.msg.Header == nil {
				it.msg.Header = nats.Header{}
			}
			it.msg.Header[wire.HeaderCommitLSN] = rd.txLSN
		}
		if it.deadLetter != "" {
			logSetAside(rd.cfg.Logger, it, "lsn", cd.at)
		}
		return rd.route(ctx, gctx, it)
	}
}

// route hands it to the pipeline, or to the replay check while it checks the replay (see
// replay.go).
func (rd *reader) route(ctx, gctx context.Context, it item) error {
	c := rd.replay
	switch {
	case c == nil:
		return rd.put(ctx, gctx, it)
	case !c.covers(it):
		if ok, err := rd.decideReplay(ctx, gctx); !ok || err != nil {
			return err
		}
		rd.replay = nil
		rd.cfg.Logger.Info("replay checked against the streams", "through", c.to, "skipped", c.skipped)
		return rd.put(ctx, gctx, it)
	case c.hold(it):
		_, err := rd.decideReplay(ctx, gctx)
		return err
	}
	return nil
}

// decideReplay decides on the items the replay check holds and hands those to publish to the
// pipeline, in order. It reports false when ctx ended first: the items not handed over are of
// transactions not confirmed, which the next session replays, and the caller hands over
// nothing after them (a later keepalive would confirm past them).
//
// The lookups go to NATS on a goroutine of their own while the reader keeps sending status
// updates: a stalled NATS connection must not silence the replication stream. A lookup left
// behind ends with its context (or when nats.go gives up the write it waits behind).
func (rd *reader) decideReplay(ctx, gctx context.Context) (bool, error) {
	c := rd.replay
	if c == nil || len(c.held) == 0 {
		return true, nil
	}
	dctx, cancel := context.WithTimeout(gctx, rd.cfg.SetupTimeout)
	defer cancel()
	held, start, wants := c.take()
	if len(wants) > 0 {
		type result struct {
			looked []lookup
			err    error
		}
		done := make(chan result, 1)
		go func(wants []lookup) {
			looked, err := c.lookUp(dctx, wants)
			done <- result{looked, err}
		}(wants)
		for waiting := true; waiting; {
			wait := time.NewTimer(time.Until(rd.nextStatus))
			select {
			case res := <-done:
				wait.Stop()
				if res.err != nil {
					rd.m.errors.WithLabelValues("nats").Inc()
					return false, res.err
				}
				wants, waiting = res.looked, false
			case <-wait.C:
				if err := rd.statusDue(gctx); err != nil {
					return false, err
				}
			case <-ctx.Done():
				wait.Stop()
				return false, nil
			case <-dctx.Done():
				wait.Stop()
				rd.m.errors.WithLabelValues("nats").Inc()
				return false, fmt.Errorf("replay check: %w", dctx.Err())
			}
		}
	}
	items, err := c.decide(dctx, held, start, wants)
	if err != nil {
		rd.m.errors.WithLabelValues("postgres").Inc()
		return false, err
	}
	for _, it := range items {
		if ctx.Err() != nil {
			return false, nil
		}
		if err := rd.put(ctx, gctx, it); err != nil {
			return false, err
		}
	}
	return ctx.Err() == nil, nil
}

// put hands one item to the pipeline, which publishes an event at once. While the pipeline is
// full (MaxInFlight events or MaxInFlightBytes outstanding) it waits, keeping status updates
// flowing. It returns errStopped when the pipeline failed or stopped: the pipeline's error is
// the session's. When ctx ends it returns nil without adding it: an item not added is of a
// transaction that is not confirmed, so it is replayed.
func (rd *reader) put(ctx, gctx context.Context, it item) error {
	for {
		ok, err := rd.p.add(it)
		if ok || err != nil {
			return err
		}
		rd.p.flushOut()
		wait := time.NewTimer(time.Until(rd.nextStatus))
		select {
		case <-rd.p.room:
		case <-rd.p.failed: // add says so
		case <-gctx.Done():
			wait.Stop()
			return errStopped
		case <-ctx.Done():
			wait.Stop()
			return nil // run drains at its next turn
		case <-wait.C:
			if err := rd.statusDue(gctx); err != nil {
				wait.Stop()
				return err
			}
		}
		wait.Stop()
	}
}

// statusDue sends a status update when one is due, and moves the read deadline to the next
// status time.
func (rd *reader) statusDue(ctx context.Context) error {
	if time.Now().Before(rd.nextStatus) {
		return nil
	}
	rd.nextStatus = time.Now().Add(rd.cfg.StatusInterval)
	if err := rd.conn.SetReadDeadline(rd.nextStatus); err != nil {
		return fmt.Errorf("set read deadline: %w", err)
	}
	return rd.sendStatus(ctx)
}

// sendStatus reports the confirmed LSN to Postgres. Write, flush and apply are all set
// explicitly: pglogrepl copies the write position into zero fields, and the flush position is
// what the server treats as confirmed. Every update asks for a reply, the walsender's
// keepalive, which proves the stream alive (see liveness).
func (rd *reader) sendStatus(ctx context.Context) error {
	rd.p.flushOut() // the write may block: queued events go to the sender first
	lsn := pglogrepl.LSN(rd.confirmed.Load())
	now := time.Now()
	err := pglogrepl.SendStandbyStatusUpdate(ctx, rd.repl, pglogrepl.StandbyStatusUpdate{
		WALWritePosition: lsn, WALFlushPosition: lsn, WALApplyPosition: lsn, ClientTime: now,
		ReplyRequested: true,
	})
	if err != nil {
		return fmt.Errorf("send standby status at %s: %w", lsn, err)
	}
	rd.live.requested(now)
	rd.answersDue++
	return nil
}

// stoppedIsNil returns nil for errStopped: the reader stops because the pipeline did, whose
// error is the session's.
func stoppedIsNil(err error) error {
	if errors.Is(err, errStopped) {
		return nil
	}
	return err
}
