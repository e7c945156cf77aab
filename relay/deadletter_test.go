package relay_test

import (
	"encoding/json"
	"fmt"
	"testing"
	"time"

	"github.com/jackc/pglogrepl"
	"github.com/jackc/pgx/v5"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"

	"github.com/batonhq/baton/wire"
)

// deadLetterRecord is the dead-letter record as README.md documents it, decoded independently
// of the relay's own type.
type deadLetterRecord struct {
	LSN      string `json:"lsn"`
	Kind     string `json:"kind"`
	Table    string `json:"table"`
	Reason   string `json:"reason"`
	Raw      []byte `json:"raw"` // base64 in JSON
	RawBytes int    `json:"raw_bytes"`
}

func walInsertLSN(t *testing.T, b *bundle) pglogrepl.LSN {
	t.Helper()
	var s string
	require.NoError(t, b.db.Pool.QueryRow(ctxT(t, 10*time.Second), `SELECT pg_current_wal_insert_lsn()::text`).Scan(&s))
	lsn, err := pglogrepl.ParseLSN(s)
	require.NoError(t, err)
	return lsn
}

// A baton.answers message any role can emit, malformed ('x') or valid JSON of the wrong shape,
// must not stop the relay: it is set aside in the dead-letter stream, counted, and the rest of
// its transaction (turns and the reply's outcome, without answered ids) is published, and the
// slot is confirmed past it.
func TestMalformedAnswersAreDeadLetteredAndSkipped(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct{ name, payload string }{
		{"not json", "x"},
		{"wrong shape", `{"message_id":"r1","outbox_ids":"7"}`},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			b := setup(t)
			reg := prometheus.NewRegistry()
			b.cfg.Registerer = reg
			ctx := ctxT(t, 2*time.Minute)
			createConversations(t, b.db.Pool, "c")
			b.startActive(t)
			id1, err := send(ctx, b.db.Pool, "c", "u1")
			require.NoError(t, err)

			before := walInsertLSN(t, b)
			tx, err := b.db.Pool.Begin(ctx)
			require.NoError(t, err)
			id2, err := send(ctx, tx, "c", "u2")
			require.NoError(t, err)
			var emitted string
			require.NoError(t, tx.QueryRow(ctx, `SELECT pg_logical_emit_message(true, $1, $2)::text`,
				wire.AnswersPrefix, tc.payload).Scan(&emitted))
			_, err = tx.Exec(ctx, `INSERT INTO messages (id, conversation_id, role, content) VALUES ('r1', 'c', 'assistant', 'hi')`)
			require.NoError(t, err)
			require.NoError(t, tx.Commit(ctx))
			id3, err := send(ctx, b.db.Pool, "c", "after")
			require.NoError(t, err)

			turns := b.waitStream(t, "AGENT_TURNS", 3, 30*time.Second)
			assertExactlyOnceInOrder(t, turns, map[int64]string{id1: "c", id2: "c", id3: "c"})
			outcomes := b.waitStream(t, "AGENT_OUTCOMES", 1, 30*time.Second)
			require.Len(t, outcomes, 1)
			var ev wire.OutcomeEvent
			require.NoError(t, json.Unmarshal(outcomes[0].data, &ev))
			require.Equal(t, "r1", ev.MessageID)
			require.Equal(t, "hi", ev.Content)
			require.Empty(t, ev.OutboxIDs, "a malformed answers message adds no ids")

			dead := b.waitStream(t, "AGENT_DEADLETTER", 1, 30*time.Second)
			require.Len(t, dead, 1)
			require.Equal(t, "agent.deadletter.answers", dead[0].subject)
			var rec deadLetterRecord
			require.NoError(t, json.Unmarshal(dead[0].data, &rec))
			require.Equal(t, "answers", rec.Kind)
			require.Empty(t, rec.Table)
			require.NotEmpty(t, rec.Reason)
			require.Equal(t, tc.payload, string(rec.Raw))
			require.Equal(t, len(tc.payload), rec.RawBytes)
			lsn, err := pglogrepl.ParseLSN(rec.LSN)
			require.NoError(t, err, "lsn %q", rec.LSN)
			at, err := pglogrepl.ParseLSN(emitted)
			require.NoError(t, err)
			require.Greater(t, lsn, before)
			require.Equal(t, at, lsn, "the record's LSN is the message's own")
			require.Equal(t, wire.DeadLetterMsgID(lsn.String()), dead[0].header.Get("Nats-Msg-Id"))

			requireSlotCaughtUp(t, b)
			require.Equal(t, 1.0, counter(t, reg, "baton_relay_deadletter_total", "answers"))
		})
	}
}

