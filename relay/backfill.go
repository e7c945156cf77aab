package relay

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"sync/atomic"
	"time"

	"github.com/jackc/pglogrepl"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgtype"
	"golang.org/x/sync/errgroup"

	"github.com/batonhq/baton/migrations"
	"github.com/batonhq/baton/wire"
)

// scanOutboxText scans a row of the backfill's query (id, then conversation_id, message_id,
// status, attempts and created_at as text). NULL is "", as the stream decoder reads it.
func scanOutboxText(rows pgx.Rows) (int64, *outboxText, error) {
	var id int64
	var conv, msgID, status, attempts, created pgtype.Text
	if err := rows.Scan(&id, &conv, &msgID, &status, &attempts, &created); err != nil {
		return 0, nil, err
	}
	return id, &outboxText{ID: strconv.FormatInt(id, 10), ConversationID: conv.String, MessageID: msgID.String,
		Status: status.String, Attempts: attempts.String, CreatedAt: created.String}, nil
}

// backfillItem returns the item of an unfinished outbox row that the first-start backfill read
// from table (schema.agent_outbox), given in the text the relay's sessions print, as the stream
// sends it: its turn event or, when the row cannot become one, the dead-letter record of the
// row, published in its place.
//
// No poison loop in the backfill either: a row no retry can publish (see outboxText.turn) is
// set aside as the stream sets aside the same row, and the backfill carries on. Failing on it
// instead would end every session at the same row and the relay would never stream. The record
// has no WAL position (LSN 0/0), carries the row's columns as JSON in Raw, and its Nats-Msg-Id
// is wire.DeadLetterBackfillMsgID of the row: one per row, deduplicated when a backfill runs again.
// The row stays in Postgres with its status, for the workers' sweep.
func backfillItem(prefix, table string, maxPayload int, id int64, row *outboxText) item {
	msg, err := row.turn(prefix, maxPayload)
	if err == nil {
		return item{kind: itemEvent, msg: msg}
	}
	raw, merr := json.Marshal(row)
	if merr != nil { // a struct of strings: cannot happen
		panic(fmt.Sprintf("marshal outbox row: %v", merr))
	}
	reason := err.Error()
	return item{
		kind:       itemEvent,
		msg:        deadLetterMsgWithID(prefix, wire.DeadLetterBackfillMsgID(id), wire.DeadLetterTurn, table, reason, 0, raw, maxPayload),
		deadLetter: wire.DeadLetterTurn,
		reason:     reason,
	}
}

// createSlotCommand is the replication command that creates slot, a logical slot of pgoutput
// exporting its snapshot (for the backfill). On PostgreSQL 17 and newer the slot is also a
// failover slot: standbys with sync_replication_slots = on keep a copy of it in step, so a
// promoted standby still has it (the primary's synchronized_standby_slots makes sure no standby
// it names lags the slot). Older servers have no failover slots: a failover loses the slot, and
// the relay's next start creates it again and backfills from the outbox rows (ErrSlotLost).
// slot is a validated slot name (lowercase letters, digits and _), written as it is.
func createSlotCommand(slot string, serverMajor int) string {
	if serverMajor >= 17 {
		return "CREATE_REPLICATION_SLOT " + slot + " LOGICAL pgoutput (SNAPSHOT 'export', FAILOVER true)"
	}
	return "CREATE_REPLICATION_SLOT " + slot + " LOGICAL pgoutput EXPORT_SNAPSHOT"
}

// serverMajor returns the major version in a server_version parameter ("15.19 (Debian …)",
// "17beta1"), or 0 when it does not start with one.
func serverMajor(version string) int {
	end := 0
	for end < len(version) && version[end] >= '0' && version[end] <= '9' {
		end++
	}
	major, err := strconv.Atoi(version[:end])
	if err != nil {
		return 0
	}
	return major
}

