package relay_test

import (
	"encoding/json"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pglogrepl"
	"github.com/nats-io/nats.go"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"

	"github.com/batonhq/baton/wire"
)

// No poison loop in the first-start backfill: an unfinished outbox row that cannot become a
// turn event (a created_at no event can carry, a conversation id no subject can carry) is set
// aside in the dead-letter stream, like the same row arriving through the stream, and the
// backfill carries on with the other rows. Before, one such row failed the backfill on every
// retry: the relay never streamed. Times the stream's decoder cannot parse (a year past 9999,
// BC) are set aside too, so the backfill and the stream agree on what is publishable.
func TestBackfillDeadLettersRowsItCannotPublish(t *testing.T) {
	t.Parallel()
	b := setup(t)
	reg := prometheus.NewRegistry()
	b.cfg.Registerer = reg
	b.cfg.BackfillBatch = 3 // bad rows at the ends and in the middle of pages
	ctx := ctxT(t, 2*time.Minute)
	// A database migrated from before version 5 may hold non-finite times: migration 0005 then
	// leaves its constraint NOT VALID, enforced on new rows only. Rebuild that state here: drop
	// the constraint, write the old rows, add it back NOT VALID. Conversation ids that no
	// subject can carry need a schema without the length check (made by hand, or altered):
	// dropped here for the same time.
	for _, c := range []struct{ table, name string }{
		{"agent_outbox", "agent_outbox_created_at_finite"}, {"conversations", "conversations_id_check"},
	} {
		_, err := b.db.Pool.Exec(ctx, "ALTER TABLE "+c.table+" DROP CONSTRAINT "+c.name)
		require.NoError(t, err)
	}
	tooLong := strings.Repeat("x", 201)
	createConversations(t, b.db.Pool, "c", "d", tooLong, "")
	want := map[int64]string{}
	bad := map[int64]string{} // outbox id → what the reason mentions
	row := func(conv, created, mention string) {
		t.Helper()
		var id int64
		var at any // nil: now()
		if created != "" {
			at = created
		}
		msgID := fmt.Sprintf("old-%d", len(want)+len(bad))
		require.NoError(t, b.db.Pool.QueryRow(ctx, `WITH m AS (INSERT INTO messages (id, conversation_id, role, content)
				VALUES ($1, $2, 'user', 'hello') RETURNING id, conversation_id)
			INSERT INTO agent_outbox (conversation_id, message_id, created_at)
			SELECT conversation_id, id, coalesce($3::timestamptz, now()) FROM m RETURNING id`,
			msgID, conv, at).Scan(&id))
		if mention == "" {
			want[id] = conv
		} else {
			bad[id] = mention
		}
	}
	good := func(conv string) { row(conv, "", "") }
	good("c")
	row("c", "infinity", "created_at")
	good("d")
	good("c") // a page of 3 ends here
	row("d", "-infinity", "created_at")
	row("c", "10000-01-01 00:00:00+00", "created_at")
	row("d", "0044-03-15 12:00:00+00 BC", "created_at")
	good("d")
	row(tooLong, "", "conversation id")
	row("", "", "conversation id")
	good("c")
	row("c", "infinity", "created_at") // the last row read
	_, err := b.db.Pool.Exec(ctx, `UPDATE agent_outbox SET status = 'processing' WHERE id = (SELECT min(id) FROM agent_outbox WHERE NOT isfinite(created_at))`)
	require.NoError(t, err)
	for _, sql := range []string{
		`ALTER TABLE agent_outbox ADD CONSTRAINT agent_outbox_created_at_finite CHECK (isfinite(created_at)) NOT VALID`,
		`ALTER TABLE conversations ADD CONSTRAINT conversations_id_check CHECK (octet_length(id) BETWEEN 1 AND 200) NOT VALID`,
	} {
		_, err = b.db.Pool.Exec(ctx, sql)
		require.NoError(t, err)
	}

	r := b.start(t)
	require.Eventually(t, r.Active, 30*time.Second, 10*time.Millisecond, "the backfill never finished")
	after, err := send(ctx, b.db.Pool, "d", "streamed")
	require.NoError(t, err)
	want[after] = "d"

	b.waitStream(t, "AGENT_TURNS", len(want), 30*time.Second)
	requireSlotCaughtUp(t, b)
	turns := b.readStream(t, "AGENT_TURNS")
	assertExactlyOnceInOrder(t, turns, want)
	for _, m := range turns {
		var ev wire.TurnEvent
		require.NoError(t, json.Unmarshal(m.data, &ev), "every published created_at is RFC 3339: %s", m.data)
	}

	dead := b.readStream(t, "AGENT_DEADLETTER")
	require.Len(t, dead, len(bad), "one record per row set aside, none taken for a duplicate of another")
	for _, m := range dead {
		var rec deadLetterRecord
		require.NoError(t, json.Unmarshal(m.data, &rec))
		require.Equal(t, "agent.deadletter.turn", m.subject)
		require.Equal(t, wire.DeadLetterTurn, rec.Kind)
		require.Equal(t, "public.agent_outbox", rec.Table)
		require.Equal(t, pglogrepl.LSN(0).String(), rec.LSN, "a backfilled row has no WAL position")
		var raw struct {
			ID string `json:"id"`
		}
		require.NoError(t, json.Unmarshal(rec.Raw, &raw), "raw is the row's columns: %s", rec.Raw)
		var id int64
		_, err := fmt.Sscan(raw.ID, &id)
		require.NoError(t, err)
		mention, ok := bad[id]
		require.True(t, ok, "record for outbox %d, which is not a bad row (or has two records)", id)
		delete(bad, id)
		require.Contains(t, rec.Reason, mention)
		require.Equal(t, len(rec.Raw), rec.RawBytes)
		require.Equal(t, wire.DeadLetterBackfillMsgID(id), m.header.Get(nats.MsgIdHdr))
	}
	require.Empty(t, bad, "rows set aside without a record")
	require.Equal(t, float64(len(dead)), counter(t, reg, "baton_relay_deadletter_total", wire.DeadLetterTurn))

	var pending int
	require.NoError(t, b.db.Pool.QueryRow(ctx, `SELECT count(*) FROM agent_outbox WHERE status IN ('pending', 'processing')`).Scan(&pending))
	require.Equal(t, len(want)+len(dead), pending, "rows set aside stay for the workers' sweep")
}
