package relay

import (
	"context"
	"errors"
	"fmt"

	"github.com/jackc/pgx/v5"
)

// Which relay streams: the slot decides.
//
// One relay per slot streams; the others stand by and poll. A logical slot streams to one
// walsender at a time (START_REPLICATION of an active slot fails with 55006), and only a role
// with REPLICATION can use it, which no neighbour of Baton's has. An advisory lock cannot
// decide: its key is computable by every role that can connect (and pg_locks shows every held
// key to everyone), so any role could take it and sit idle, and earlier versions stood by for
// ever then. A standby takes the slot once no walsender holds it, which Postgres ensures
// within wal_sender_timeout of the active relay going silent (a vanished host, a frozen path,
// a paused process): its walsender ends for want of replies.
//
// Until a slot streams, its first start runs (creating it and backfilling, or backfilling
// again after a first start that did not finish) with the slot inactive. That is claimed in
// baton_relay_slots: the claimant records its backend (pid and start time), and another relay
// leaves the first start to it while that backend lives (claimFirstStart). Only Baton's roles
// write the table.

// errSlotBusy ends a session attempt that found another relay streaming from the slot or
// running its first start: the relay stands by and tries again.
var errSlotBusy = errors.New("another relay holds the slot")

// claimFirstStart claims the first start of slot for the session's backend, recording its pid
// and start time in baton_relay_slots. It reports false when another backend that still lives
// has the claim (pg_stat_activity shows every backend's pid to every role, and its start time
// to its own role: a live pid of another role counts as the claimant). A claim is free when
// the slot's backfill is done (a new first start begins: the slot is gone) or its claimant's
// backend is gone.
func claimFirstStart(ctx context.Context, conn *pgx.Conn, slot string) (bool, error) {
	var claimed bool
	err := conn.QueryRow(ctx, `WITH me AS (SELECT pid, backend_start FROM pg_stat_activity WHERE pid = pg_backend_pid())
		INSERT INTO baton_relay_slots AS s (slot_name, consistent_point, backfill_rows, backfill_done, starter_pid, starter_started)
		SELECT $1, NULL, 0, false, me.pid, me.backend_start FROM me
		ON CONFLICT (slot_name) DO UPDATE
		SET backfill_done = false, starter_pid = excluded.starter_pid, starter_started = excluded.starter_started
		WHERE s.backfill_done OR s.starter_pid IS NULL OR s.starter_pid = excluded.starter_pid
			OR NOT EXISTS (SELECT 1 FROM pg_stat_activity a WHERE a.pid = s.starter_pid
				AND (a.backend_start IS NULL OR s.starter_started IS NULL OR a.backend_start = s.starter_started))
		RETURNING true`, slot).Scan(&claimed)
	if errors.Is(err, pgx.ErrNoRows) {
		return false, nil
	}
	if err != nil {
		return false, fmt.Errorf("claim the first start of slot %s: %w", slot, err)
	}
	return claimed, nil
}