// createAndBackfill creates the slot and publishes, from the snapshot the slot exported, every
// outbox row that is pending or processing: the backlog of a team that polled before Baton.
// Streaming then starts at the slot's consistent point, so each row is published once: rows
// committed before it by the backfill, after it by the stream.
func (r *Relay) createAndBackfill(ctx context.Context, conn *pgx.Conn, repl *pgconn.PgConn, token string) error {
	cfg := &r.cfg
	// Recorded before the slot exists: a relay killed from here until the backfill is marked
	// done leaves a slot that the next start knows as Baton's own and recreates.
	if err := r.bounded(ctx, func(ctx context.Context) error {
		_, err := conn.Exec(ctx, `INSERT INTO baton_relay_slots (slot_name, consistent_point, backfill_rows, backfill_done)
		VALUES ($1, NULL, 0, false) ON CONFLICT (slot_name) DO UPDATE
		SET consistent_point = NULL, backfill_rows = 0, backfill_done = false, created_at = now()`, cfg.Slot)
		return err
	}); err != nil {
		return fmt.Errorf("record slot %s: %w", cfg.Slot, err)
	}
	var created pglogrepl.CreateReplicationSlotResult
	command := createSlotCommand(cfg.Slot, serverMajor(repl.ParameterStatus("server_version")))
	stopWatching := r.watchSlotCreate(ctx, conn, repl.PID())
	err := within(ctx, cfg.FirstStartTimeout, func(ctx context.Context) (err error) {
		created, err = pglogrepl.ParseCreateReplicationSlot(repl.Exec(ctx, command))
		return err
	})
	stopWatching()
	if err != nil {
		var pgErr *pgconn.PgError
		if errors.As(err, &pgErr) && pgErr.Code == "42710" { // duplicate_object: a relay of an earlier version made it
			return fmt.Errorf("%w: create slot %s: %w", errSlotBusy, cfg.Slot, err)
		}
		return fmt.Errorf("create slot %s (it waits for every transaction running now to end; FirstStartTimeout %s): %w",
			cfg.Slot, cfg.FirstStartTimeout, err)
	}
	point, err := pglogrepl.ParseLSN(created.ConsistentPoint)
	if err != nil {
		return fmt.Errorf("slot %s consistent point %q: %w", cfg.Slot, created.ConsistentPoint, err)
	}
	r.confirmed.Store(uint64(point))
	r.m.confirmedLSN.Set(float64(point))
	n, err := r.backfill(ctx, conn, created.SnapshotName)
	if err != nil {
		return fmt.Errorf("backfill: %w", err)
	}
	if err := r.backfillDone(ctx, conn, created.ConsistentPoint, n, token); err != nil {
		return err
	}
	cfg.Logger.Info("created slot and backfilled unfinished rows", "slot", cfg.Slot, "lsn", point, "rows", n)
	return nil
}

// Creating a slot waits for every transaction that holds a transaction id when it begins to end
// (the slot's snapshot must see them finished): a neighbour's transaction left open, for
// minutes or days, holds the first start back for as long. Nothing is wrong with the relay
// then, and nothing in its own log would say so: slotCreateWaitLog after the creation began,
// and every slotCreateWaitEvery after, it logs which backends the walsender waits for
// (pg_blocking_pids: their pid and role, and when their transaction began where the relay's
// role may see it) and sets baton_relay_slot_create_waiting. FirstStartTimeout still bounds
// the wait.
const (
	slotCreateWaitLog   = 2 * time.Second
	slotCreateWaitEvery = 30 * time.Second
)

// watchSlotCreate watches, from conn, the walsender pid creating the slot, until the returned
// function is called; that function returns once the watch ended. Stopping never interrupts a
// look in progress (at most 5s): pgx closes a connection whose query a context ended, and
// conn is the session's, which the backfill uses next.
func (r *Relay) watchSlotCreate(ctx context.Context, conn *pgx.Conn, pid uint32) func() {
	stop := make(chan struct{})
	done := make(chan struct{})
	look := context.WithoutCancel(ctx)
	go func() {
		defer close(done)
		defer r.m.slotCreateWaiting.Set(0)
		wait := time.NewTimer(slotCreateWaitLog)
		defer wait.Stop()
		for {
			select {
			case <-stop:
				return
			case <-ctx.Done():
				return
			case <-wait.C:
			}
			wait.Reset(slotCreateWaitEvery)
			blockers, err := slotCreateBlockers(look, conn, pid)
			if err != nil {
				r.cfg.Logger.Warn("creating the slot is taking long, and who it waits for could not be read", "slot", r.cfg.Slot, "error", err)
				continue
			}
			if len(blockers) == 0 {
				continue
			}
			r.m.slotCreateWaiting.Set(1)
			r.cfg.Logger.Warn("creating the slot waits for transactions that were running when it began to end "+
				"(another role's long transaction holds the relay's first start back; FirstStartTimeout bounds the wait)",
				"slot", r.cfg.Slot, "waiting_for", blockers)
		}
	}()
	return func() {
		close(stop)
		<-done
	}
}

