package relay

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"strconv"

	"github.com/jackc/pglogrepl"
	"github.com/jackc/pgx/v5"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"golang.org/x/sync/errgroup"

	"github.com/batonhq/baton/wire"
)

// The replay check: what an earlier session stored is not stored again, however long ago.
//
// A session replays from the slot's confirmed LSN. An earlier session may have stored events
// past it without confirming them: their PubAcks were lost in a frozen path, or it died (or
// lost Postgres) before its next status update. Within the duplicate window their Nats-Msg-Ids
// drop the copies; past it they would be stored again. So a session that streams from an
// existing slot checks its replay against the streams first, up to the WAL position the
// server had flushed when the session took the slot (to): no earlier session can have read,
// let alone published, anything beyond it, and past the fence (fence.go) none can publish
// anything any more.
//
// What makes a check per subject enough: every session stores a prefix of its events on each
// subject (an event is published after every earlier event of its subject has its PubAck, or
// in the same ordered batch, which stores no message after one it could not), so the events
// of a subject stored by all sessions are those up to the last one stored. Every event carries
// its transaction's commit LSN (wire.HeaderCommitLSN) and its Nats-Msg-Id: an event of the
// replay at or before the subject's last stored one (by commit LSN, then by Nats-Msg-Id within
// that transaction) is skipped. The turns stream deletes what the workers acknowledged, and
// they acknowledge a turn event only once its outbox row is finished (DESIGN invariant 8): a
// turn event after the last one still stored is published only while its outbox row is
// pending or processing. A finished row needs no turn event either way.
//
// The reader holds the replay's items in order and decides for up to replayBatch events at a
// time (one lookup per new subject, concurrently, and one query for the turn events' rows),
// and at once when the walsender has nothing more to send (a keepalive) or a read waits.
type replayCheck struct {
	to      pglogrepl.LSN // the end of the replay that is checked
	js      jetstream.JetStream
	streams [laneCount]string
	conn    *pgx.Conn // the session's connection: the reader's while it streams
	m       *metrics
	log     *slog.Logger

	last   map[string]*lastStored // by subject: nil for none, or not looked up yet
	held   []item                 // the replay's items not yet decided, in order
	events int                    // events among them
	bytes  int                    // their events' eventSize
	cur    pglogrepl.LSN          // the commit LSN of the transaction being held
	// start is the commit LSN of the transaction open when the first held item came: a
	// batch may start inside a transaction.
	start   pglogrepl.LSN
	skipped int // events skipped so far
}

// lastStored is the last event a subject's stream holds, as far as the replay is concerned.
type lastStored struct {
	lsn   pglogrepl.LSN // its commit LSN; 0 for none (or one without the header: the backfill's)
	msgID string
	// passed says the replay went past it: later events of its transaction are new.
	passed bool
}

// replayBatch and replayBytes bound the events the replay check holds before it decides: how
// many, and their bytes (an outcome may be as large as the server's max payload).
const (
	replayBatch = 512
	replayBytes = 16 << 20
)

// replayLookups bounds the concurrent lookups of subjects' last events.
const replayLookups = 16

// newReplayCheck returns the check of a session that replays from an existing slot up to to.
func (r *Relay) newReplayCheck(conn *pgx.Conn, to pglogrepl.LSN) (*replayCheck, error) {
	js, err := jetstream.New(r.cfg.NATS)
	if err != nil {
		return nil, fmt.Errorf("jetstream: %w", err)
	}
	return &replayCheck{to: to, js: js, conn: conn, m: r.m, log: r.cfg.Logger, streams: r.laneStreams(), last: map[string]*lastStored{}}, nil
}

// laneStreams returns the lanes' stream names.
func (r *Relay) laneStreams() [laneCount]string {
	return [laneCount]string{laneTurns: r.cfg.TurnsStream, laneOutcomes: r.cfg.OutcomesStream, laneDeadLetter: r.cfg.DeadLetterStream}
}

