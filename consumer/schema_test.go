package consumer

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
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

	w, err := New(Config{Pool: db.Pool, Schema: "baton_custom", Handler: handler})
	require.NoError(t, err)
	err = w.Run(ctx)
	require.ErrorIs(t, err, ErrConfig)
	require.ErrorContains(t, err, `finds agent_outbox in schema "public", want schema "baton_custom"`)
	require.ErrorContains(t, err, "search_path")

}
