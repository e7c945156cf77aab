package relay

import (
	"context"
	"log/slog"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/nats-io/nats.go"
	"github.com/stretchr/testify/require"

	"github.com/batonhq/baton/internal/testsvc"
)

// watchSlotCreate looks at the walsender from the session's connection while the slot is
// created; the backfill uses that connection next. The slot's creation ends while a look is
// in progress (its reply held in the path): stopping the watch must leave the connection
// whole and unused by the watch (pgx.Conn is not safe for concurrent use; -race checks).
func TestAdvNeighbourWatchStoppedMidLookLeavesTheConnection(t *testing.T) {
	t.Parallel()
	db := testsvc.NewDatabase(t)
	ns := testsvc.StartNATS(t)
	nc, err := nats.Connect(ns.URL())
	require.NoError(t, err)
	t.Cleanup(nc.Close)
	r, err := New(Config{DatabaseURL: db.RoleURL(testsvc.RoleRelay), NATS: nc, Slot: db.Name, Logger: slog.New(slog.DiscardHandler)})
	require.NoError(t, err)

	proxy, proxiedURL := testsvc.ProxyPostgres(t, db.URL)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	conn, err := pgx.Connect(ctx, proxiedURL)
	require.NoError(t, err)
	t.Cleanup(func() { _ = conn.Close(context.Background()) })

	stop := r.watchSlotCreate(ctx, conn, uint32(conn.PgConn().PID()))
	time.Sleep(slotCreateWaitLog - 500*time.Millisecond)
	proxy.FreezeReplies() // the first look (at slotCreateWaitLog) waits for its reply
	time.Sleep(time.Second)
	go func() { time.Sleep(time.Second); proxy.Unfreeze() }()
	began := time.Now()
	stop() // the slot was created meanwhile
	t.Logf("stopping the watch took %s", time.Since(began).Round(time.Millisecond))
	var one int
	require.NoError(t, conn.QueryRow(ctx, `SELECT 1`).Scan(&one), "the session's connection after the watch stopped mid-look")
}
