package relay_test

import (
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// Config.Schema holds the Baton tables (BATON_SCHEMA, default public): the decoder, the
// publication check, the backfill and the relay's own statements (baton_relay_slots) all
// use it. Before, the relay's statements named its tables without a schema and its setup
// failed with the tables elsewhere (or read same-named tables search_path found first).
func TestRelayRunsInTheConfiguredSchema(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := ctxT(t, time.Minute)
	_, err := b.db.Pool.Exec(ctx, `CREATE SCHEMA bt`)
	require.NoError(t, err)
	for _, stmt := range []string{"TABLE conversations", "TABLE messages", "TABLE agent_outbox", "TABLE operations",
		"TABLE agent_runs", "TABLE baton_relay_slots", "TABLE baton_schema_migrations", "FUNCTION baton_fence(boolean, text)",
		"FUNCTION baton_claim_order()"} {
		_, err := b.db.Pool.Exec(ctx, `ALTER `+stmt+` SET SCHEMA bt`)
		require.NoError(t, err)
	}
	b.db.ApplyRoles(t, "bt", "") // as an operator would: the relay's role needs the schema
	_, err = b.db.Pool.Exec(ctx, `INSERT INTO bt.conversations (id) VALUES ('c')`)
	require.NoError(t, err)
	var id int64
	require.NoError(t, b.db.Pool.QueryRow(ctx, `WITH m AS (INSERT INTO bt.messages (id, conversation_id, role, content)
			VALUES ('m1', 'c', 'user', 'x') RETURNING id, conversation_id)
		INSERT INTO bt.agent_outbox (conversation_id, message_id) SELECT conversation_id, id FROM m RETURNING id`).Scan(&id))
	b.cfg.Schema = "bt"
	r, done := b.run(t)
	require.Eventually(t, func() bool {
		select {
		case err := <-done:
			done <- err
			return true
		default:
			return r.Active()
		}
	}, 30*time.Second, 10*time.Millisecond)
	select {
	case err := <-done:
		done <- err // for the cleanup
		t.Fatalf("relay with Schema %q stopped: %v", b.cfg.Schema, err)
	default:
	}
	turns := b.waitStream(t, "AGENT_TURNS", 1, 30*time.Second)
	assertExactlyOnceInOrder(t, turns, map[int64]string{id: "c"})
}