// An outbox row whose created_at the relay cannot represent (a year past 9999: finite, so the
// schema accepts it, but RFC 3339 has no form for it) is set aside in the dead-letter stream;
// the row stays pending for the workers' sweep, and the other rows of its transaction and
// after it are published.
func TestUnparseableOutboxRowIsDeadLetteredAndSkipped(t *testing.T) {
	t.Parallel()
	b := setup(t)
	reg := prometheus.NewRegistry()
	b.cfg.Registerer = reg
	ctx := ctxT(t, 2*time.Minute)
	createConversations(t, b.db.Pool, "c", "d")
	b.startActive(t)

	tx, err := b.db.Pool.Begin(ctx)
	require.NoError(t, err)
	id1, err := send(ctx, tx, "c", "u1")
	require.NoError(t, err)
	var bad int64
	require.NoError(t, tx.QueryRow(ctx, `WITH m AS (INSERT INTO messages (id, conversation_id, role, content)
			VALUES ('u-far', 'd', 'user', 'hello') RETURNING id, conversation_id)
		INSERT INTO agent_outbox (conversation_id, message_id, created_at)
		SELECT conversation_id, id, '10000-01-01 00:00:00+00' FROM m RETURNING id`).Scan(&bad))
	id2, err := send(ctx, tx, "d", "u2")
	require.NoError(t, err)
	require.NoError(t, tx.Commit(ctx))
	id3, err := send(ctx, b.db.Pool, "d", "after")
	require.NoError(t, err)

	turns := b.waitStream(t, "AGENT_TURNS", 3, 30*time.Second)
	assertExactlyOnceInOrder(t, turns, map[int64]string{id1: "c", id2: "d", id3: "d"})

	dead := b.waitStream(t, "AGENT_DEADLETTER", 1, 30*time.Second)
	require.Len(t, dead, 1)
	require.Equal(t, "agent.deadletter.turn", dead[0].subject)
	var rec deadLetterRecord
	require.NoError(t, json.Unmarshal(dead[0].data, &rec))
	require.Equal(t, "turn", rec.Kind)
	require.Equal(t, "public.agent_outbox", rec.Table)
	require.Contains(t, rec.Reason, "created_at")
	require.Contains(t, string(rec.Raw), "10000-01-01")
	require.Equal(t, len(rec.Raw), rec.RawBytes)
	_, err = pglogrepl.ParseLSN(rec.LSN)
	require.NoError(t, err)

	requireSlotCaughtUp(t, b)
	require.Equal(t, 1.0, counter(t, reg, "baton_relay_deadletter_total", "turn"))
	var status string
	require.NoError(t, b.db.Pool.QueryRow(ctx, `SELECT status FROM agent_outbox WHERE id = $1`, bad).Scan(&status))
	require.Equal(t, "pending", status, "the skipped row stays for the workers' sweep")
}

// COPY inserts rows with heap_multi_insert: every row of one multi-insert WAL record is decoded
// at the same LSN, and pgoutput gives each of them that LSN as its XLogData WALStart. Were
// dead-letter records named by the LSN alone, JetStream would keep the first record of two
// unpublishable rows of one COPY and drop the second as a duplicate: a change skipped without
// its record. Each change at a position gets its own id (wire.DeadLetterNthMsgID).
func TestDeadLetterRecordsOfOneCopyAreAllKept(t *testing.T) {
	t.Parallel()
	b := setup(t)
	reg := prometheus.NewRegistry()
	b.cfg.Registerer = reg
	ctx := ctxT(t, 2*time.Minute)
	createConversations(t, b.db.Pool, "c")
	b.startActive(t)

	_, err := b.db.Pool.Exec(ctx, `INSERT INTO messages (id, conversation_id, role, content)
		VALUES ('far1', 'c', 'user', 'x'), ('far2', 'c', 'user', 'x'), ('ok1', 'c', 'user', 'x')`)
	require.NoError(t, err)
	far := time.Date(10000, 1, 1, 0, 0, 0, 0, time.UTC) // finite, but no RFC 3339 form
	n, err := b.db.Pool.CopyFrom(ctx, pgx.Identifier{"agent_outbox"}, []string{"conversation_id", "message_id", "created_at"},
		pgx.CopyFromRows([][]any{{"c", "far1", far}, {"c", "far2", far}, {"c", "ok1", time.Now()}}))
	require.NoError(t, err)
	require.EqualValues(t, 3, n)
	_, err = send(ctx, b.db.Pool, "c", "after")
	require.NoError(t, err)

	b.waitStream(t, "AGENT_TURNS", 2, 30*time.Second) // ok1 and after
	requireSlotCaughtUp(t, b)
	require.Eventually(t, func() bool { return counter(t, reg, "baton_relay_deadletter_total", "turn") >= 2 }, 30*time.Second, 20*time.Millisecond)

	dead := b.readStream(t, "AGENT_DEADLETTER")
	var lsns []string
	for _, d := range dead {
		var rec deadLetterRecord
		require.NoError(t, json.Unmarshal(d.data, &rec))
		lsns = append(lsns, fmt.Sprintf("%s %s", rec.LSN, d.header.Get("Nats-Msg-Id")))
	}
	require.Len(t, lsns, 2, "two rows were set aside, each needs its record; stored: %v", lsns)
}
