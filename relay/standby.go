package relay

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"log/slog"
	"sync/atomic"
	"time"

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
// baton_relay_slots (firstStartClaim): the claimant records a token of its own and renews the
// claim every claimRenew from a connection of its own; another relay leaves the first start to
// it while the claim was renewed within claimStale and the renewing backend lives. A claimant
// that died frees it at once (its backend ends with it), one whose host vanished or whose
// process is paused within claimStale; a backend that took a dead claimant's pid only makes
// the claim wait for claimStale. Only Baton's roles write the table.

// errSlotBusy ends a session attempt that found another relay streaming from the slot or
// running its first start: the relay stands by and tries again.
var errSlotBusy = errors.New("another relay holds the slot")

// firstStartClaim is a session's claim of its slot's first start, renewed on a connection of
// its own until released.
type firstStartClaim struct {
	slot  string
	token string
	conn  *pgx.Conn
	stale time.Duration

	cancel context.CancelFunc
	done   chan struct{}
	lost   atomic.Bool // a renewal found the claim another's, or failed
}

// claimStale is how long a first-start claim lasts without renewal, claimRenew how often its
// claimant renews it: both follow SetupTimeout, which bounds each renewal.
func claimStale(setup time.Duration) time.Duration { return 2 * setup }
func claimRenew(setup time.Duration) time.Duration { return setup / 4 }

// claimFirstStart claims the first start of the slot on a new connection made like conn. It
// returns nil and no error when another relay holds the claim. The claim is renewed until
// release; lost (renewal found another claimant, or failed) it cancels the context returned,
// under which the first start runs.
func (r *Relay) claimFirstStart(ctx context.Context, conn *pgx.Conn) (*firstStartClaim, context.Context, error) {
	cfg := &r.cfg
	var token [16]byte
	if _, err := rand.Read(token[:]); err != nil {
		return nil, nil, fmt.Errorf("claim token: %w", err)
	}
	c := &firstStartClaim{slot: cfg.Slot, token: hex.EncodeToString(token[:]), stale: claimStale(cfg.SetupTimeout)}
	if err := r.bounded(ctx, func(ctx context.Context) (err error) {
		c.conn, err = pgx.ConnectConfig(ctx, conn.Config())
		return err
	}); err != nil {
		r.m.errors.WithLabelValues("postgres").Inc()
		return nil, nil, connectError(err)
	}
	var claimed bool
	err := r.bounded(ctx, func(ctx context.Context) (err error) {
		claimed, err = c.claim(ctx)
		return err
	})
	if err != nil || !claimed {
		closeConn(ctx, c.conn.PgConn())
		return nil, nil, err
	}
	fctx, cancel := context.WithCancel(ctx)
	c.cancel, c.done = cancel, make(chan struct{})
	go c.renew(fctx, cfg.SetupTimeout, cfg.Logger)
	return c, fctx, nil
}

// claim takes the claim when it is free: no row yet, a finished backfill (the slot is gone and
// a new first start begins), no claimant, this claim's own, or a claimant that did not renew
// within the stale bound or whose renewing backend is gone.
func (c *firstStartClaim) claim(ctx context.Context) (bool, error) {
	var claimed bool
	err := c.conn.QueryRow(ctx, `INSERT INTO baton_relay_slots AS s
			(slot_name, consistent_point, backfill_rows, backfill_done, starter_token, starter_pid, starter_seen)
		VALUES ($1, NULL, 0, false, $2, pg_backend_pid(), now())
		ON CONFLICT (slot_name) DO UPDATE
		SET backfill_done = false, starter_token = excluded.starter_token, starter_pid = excluded.starter_pid,
			starter_seen = excluded.starter_seen
		WHERE s.backfill_done OR s.starter_token IS NULL OR s.starter_token = excluded.starter_token
			OR s.starter_seen < now() - $3::interval
			OR NOT EXISTS (SELECT 1 FROM pg_stat_activity a WHERE a.pid = s.starter_pid)
		RETURNING true`, c.slot, c.token, c.stale.String()).Scan(&claimed)
	if errors.Is(err, pgx.ErrNoRows) {
		return false, nil
	}
	if err != nil {
		return false, fmt.Errorf("claim the first start of slot %s: %w", c.slot, err)
	}
	return claimed, nil
}

// renew renews the claim every claimRenew until ctx ends; a renewal that finds the claim
// another's, or fails, cancels the first start.
func (c *firstStartClaim) renew(ctx context.Context, setup time.Duration, log *slog.Logger) {
	defer close(c.done)
	t := time.NewTicker(claimRenew(setup))
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		var n int64
		err := within(context.WithoutCancel(ctx), setup, func(ctx context.Context) error {
			tag, err := c.conn.Exec(ctx, `UPDATE baton_relay_slots SET starter_seen = now()
				WHERE slot_name = $1 AND starter_token = $2`, c.slot, c.token)
			n = tag.RowsAffected()
			return err
		})
		if err != nil || n == 0 {
			log.Warn("lost the claim of the slot's first start; ending the session", "slot", c.slot, "error", err)
			c.lost.Store(true)
			c.cancel()
			return
		}
	}
}

// release stops renewing and closes the claim's connection. The claim itself stays in the
// row: a finished backfill frees it, and so do its stale bound and its connection's end.
func (c *firstStartClaim) release(ctx context.Context) {
	c.cancel()
	<-c.done
	closeConn(ctx, c.conn.PgConn())
}
