package consumer

import (
	"context"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/batonhq/baton/internal/testsvc"
)

// The worker's statements name Baton's tables without a schema, so Run refuses a pool whose
// search_path does not find them in Config.Schema, with an error that says what to set,
// instead of claiming from same-named tables elsewhere.
func TestRunRefusesAPoolThatDoesNotSearchItsSchema(t *testing.T) {
	t.Parallel()
	db, _ := storeFixture(t) // Baton's tables in public
	handler := func(context.Context, *Turn) (Reply, error) { return Reply{Content: "ok"}, nil }
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()

	w, err := New(Config{Pool: db.RolePool(t, testsvc.RoleWorker), Schema: "baton_custom", Handler: handler})
	require.NoError(t, err)
	err = w.Run(ctx)
	require.ErrorIs(t, err, ErrConfig)
	require.ErrorContains(t, err, `finds agent_outbox in schema "public", want schema "baton_custom"`)
	require.ErrorContains(t, err, "search_path")
}

// A worker stopped while it starts (a SIGTERM or SIGHUP right after the process came up,
// while Run still looks for Baton's tables) stops cleanly, as it does once running: Run
// returns nil, so the process exits 0. It returned "find Baton's tables: context canceled",
// and the echo agent exited 1 (TestSIGHUPStopsLikeSIGTERM, now and then).
func TestRunStoppedWhileStartingReturnsNil(t *testing.T) {
	t.Parallel()
	db, _ := storeFixture(t)
	handler := func(context.Context, *Turn) (Reply, error) { return Reply{Content: "ok"}, nil }
	w, err := New(Config{Pool: db.RolePool(t, testsvc.RoleWorker), Handler: handler})
	require.NoError(t, err)
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	require.NoError(t, w.Run(ctx))
}

// cancelAfterQuery is a pgx tracer that cancels a context once a query ended.
type cancelAfterQuery struct{ cancel context.CancelFunc }

func (c cancelAfterQuery) TraceQueryStart(ctx context.Context, _ *pgx.Conn, _ pgx.TraceQueryStartData) context.Context {
	return ctx
}

func (c cancelAfterQuery) TraceQueryEnd(context.Context, *pgx.Conn, pgx.TraceQueryEndData) {
	c.cancel()
}

// A stop that arrives just after Run found a configuration error does not hide the error (the
// process would exit 0 and say nothing): only the stop's own error is a clean stop. Found by
// an adversarial review of the change above; it returned nil.
func TestRunReportsAConfigErrorEvenWhenStoppedRightAfter(t *testing.T) {
	t.Parallel()
	db, _ := storeFixture(t)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	pcfg, err := pgxpool.ParseConfig(db.URL)
	require.NoError(t, err)
	pcfg.ConnConfig.Tracer = cancelAfterQuery{cancel: cancel} // the stop comes as the schema query ends
	pool, err := pgxpool.NewWithConfig(context.Background(), pcfg)
	require.NoError(t, err)
	t.Cleanup(pool.Close)
	handler := func(context.Context, *Turn) (Reply, error) { return Reply{Content: "ok"}, nil }
	w, err := New(Config{Pool: pool, Schema: "baton_custom", Handler: handler})
	require.NoError(t, err)
	require.ErrorIs(t, w.Run(ctx), ErrConfig)
}