// slotCreateBlockers describes the backends the walsender pid waits for.
func slotCreateBlockers(ctx context.Context, conn *pgx.Conn, pid uint32) ([]string, error) {
	ctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	rows, err := conn.Query(ctx, `SELECT b.pid, coalesce(b.usename::text, ''), coalesce(b.application_name, ''),
			coalesce(to_char(b.xact_start AT TIME ZONE 'UTC', 'YYYY-MM-DD"T"HH24:MI:SS"Z"'), 'not visible to this role')
		FROM unnest(pg_blocking_pids($1)) AS p(pid) JOIN pg_stat_activity b ON b.pid = p.pid ORDER BY b.pid`, int32(pid)) //nolint:gosec // G115: a backend pid fits an int32
	if err != nil {
		return nil, fmt.Errorf("read the backends the slot's creation waits for: %w", err)
	}
	var out []string
	for rows.Next() {
		var bpid int32
		var role, app, since string
		if err := rows.Scan(&bpid, &role, &app, &since); err != nil {
			return nil, err
		}
		out = append(out, fmt.Sprintf("pid %d (role %s, application %q, transaction since %s)", bpid, role, app, since))
	}
	return out, rows.Err()
}

// backfillAgain finishes the first start of a slot whose backfill did not finish (see
// decideSlot): it publishes every unfinished outbox row from a snapshot taken now and keeps
// the slot, which holds every change since its consistent point.
func (r *Relay) backfillAgain(ctx context.Context, conn *pgx.Conn, consistentPoint, token string) error {
	n, err := r.backfill(ctx, conn, "")
	if err != nil {
		return fmt.Errorf("backfill: %w", err)
	}
	if err := r.backfillDone(ctx, conn, consistentPoint, n, token); err != nil {
		return err
	}
	r.cfg.Logger.Info("backfilled unfinished rows", "slot", r.cfg.Slot, "lsn", consistentPoint, "rows", n)
	return nil
}

// backfillDone records that the first-start backfill of the slot finished with rows rows, if
// the first start is still claimed by token: a claimant paused past the claim's stale bound
// finds it another's, and leaves the slot to that one (errSlotBusy).
func (r *Relay) backfillDone(ctx context.Context, conn *pgx.Conn, consistentPoint string, rows int64, token string) error {
	var n int64
	if err := r.bounded(ctx, func(ctx context.Context) error {
		tag, err := conn.Exec(ctx, `UPDATE baton_relay_slots
			SET consistent_point = $2, backfill_rows = $3, backfill_done = true, starter_token = NULL, starter_pid = NULL, starter_seen = NULL
			WHERE slot_name = $1 AND starter_token = $4`,
			r.cfg.Slot, consistentPoint, rows, token)
		n = tag.RowsAffected()
		return err
	}); err != nil {
		return fmt.Errorf("record backfill of slot %s: %w", r.cfg.Slot, err)
	}
	if n == 0 {
		return fmt.Errorf("%w: the first start of slot %s was claimed by another relay while this one backfilled", errSlotBusy, r.cfg.Slot)
	}
	return nil
}

