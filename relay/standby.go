package relay

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
)

// lockHolder is what a standby sees of the session that holds the relay lock and of the slot.
type lockHolder struct {
	pid  int32 // the backend holding the relay lock; 0 when nobody holds it
	idle bool  // that backend is idle: not in a query, not in a transaction (a backfill is)
	// streaming: a walsender streams from the slot and its backend exists.
	streaming bool
}

// readLockHolder finds the backend holding the relay's advisory lock (a bigint key is stored in
// pg_locks as classid = high 32 bits, objid = low 32 bits, objsubid = 1) and whether the slot
// is streaming.
func readLockHolder(ctx context.Context, conn *pgx.Conn, slot string) (lockHolder, error) {
	var h lockHolder
	err := conn.QueryRow(ctx, `WITH k AS (SELECT hashtextextended('baton.relay.' || $1, 0) AS key)
		SELECT l.pid, coalesce(a.state = 'idle', false),
			coalesce((SELECT s.active AND EXISTS (SELECT 1 FROM pg_stat_activity w WHERE w.pid = s.active_pid)
				FROM pg_replication_slots s WHERE s.slot_name = $1), false)
		FROM k, pg_locks l LEFT JOIN pg_stat_activity a ON a.pid = l.pid
		WHERE l.locktype = 'advisory' AND l.granted AND l.objsubid = 1
			AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())
			AND l.classid = ((k.key >> 32) & 4294967295)::oid AND l.objid = (k.key & 4294967295)::oid`,
		slot).Scan(&h.pid, &h.idle, &h.streaming)
	if errors.Is(err, pgx.ErrNoRows) {
		return lockHolder{}, nil // released since pg_try_advisory_lock looked
	}
	if err != nil {
		return lockHolder{}, fmt.Errorf("read relay lock holder: %w", err)
	}
	return h, nil
}

// terminateHolder ends the backend holding the relay lock, waiting up to 5s for it to exit
// (pg_terminate_backend is allowed on backends of the same role). It reports whether the
// backend exited.
func terminateHolder(ctx context.Context, conn *pgx.Conn, pid int32) (bool, error) {
	var done bool
	if err := conn.QueryRow(ctx, `SELECT pg_terminate_backend($1, 5000)`, pid).Scan(&done); err != nil {
		return false, fmt.Errorf("terminate stale relay lock holder %d: %w", pid, err)
	}
	return done, nil
}

// staleLock decides, from what a standby sees at each poll, when the relay lock's holder is
// stale. The holder is suspect while it sits idle holding the lock and no walsender streams
// from the slot: a live active relay either streams or is busy (creating the slot, running the
// first-start backfill in a transaction), and one that lost its stream ends its session and
// releases the lock. The holder of a vanished host stays like that until the server's TCP
// keepalive notices, and for ever behind a middlebox that keeps the socket open; its walsender
// ends after wal_sender_timeout without replies. Once the holder has been suspect for longer
// than after, without a break, it is stale, and the standby terminates it.
type staleLock struct {
	after   time.Duration
	pid     int32     // the suspect holder
	suspect time.Time // since when; zero when the holder is not suspect
}

// observe records what a poll saw at now and reports whether the holder is stale.
func (s *staleLock) observe(now time.Time, h lockHolder) bool {
	if h.pid == 0 || h.streaming || !h.idle {
		s.pid, s.suspect = 0, time.Time{}
		return false
	}
	if h.pid != s.pid || s.suspect.IsZero() {
		s.pid, s.suspect = h.pid, now
	}
	return now.Sub(s.suspect) > s.after
}

// since returns how long the current holder has been suspect at now.
func (s *staleLock) since(now time.Time) time.Duration {
	if s.suspect.IsZero() {
		return 0
	}
	return now.Sub(s.suspect)
}
