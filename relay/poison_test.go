package relay_test

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"math/rand/v2"
	"testing"
	"time"

	"github.com/jackc/pglogrepl"
	"github.com/jackc/pgx/v5"
	"github.com/nats-io/nats.go"
	"github.com/stretchr/testify/require"

	"github.com/batonhq/baton/wire"
)

// The poison run: everything a database role can write that no retry can publish,
// thrown at `baton relay` running as its own process, followed by ordinary traffic. The relay
// must never exit, must set each poison change aside in the dead-letter stream with its kind,
// must survive a per-database DateStyle change and a killed walsender, and must publish every
// ordinary row exactly once in per-conversation order.
func TestPoisonRun(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := ctxT(t, 4*time.Minute)
	convs := conversationIDs(8)
	createConversations(t, b.db.Pool, convs...)

	// Migration 0005 refuses a non-finite created_at at write time, but a database can still
	// hold or receive one: rows written before 0005 (its constraints stay NOT VALID then), a
	// schema an operator created or altered by hand, a constraint dropped to load old data. To
	// make such a value arrive through the stream, this test's own database drops the checks.
	for _, table := range []string{"agent_outbox", "messages"} {
		_, err := b.db.Pool.Exec(ctx, "ALTER TABLE "+table+" DROP CONSTRAINT "+table+"_created_at_finite")
		require.NoError(t, err)
	}

	p := b.startProcess(t)
	p.awaitStreaming(t)
	walsender := activePID(ctx, t, b)
	var err error

	// wantDead is the dead-letter record expected of each poison change, by Nats-Msg-Id.
	type deadWant struct {
		kind, table string
		raw         []byte // the full change for answers; a fragment of it for rows
	}
	wantDead := map[string]deadWant{}
	emit := func(payload []byte) {
		t.Helper()
		var at string
		require.NoError(t, b.db.Pool.QueryRow(ctx, `SELECT pg_logical_emit_message(true, $1, $2::bytea)::text`,
			wire.AnswersPrefix, payload).Scan(&at))
		lsn, err := pglogrepl.ParseLSN(at)
		require.NoError(t, err)
		wantDead[wire.DeadLetterMsgID(lsn.String())] = deadWant{kind: wire.DeadLetterAnswers, raw: payload}
	}

	// 1. Malformed baton.answers messages: not JSON, JSON of the wrong shape, huge garbage.
	emit([]byte("x"))
	emit([]byte(`{"message_id":"r1","outbox_ids":"7"}`))
	emit([]byte(`[1,2,3]`))
	emit([]byte(`{"outbox_ids":[1,2]}`))
	garbage := make([]byte, 3<<20)
	rng := rand.NewChaCha8([32]byte{10})
	_, _ = rng.Read(garbage)
	emit(garbage)
	emit(bytes.Repeat([]byte("["), 1<<20))
	// One inside a transaction with a turn: the turn is published, the message set aside.
	tx, err := b.db.Pool.Begin(ctx)
	require.NoError(t, err)
	_, err = send(ctx, tx, convs[0], "with-bad-answers")
	require.NoError(t, err)
	var at string
	require.NoError(t, tx.QueryRow(ctx, `SELECT pg_logical_emit_message(true, $1, 'not json either')::text`,
		wire.AnswersPrefix).Scan(&at))
	require.NoError(t, tx.Commit(ctx))
	lsn, err := pglogrepl.ParseLSN(at)
	require.NoError(t, err)
	wantDead[wire.DeadLetterMsgID(lsn.String())] = deadWant{kind: wire.DeadLetterAnswers, raw: []byte("not json either")}

	// 2. An outcome answering 70,000 outbox rows.
	const n = 70_000
	ids := make([]int64, n)
	for i := range ids {
		ids[i] = 10_000_000 + int64(i)
	}
	answers, err := json.Marshal(map[string]any{"message_id": "r-huge", "outbox_ids": ids})
	require.NoError(t, err)
	tx, err = b.db.Pool.Begin(ctx)
	require.NoError(t, err)
	_, err = tx.Exec(ctx, `SELECT pg_logical_emit_message(true, $1, $2)`, wire.AnswersPrefix, string(answers))
	require.NoError(t, err)
	_, err = tx.Exec(ctx, `INSERT INTO messages (id, conversation_id, role, content) VALUES ('r-huge', $1, 'assistant', 'done')`, convs[1])
	require.NoError(t, err)
	require.NoError(t, tx.Commit(ctx))

	// 3. An outbox row and a reply whose created_at is 'infinity', between ordinary rows of
	// the same transaction.
	tx, err = b.db.Pool.Begin(ctx)
	require.NoError(t, err)
	_, err = send(ctx, tx, convs[2], "before-infinity")
	require.NoError(t, err)
	var infinite int64
	require.NoError(t, tx.QueryRow(ctx, `WITH m AS (INSERT INTO messages (id, conversation_id, role, content)
			VALUES ('u-infinity', $1, 'user', 'hello') RETURNING id, conversation_id)
		INSERT INTO agent_outbox (conversation_id, message_id, created_at)
		SELECT conversation_id, id, 'infinity' FROM m RETURNING id`, convs[2]).Scan(&infinite))
	wantDead["turn"] = deadWant{kind: wire.DeadLetterTurn, table: "public.agent_outbox", raw: []byte("infinity")}
	_, err = tx.Exec(ctx, `INSERT INTO messages (id, conversation_id, role, content, created_at)
		VALUES ('r-infinity', $1, 'assistant', 'never published', 'infinity')`, convs[2])
	require.NoError(t, err)
	wantDead["outcome"] = deadWant{kind: wire.DeadLetterOutcome, table: "public.messages", raw: []byte("r-infinity")}
	_, err = send(ctx, tx, convs[2], "after-infinity")
	require.NoError(t, err)
	require.NoError(t, tx.Commit(ctx))

	// 4. Per-database settings that change how every new session, the walsender's included,
	// prints timestamps and intervals.
	db := pgx.Identifier{b.db.Name}.Sanitize()
	for _, set := range []string{`SET datestyle = 'SQL, DMY'`, `SET intervalstyle = 'sql_standard'`, `SET timezone = 'Asia/Kathmandu'`} {
		_, err := b.db.Pool.Exec(ctx, "ALTER DATABASE "+db+" "+set)
		require.NoError(t, err)
	}

	// 5. The walsender is killed: the relay reconnects, in a session that gets the new settings.
	var killed bool
	require.NoError(t, b.db.Pool.QueryRow(ctx, `SELECT pg_terminate_backend($1)`, walsender).Scan(&killed))
	require.True(t, killed)
	require.Eventually(t, func() bool {
		var pid *int32
		err := b.db.Pool.QueryRow(ctx, `SELECT active_pid FROM pg_replication_slots WHERE slot_name = $1`, b.cfg.Slot).Scan(&pid)
		return err == nil && pid != nil && *pid != walsender
	}, time.Minute, 20*time.Millisecond, "the relay never streamed again after its walsender was killed")

	// 6. Ordinary traffic: 200 rows across the conversations, each committed after the last.
	for i := range 200 {
		_, err := send(ctx, b.db.Pool, convs[i%len(convs)], fmt.Sprintf("ordinary-%03d", i))
		require.NoError(t, err)
	}

	// Every ordinary row exactly once, in per-conversation order; not the infinite one.
	want := truth(t, b.db.Pool)
	delete(want, infinite)
	b.waitStream(t, "AGENT_TURNS", len(want), time.Minute)
	requireSlotCaughtUp(t, b)
	turns := b.readStream(t, "AGENT_TURNS")
	assertExactlyOnceInOrder(t, turns, want)
	// Published with the instant Postgres holds, whatever the database's DateStyle and TimeZone.
	created := map[int64]time.Time{}
	rows, err := b.db.Pool.Query(ctx, `SELECT id, created_at FROM agent_outbox WHERE isfinite(created_at)`)
	require.NoError(t, err)
	for rows.Next() {
		var id int64
		var at time.Time
		require.NoError(t, rows.Scan(&id, &at))
		created[id] = at
	}
	require.NoError(t, rows.Err())
	for _, m := range turns {
		var ev wire.TurnEvent
		require.NoError(t, json.Unmarshal(m.data, &ev))
		require.True(t, created[ev.OutboxID].Equal(ev.CreatedAt), "outbox %d created_at %s, want %s", ev.OutboxID, ev.CreatedAt, created[ev.OutboxID])
	}

	// The 70,000-id outcome once, within the max payload; the infinite reply not at all.
	outcomes := b.readStream(t, "AGENT_OUTCOMES")
	require.Len(t, outcomes, 1)
	var out wire.OutcomeEvent
	require.NoError(t, json.Unmarshal(outcomes[0].data, &out))
	require.Equal(t, "r-huge", out.MessageID)
	require.Equal(t, ids[:wire.MaxBodyOutboxIDs], out.OutboxIDs)
	require.Equal(t, n-wire.MaxBodyOutboxIDs, out.OutboxIDsOmitted)
	require.LessOrEqual(t, wireSize(outcomes[0].header, outcomes[0].data), int(b.nc.MaxPayload()))

	// One dead-letter record per poison change, with its kind.
	dead := b.readStream(t, "AGENT_DEADLETTER")
	require.Len(t, dead, len(wantDead), "one record per change set aside")
	for _, m := range dead {
		var rec deadLetterRecord
		require.NoError(t, json.Unmarshal(m.data, &rec))
		lsn, err := pglogrepl.ParseLSN(rec.LSN)
		require.NoError(t, err, "lsn %q", rec.LSN)
		msgID := m.header.Get(nats.MsgIdHdr)
		require.Equal(t, wire.DeadLetterMsgID(lsn.String()), msgID)
		require.Equal(t, "agent.deadletter."+rec.Kind, m.subject)
		require.NotEmpty(t, rec.Reason)
		require.LessOrEqual(t, wireSize(m.header, m.data), int(b.nc.MaxPayload()))
		w, ok := wantDead[msgID]
		if !ok { // rows: their LSN is known only to the relay
			w, ok = wantDead[rec.Kind]
			delete(wantDead, rec.Kind)
		} else {
			delete(wantDead, msgID)
		}
		require.True(t, ok, "unexpected dead-letter record %s of kind %s: %s", msgID, rec.Kind, rec.Reason)
		require.Equal(t, w.kind, rec.Kind, msgID)
		require.Equal(t, w.table, rec.Table, msgID)
		if w.kind == wire.DeadLetterAnswers {
			require.Equal(t, len(w.raw), rec.RawBytes, msgID)
			require.Equal(t, w.raw[:min(len(w.raw), len(rec.Raw))], rec.Raw, msgID)
			require.NotEmpty(t, rec.Raw, msgID)
		} else {
			require.Contains(t, string(rec.Raw), string(w.raw), msgID)
			require.Contains(t, rec.Reason, "created_at", msgID)
		}
	}
	require.Empty(t, wantDead, "changes set aside without a record")

	// The skipped row stays for the workers' sweep, and the relay never exited.
	var status string
	require.NoError(t, b.db.Pool.QueryRow(ctx, `SELECT status FROM agent_outbox WHERE id = $1`, infinite).Scan(&status))
	require.Equal(t, "pending", status)
	select {
	case <-p.exited:
		t.Fatalf("the relay process exited: %v", p.cmd.ProcessState)
	default:
	}
	require.NotEqual(t, walsender, activePID(ctx, t, b), "streaming from a new walsender")
}

// activePID returns the pid of the walsender streaming from the test's slot, waiting for one.
func activePID(ctx context.Context, t *testing.T, b *bundle) int32 {
	t.Helper()
	var pid *int32
	require.Eventually(t, func() bool {
		err := b.db.Pool.QueryRow(ctx, `SELECT active_pid FROM pg_replication_slots WHERE slot_name = $1`, b.cfg.Slot).Scan(&pid)
		return err == nil && pid != nil
	}, 30*time.Second, 20*time.Millisecond, "no walsender streams from slot %s", b.cfg.Slot)
	return *pid
}