// backfill publishes, from snapshot ("": the transaction's own), every unfinished outbox row (see backfillPage) through a
// pipeline of its own whose synthetic transaction never closes, so it confirms no LSN, and
// returns how many rows it read.
func (r *Relay) backfill(ctx context.Context, conn *pgx.Conn, snapshot string) (int64, error) {
	cfg := &r.cfg
	var discard atomic.Uint64
	p := newPipeline(cfg, r.m, &discard, natsSender(cfg.NATS), r.batched)
	p.fence, p.atomic = r.fence, r.atomic
	var n int64
	g, gctx := errgroup.WithContext(ctx)
	g.Go(func() error { return p.run(gctx.Done(), nil, 0) })
	g.Go(func() error {
		defer p.closeInput()
		var tx pgx.Tx
		if err := r.bounded(gctx, func(ctx context.Context) (err error) {
			tx, err = conn.BeginTx(ctx, pgx.TxOptions{IsoLevel: pgx.RepeatableRead, AccessMode: pgx.ReadOnly})
			return err
		}); err != nil {
			return err
		}
		defer func() {
			ctx, cancel := context.WithTimeout(context.WithoutCancel(gctx), closeTimeout)
			defer cancel()
			_ = tx.Rollback(ctx)
		}()
		if err := r.bounded(gctx, func(ctx context.Context) error {
			if snapshot == "" {
				return nil // the transaction's own, taken at its first query
			}
			_, err := tx.Exec(ctx, "SET TRANSACTION SNAPSHOT "+quoteLiteral(snapshot))
			return err
		}); err != nil {
			return fmt.Errorf("import snapshot: %w", err)
		}
		// One synthetic transaction that never closes: backfilled events confirm no LSN.
		if err := p.feed(gctx, item{kind: itemBegin}); err != nil {
			return err
		}
		// Pages of BackfillBatch rows in id order, all from the same snapshot: the pipeline
		// publishes a page while the next one is read.
		var after int64
		for {
			var page []item
			var last int64
			if err := within(gctx, cfg.FirstStartTimeout, func(ctx context.Context) (err error) {
				page, last, err = r.backfillPage(ctx, tx, after)
				return err
			}); err != nil {
				return err
			}
			if err := p.feed(gctx, page...); err != nil {
				return err
			}
			n += int64(len(page))
			if len(page) < cfg.BackfillBatch {
				return nil
			}
			after = last
		}
	})
	if err := g.Wait(); err != nil {
		return n, err
	}
	return n, nil
}

// backfillPage reads up to BackfillBatch unfinished outbox rows with an id above after, in id
// order, as turn events (or, for a row that cannot become one, its dead-letter record: see
// backfillItem), and returns them with the last id read.
//
// Columns are read as text, which the relay's pinned session settings print as pgoutput does,
// and parsed by the stream's own parser: a value no event can carry ('infinity', a year past
// 9999) is never a scan error, and the backfill and the stream agree on every row.
func (r *Relay) backfillPage(ctx context.Context, tx pgx.Tx, after int64) ([]item, int64, error) {
	rows, err := tx.Query(ctx, `SELECT id, conversation_id, message_id, status, attempts::text, created_at::text
		FROM `+pgx.Identifier{r.cfg.Schema, tableOutbox}.Sanitize()+`
		WHERE status IN ('pending', 'processing') AND id > $1 AND `+r.shardCondition()+` ORDER BY id LIMIT $2`,
		after, r.cfg.BackfillBatch)
	if err != nil {
		return nil, 0, err
	}
	defer rows.Close()
	table := r.cfg.Schema + "." + tableOutbox
	maxPayload := r.eventPayload() // not nc.MaxPayload(): see streamsChecked
	var page []item
	var last int64
	for rows.Next() {
		id, row, err := scanOutboxText(rows)
		if err != nil {
			return nil, 0, err
		}
		it := backfillItem(r.cfg.SubjectPrefix, table, maxPayload, id, row)
		if it.deadLetter != "" {
			logSetAside(r.cfg.Logger, it, "outbox_id", id)
		}
		page = append(page, it)
		last = id
	}
	return page, last, rows.Err()
}

// shardCondition is the backfill's condition on the shard: the predicate of the shard's
// publication (migrations.ShardPredicate), so that a sharded relay's first start publishes
// exactly the rows its stream would have, and every unfinished row is backfilled by the one
// shard relay whose publication carries its conversation. TRUE when the relay is not sharded.
func (r *Relay) shardCondition() string {
	if r.cfg.Shards == 0 {
		return "TRUE"
	}
	return "(" + migrations.ShardPredicate(r.cfg.Shards, r.cfg.Shard) + ")"
}

// quoteLiteral quotes s as an SQL string literal (SET TRANSACTION SNAPSHOT takes no parameters).
func quoteLiteral(s string) string { return "'" + strings.ReplaceAll(s, "'", "''") + "'" }