// covers reports whether it, which arrived while the check holds items, belongs to the checked
// replay: a transaction that begins past to, and everything after it, does not.
func (c *replayCheck) covers(it item) bool {
	return it.kind != itemBegin || it.lsn <= c.to
}

// hold keeps it for the next decision and reports whether a batch is full.
func (c *replayCheck) hold(it item) bool {
	if len(c.held) == 0 {
		c.start = c.cur
	}
	switch it.kind {
	case itemBegin:
		c.cur = it.lsn
	case itemEvent:
		c.events++
		c.bytes += eventSize(it.msg)
	}
	c.held = append(c.held, it)
	return c.events >= replayBatch || c.bytes >= replayBytes
}

// lookup is a subject whose last stored event the check reads, and what it found (nil: none).
type lookup struct {
	lane    int
	subject string
	found   *lastStored
}

// take returns the held items, holding nothing after, and the subjects of their events the
// check has not looked up yet (reserved: none is looked up twice).
func (c *replayCheck) take() ([]item, pglogrepl.LSN, []lookup) {
	held, start := c.held, c.start
	c.held, c.events, c.bytes = nil, 0, 0
	var wants []lookup
	for _, it := range held {
		if !checked(it) {
			continue
		}
		if _, ok := c.last[it.msg.Subject]; !ok {
			c.last[it.msg.Subject] = nil
			wants = append(wants, lookup{lane: laneOf(it.outcome, it.deadLetter), subject: it.msg.Subject})
		}
	}
	return held, start, wants
}

// checked reports whether the replay check decides on item it: turn events and outcomes. A
// dead-letter record's subject (<prefix>.deadletter.<kind>) is every shard's, so its last
// record says nothing of this slot's: records are published again, and their Nats-Msg-Ids
// (DeadLetterNthMsgID) drop copies within the duplicate window.
func checked(it item) bool {
	return it.kind == itemEvent && it.deadLetter == ""
}

// decide returns the items of held to publish, in order, without the events an earlier session
// stored (counted in baton_relay_replay_skipped_total), given the lookups of their new
// subjects. It reads the turn events' outbox rows on the session's connection.
func (c *replayCheck) decide(ctx context.Context, held []item, start pglogrepl.LSN, looked []lookup) ([]item, error) {
	for _, l := range looked {
		c.last[l.subject] = l.found
	}
	keep := make([]bool, len(held))
	lsn := start
	var rows []int64 // outbox ids of turn events to publish, whose rows are checked
	for i, it := range held {
		if it.kind == itemBegin {
			lsn = it.lsn
		}
		keep[i] = !checked(it) || !c.stored(it, lsn)
		if id, ok := turnRow(it); ok && keep[i] {
			rows = append(rows, id)
		}
	}
	open, err := c.unfinished(ctx, rows)
	if err != nil {
		return nil, err
	}
	out := held[:0]
	for i, it := range held {
		id, turn := turnRow(it)
		why := ReplaySkipStored
		if turn && keep[i] && !open[id] {
			keep[i], why = false, ReplaySkipFinished
		}
		if keep[i] {
			out = append(out, it)
			continue
		}
		c.skipped++
		c.m.replaySkipped.Inc()
		if turn {
			c.log.Debug(ReplaySkippedLog, "outbox_id", id, "why", why)
		}
	}
	return out, nil
}

// ReplaySkippedLog is the message of the debug log line the relay writes for each turn event
// its replay check does not publish, with the event's outbox_id and why: ReplaySkipStored (an
// earlier session stored it) or ReplaySkipFinished (its outbox row is finished, and no stored
// copy is left to find: the workers acknowledged it, or it was never stored and the row was
// claimed without it). The chaos run reads these lines (e2e/streams_test.go).
const ReplaySkippedLog = "replay: turn event not published"

