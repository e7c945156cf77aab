package badinput

import (
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgconn"
	"github.com/stretchr/testify/require"

	"github.com/batonhq/baton/wire"
)

// insertSQL is how an application without the producer writes a request: a message and its
// outbox row in one statement.
const insertSQL = `WITH m AS (INSERT INTO messages (id, conversation_id, role, content) VALUES ($1, $2, 'user', $3)
	RETURNING id, conversation_id)
	INSERT INTO agent_outbox (conversation_id, message_id) SELECT conversation_id, id FROM m`

// TestHandWrittenBadText writes requests by hand-written SQL, around the producer's checks.
// Postgres (a UTF8 database) refuses NUL bytes and invalid UTF-8 in text, whichever way they
// are written, with a clear SQLSTATE; the transaction holding the bad value commits nothing
// and nothing else is disturbed. Text Postgres accepts but that is hostile to JSON, headers
// and terminals (U+2028, C0 controls, escape sequences, a BOM, noncharacters, text that looks
// like JSON escapes) goes through end to end: turn events are valid JSON carrying the exact
// ids, headers carry the ids' header form, and the worker's echo and the outcome event
// carry the exact content.
func TestHandWrittenBadText(t *testing.T) {
	t.Parallel()
	s := start(t, options{watchTurns: true})
	ctx := ctxFor(t, 2*time.Minute)
	s.conversation("text")

	refused := []struct {
		name, sql string
		args      []any
		code      string
	}{
		{"NUL byte in a parameter", insertSQL, []any{"nul", "text", "a\x00b"}, "22021"},
		{"invalid UTF-8 in a parameter", insertSQL, []any{"bad-utf8", "text", "a\xffb"}, "22021"},
		{"invalid UTF-8 in a message id", insertSQL, []any{"id-\xc0\x80", "text", "fine"}, "22021"},
		{"NUL byte in a conversation id", insertSQL, []any{"nul-conv", "te\x00xt", "fine"}, "22021"},
		{"NUL escape in a literal", `INSERT INTO messages (id, conversation_id, role, content) VALUES ('lit-nul', 'text', 'user', E'a\000b')`, nil, "22021"},
		{"invalid UTF-8 escape in a literal", `INSERT INTO messages (id, conversation_id, role, content) VALUES ('lit-ff', 'text', 'user', E'a\xffb')`, nil, "22021"},
		{"chr(0)", `INSERT INTO messages (id, conversation_id, role, content) VALUES ('chr0', 'text', 'user', chr(0))`, nil, "54000"},
		{"\\u0000 from JSON", `INSERT INTO messages (id, conversation_id, role, content) VALUES ('json0', 'text', 'user', '"a\u0000b"'::jsonb #>> '{}')`, nil, "22P05"},
		{"lone surrogate", `INSERT INTO messages (id, conversation_id, role, content) VALUES ('lone', 'text', 'user', E'\uD800')`, nil, "42601"},
		{"invalid bytes converted", `INSERT INTO messages (id, conversation_id, role, content) VALUES ('conv', 'text', 'user', convert_from('\xff'::bytea, 'UTF8'))`, nil, "22021"},
	}
	for i, r := range refused {
		// In a transaction with a good request before it: nothing of it commits.
		tx, err := s.db.Pool.Begin(ctx)
		require.NoError(t, err)
		_, err = tx.Exec(ctx, insertSQL, fmt.Sprintf("before-%d", i), "text", "never committed")
		require.NoError(t, err)
		_, err = tx.Exec(ctx, r.sql, r.args...)
		var pgErr *pgconn.PgError
		require.True(t, errors.As(err, &pgErr), "%s: %v", r.name, err)
		require.Equal(t, r.code, pgErr.Code, "%s: %s", r.name, pgErr.Message)
		require.Error(t, tx.Commit(ctx), r.name)
		t.Logf("%s: SQLSTATE %s %s", r.name, pgErr.Code, pgErr.Message)
	}
	require.Zero(t, s.count(`SELECT count(*)::int FROM messages`), "nothing of a refused transaction committed")

	// Accepted, hostile text: as ids and as content, in a plain and in a hostile conversation.
	hostile := []string{
		"line\u2028sep\u2029par",
		"ctl\x01\x02\x1b[31mred\x1b[0m\x7f",
		`quote"back\slash</script><&>`,
		`looks like \u0000 and \ud800 escapes`,
		"\ufeffbom \u202eevil\u202c",
		"nonchar \uffff \U0010ffff",
		"tab\tcr\rnl\n",
		"emoji 🙂 combining e\u0301",
		"~" + "Zm9v",
		" spaced id ",
	}
	convs := []string{"text", "conv\u2028\x01\x1b[0m"}
	s.conversation(convs[1])
	want := map[string]string{} // message id → content
	for _, c := range convs {
		for i, h := range hostile {
			id := fmt.Sprintf("%s|%d|%s", c, i, h)
			content := fmt.Sprintf("%d:%s", i, h)
			_, err := s.db.Pool.Exec(ctx, insertSQL, id, c, content)
			require.NoError(t, err, "%q", id)
			want[id] = content
		}
	}
	// And one written with escapes in a literal, as someone at psql would.
	_, err := s.db.Pool.Exec(ctx, `WITH m AS (INSERT INTO messages (id, conversation_id, role, content)
		VALUES (E'psql\u2028\u0001', 'text', 'user', E'\u2028\u0001\u001f\u007f\uFFFF') RETURNING id, conversation_id)
		INSERT INTO agent_outbox (conversation_id, message_id) SELECT conversation_id, id FROM m`)
	require.NoError(t, err)
	want["psql\u2028\x01"] = "\u2028\x01\x1f\x7f\uffff"
	s.requireAllAnswered(time.Minute)

	// Each answered alone or with others of its conversation: every content is in the echo
	// of the turn that answered it, exactly.
	for id, content := range want {
		a := s.awaitAnswer(id, time.Minute)
		require.Equal(t, "done", a.status, "%q: %s", id, a.lastError)
		require.Contains(t, a.reply, content, "%q", id)
		ev, _ := s.awaitOutcome(a.replyID, time.Minute)
		require.Equal(t, a.reply, ev.Content, "outcome of %q carries the exact reply", id)
	}

	// Turn events: valid JSON with the exact ids, headers in header form (as published: the
	// work queue deleted them once acknowledged).
	turns := s.publishedTurns()
	require.Len(t, turns, len(want))
	for _, m := range turns {
		require.True(t, json.Valid(m.Data), "turn event is not valid JSON: %q", m.Data)
		var ev wire.TurnEvent
		require.NoError(t, json.Unmarshal(m.Data, &ev))
		_, ok := want[ev.MessageID]
		require.True(t, ok, "turn event carries message id %q, which was not sent", ev.MessageID)
		h, err := wire.ParseHeaderID(m.Header.Get(wire.HeaderMessageID))
		require.NoError(t, err)
		require.Equal(t, ev.MessageID, h)
		h, err = wire.ParseHeaderID(m.Header.Get(wire.HeaderConversationID))
		require.NoError(t, err)
		require.Equal(t, ev.ConversationID, h)
		for _, v := range m.Header {
			for _, s := range v {
				require.False(t, strings.ContainsAny(s, "\r\n\x00"), "header value %q", s)
			}
		}
	}
	for _, m := range s.readStream("AGENT_OUTCOMES") {
		require.True(t, json.Valid(m.Data), "outcome event is not valid JSON: %q", m.Data)
	}
	s.requireFlowing("bad-text")
	requireNoErrorLogs(t, s.relay, s.worker)
}
