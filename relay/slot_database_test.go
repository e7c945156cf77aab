package relay_test

import (
	"context"
	"net/url"
	"os"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/batonhq/baton/relay"
)

// runUntilActive runs r until it streams, then stops it and checks that Run returned nil.
func runUntilActive(t *testing.T, r *relay.Relay) { runActiveFor(t, r, 0) }

// runActiveFor runs r until it streams and for d more, then stops it gracefully and checks
// that Run returned nil.
func runActiveFor(t *testing.T, r *relay.Relay, d time.Duration) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	done := make(chan error, 1)
	go func() { done <- r.Run(ctx) }()
	deadline := time.After(time.Minute)
	for !r.Active() {
		select {
		case err := <-done:
			t.Fatalf("relay returned before streaming: %v", err)
		case <-deadline:
			t.Fatal("relay never became active")
		case <-time.After(5 * time.Millisecond):
		}
	}
	time.Sleep(d)
	cancel()
	select {
	case err := <-done:
		require.NoError(t, err)
	case <-time.After(30 * time.Second):
		t.Fatal("relay did not stop")
	}
}

// A URL without a database name connects to the database named like the role. The slot's
// database check must compare with the database actually connected to, or every start after
// the one that created the slot fails.
func TestURLWithoutDatabaseNameRestarts(t *testing.T) {
	t.Parallel()
	if os.Getenv("PGDATABASE") != "" {
		t.Fatal("PGDATABASE is set: unset it, this test connects without a database name")
	}
	b := setup(t)
	ctx := ctxT(t, 2*time.Minute)
	// A role named like the test database, so the server's default (database = user) applies.
	role := pgx.Identifier{b.db.Name}.Sanitize()
	_, err := b.db.Pool.Exec(ctx, "CREATE ROLE "+role+" LOGIN SUPERUSER")
	require.NoError(t, err)
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		_, err := b.db.Pool.Exec(ctx, "DROP ROLE IF EXISTS "+role)
		require.NoError(t, err)
	})
	u, err := url.Parse(b.db.URL)
	require.NoError(t, err)
	u.User = url.User(b.db.Name)
	u.Path = ""
	b.cfg.DatabaseURL = u.String()
	createConversations(t, b.db.Pool, "c")

	for i := range 3 { // the first start creates the slot; the others find it
		r, err := relay.New(b.cfg)
		require.NoError(t, err)
		runUntilActive(t, r)
		_, err = send(ctx, b.db.Pool, "c", "m"+string(rune('0'+i)))
		require.NoError(t, err)
	}
	r := b.start(t)
	require.Eventually(t, r.Active, time.Minute, 5*time.Millisecond)
	msgs := b.waitStream(t, "AGENT_TURNS", 3, 30*time.Second)
	assertExactlyOnceInOrder(t, msgs, truth(t, b.db.Pool))
}