// The reasons of ReplaySkippedLog.
const (
	ReplaySkipStored   = "stored"
	ReplaySkipFinished = "finished"
)

// turnRow returns the outbox id of a turn event (not a dead-letter record).
func turnRow(it item) (int64, bool) {
	if it.kind != itemEvent || laneOf(it.outcome, it.deadLetter) != laneTurns {
		return 0, false
	}
	id, err := strconv.ParseInt(it.msg.Header.Get(wire.HeaderOutboxID), 10, 64)
	return id, err == nil
}

// stored reports whether event it, of the transaction with commit LSN lsn, is at or before the
// last event its subject's stream holds.
func (c *replayCheck) stored(it item, lsn pglogrepl.LSN) bool {
	ls := c.last[it.msg.Subject]
	switch {
	case ls == nil || lsn > ls.lsn:
		return false
	case lsn < ls.lsn:
		return true
	case ls.passed:
		return false
	}
	// The last stored event's transaction: the events up to it are stored.
	if it.msg.Header.Get(nats.MsgIdHdr) == ls.msgID {
		ls.passed = true
	}
	return true
}

// lookUp reads the last event of each subject of wants from its stream, concurrently, and
// returns wants with what it found. It touches nothing the reader uses: the reader runs it on
// a goroutine of its own and keeps reporting to Postgres meanwhile (see reader.decideReplay).
func (c *replayCheck) lookUp(ctx context.Context, wants []lookup) ([]lookup, error) {
	var handles [laneCount]jetstream.Stream
	for _, w := range wants {
		if handles[w.lane] == nil {
			st, err := c.js.Stream(ctx, c.streams[w.lane])
			if err != nil {
				return nil, fmt.Errorf("replay check: look up stream %s: %w", c.streams[w.lane], goneAsNoResponders(err))
			}
			handles[w.lane] = st
		}
	}
	out := slices.Clone(wants)
	g, gctx := errgroup.WithContext(ctx)
	g.SetLimit(replayLookups)
	for i := range out {
		w := &out[i]
		g.Go(func() error {
			m, err := handles[w.lane].GetLastMsgForSubject(gctx, w.subject)
			if errors.Is(err, jetstream.ErrMsgNotFound) {
				return nil
			}
			if err != nil {
				return fmt.Errorf("replay check: last event on %s: %w", w.subject, err)
			}
			ls := &lastStored{msgID: m.Header.Get(nats.MsgIdHdr)}
			if v := m.Header.Get(wire.HeaderCommitLSN); v != "" {
				// One past the checked replay is no earlier session's of this slot: a message
				// anyone may have published, or one of another timeline. Nothing is skipped by
				// it (nor by one that does not parse).
				if ls.lsn, err = pglogrepl.ParseLSN(v); err != nil || ls.lsn > c.to {
					ls.lsn = 0
				}
			}
			w.found = ls
			return nil
		})
	}
	if err := g.Wait(); err != nil {
		return nil, err
	}
	return out, nil
}

// unfinished returns which of the outbox rows ids are pending or processing.
func (c *replayCheck) unfinished(ctx context.Context, ids []int64) (map[int64]bool, error) {
	open := make(map[int64]bool, len(ids))
	if len(ids) == 0 {
		return open, nil
	}
	rows, err := c.conn.Query(ctx, `SELECT id FROM agent_outbox WHERE id = ANY($1) AND status IN ('pending', 'processing')`, ids)
	if err != nil {
		return nil, fmt.Errorf("replay check: read the turn events' outbox rows: %w", err)
	}
	defer rows.Close()
	for rows.Next() {
		var id int64
		if err := rows.Scan(&id); err != nil {
			return nil, fmt.Errorf("replay check: read the turn events' outbox rows: %w", err)
		}
		open[id] = true
	}
	if err := rows.Err(); err != nil {
		return nil, fmt.Errorf("replay check: read the turn events' outbox rows: %w", err)
	}
	return open, nil
}
