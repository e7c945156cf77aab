package relay_test

import (
	"encoding/json"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/batonhq/baton/wire"
)

// Per-database settings apply to every new session, replication ones included: a DateStyle of
// "SQL, DMY" makes pgoutput print "29/02/2024 23:59:58.123456 ..." instead of ISO, and an odd
// TimeZone moves the offset. The relay pins its own session settings, so what it publishes is
// the same instant whatever the database says.
func TestDatabaseDateStyleAndTimeZoneDoNotChangeWhatIsPublished(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := ctxT(t, 2*time.Minute)
	db := pgx.Identifier{b.db.Name}.Sanitize()
	for _, set := range []string{
		`SET datestyle = 'SQL, DMY'`,
		`SET timezone = 'Asia/Kathmandu'`, // +05:45
		`SET intervalstyle = 'sql_standard'`,
		`SET extra_float_digits = -15`,
	} {
		_, err := b.db.Pool.Exec(ctx, "ALTER DATABASE "+db+" "+set)
		require.NoError(t, err)
	}
	createConversations(t, b.db.Pool, "c")
	b.startActive(t)

	want := time.Date(2024, 2, 29, 23, 59, 58, 123456000, time.UTC)
	var outboxID int64
	require.NoError(t, b.db.Pool.QueryRow(ctx, `WITH m AS (INSERT INTO messages (id, conversation_id, role, content, created_at)
			VALUES ('u1', 'c', 'user', 'hello', $1) RETURNING id, conversation_id)
		INSERT INTO agent_outbox (conversation_id, message_id, created_at) SELECT conversation_id, id, $1 FROM m RETURNING id`,
		want).Scan(&outboxID))
	_, err := b.db.Pool.Exec(ctx, `INSERT INTO messages (id, conversation_id, role, content, created_at)
		VALUES ('r1', 'c', 'assistant', 'hi', $1)`, want.Add(time.Second))
	require.NoError(t, err)

	turns := b.waitStream(t, "AGENT_TURNS", 1, 30*time.Second)
	var turn wire.TurnEvent
	require.NoError(t, json.Unmarshal(turns[0].data, &turn))
	require.Equal(t, outboxID, turn.OutboxID)
	require.True(t, want.Equal(turn.CreatedAt), "turn created_at %s, want %s", turn.CreatedAt, want)
	require.Equal(t, time.UTC, turn.CreatedAt.Location())

	outcomes := b.waitStream(t, "AGENT_OUTCOMES", 1, 30*time.Second)
	var out wire.OutcomeEvent
	require.NoError(t, json.Unmarshal(outcomes[0].data, &out))
	require.True(t, want.Add(time.Second).Equal(out.CreatedAt), "outcome created_at %s, want %s", out.CreatedAt, want.Add(time.Second))
}
