package badinput

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgconn"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/stretchr/testify/require"

	"github.com/batonhq/baton/producer"
	"github.com/batonhq/baton/wire"
)

// natsSpecialIDs are conversation ids made of what NATS gives a meaning to in subjects
// (token separator, wildcards, whitespace, the $ of system subjects), unicode, and ids that
// look like subjects or like the encoded form; the longest is the schema's 200 bytes.
func natsSpecialIDs() []string {
	long := strings.Repeat(".*> $\t", 34)[:200]
	return []string{
		"a.b", "*", ">", "a b", " ", "\t", "tab\there", "new\nline", "$JS.API.STREAM.DELETE.AGENT_TURNS",
		"$SYS.>", "_INBOX.x", "agent.turns.other", "agent.outcomes.*", "a.*", "x>", "..", ".", "~YWJj", "YWJj",
		"🙂.🙃", "Grüße.*", "\u00a0nbsp", long, strings.Repeat("🙂", 50), "carriage\rreturn", "nul-free\x7fdel",
	}
}

// TestNATSSpecialConversationIDs sends a message to each conversation id of natsSpecialIDs:
// each turn is answered, the turn and outcome subjects of every conversation are exactly one
// token after <prefix>.<kind> (a `*` subscriber sees all of them, each conversation's filter only
// its own), headers carry the header form of the id, and the bodies carry the exact id. An id
// over 200 bytes (1,000 characters) is refused by the producer, and by the schema for
// hand-written SQL, before anything is written.
func TestNATSSpecialConversationIDs(t *testing.T) {
	t.Parallel()
	s := start(t, options{watchTurns: true})
	ctx := ctxFor(t, 2*time.Minute)
	ids := natsSpecialIDs()
	for i, c := range ids {
		s.conversation(c)
		s.send(c, fmt.Sprintf("m%02d", i), fmt.Sprintf("hello %d", i))
	}
	for i, c := range ids {
		a := s.awaitAnswer(fmt.Sprintf("m%02d", i), time.Minute)
		require.Equal(t, "done", a.status, "conversation %q: %s", c, a.lastError)
		require.Equal(t, fmt.Sprintf("echo: hello %d", i), a.reply, "conversation %q", c)
	}
	s.requireAllAnswered(time.Minute)

	// Every subject is <prefix>.<kind>.<one token> and decodes to its own conversation.
	// (Turn events as published: the work queue deleted them once acknowledged.)
	for _, kind := range []string{"AGENT_TURNS", "AGENT_OUTCOMES"} {
		msgs := s.readStream(kind)
		if kind == "AGENT_TURNS" {
			msgs = s.publishedTurns()
		}
		require.Len(t, msgs, len(ids), kind)
		seen := map[string]string{}
		for _, m := range msgs {
			require.Equal(t, 2, strings.Count(m.Subject, "."), "subject %q", m.Subject)
			_, conv, err := wire.ParseSubject("agent", m.Subject)
			require.NoError(t, err, "subject %q", m.Subject)
			var body struct {
				ConversationID string `json:"conversation_id"`
			}
			require.NoError(t, json.Unmarshal(m.Data, &body))
			require.Equal(t, body.ConversationID, conv, "subject %q", m.Subject)
			h, err := wire.ParseHeaderID(m.Header.Get(wire.HeaderConversationID))
			require.NoError(t, err)
			require.Equal(t, conv, h, "header of %q", m.Subject)
			prev, dup := seen[m.Subject]
			require.False(t, dup, "%q and %q share subject %q", prev, conv, m.Subject)
			seen[m.Subject] = conv
		}
	}
	// A single-token wildcard matches every conversation; each conversation's own subject
	// only its own events.
	require.Equal(t, len(ids), countMatching(ctx, t, s.js, "AGENT_OUTCOMES", "agent.outcomes.*"))
	for _, c := range ids {
		subj, err := wire.OutcomeSubject("agent", c)
		require.NoError(t, err)
		require.Equal(t, 1, countMatching(ctx, t, s.js, "AGENT_OUTCOMES", subj), "conversation %q", c)
	}

	// 1,000 characters: a clear error from the producer and from the schema.
	tooLong := strings.Repeat(".*>", 334)[:1000]
	_, err := s.prod.CreateConversation(ctx, s.app, tooLong)
	require.ErrorIs(t, err, producer.ErrInvalidInput)
	_, err = s.prod.Send(ctx, s.app, producer.Message{ConversationID: tooLong, ID: "long", Content: "x"})
	require.ErrorIs(t, err, producer.ErrInvalidInput)
	var ie *producer.InputError
	require.True(t, errors.As(err, &ie))
	require.Equal(t, "ConversationID", ie.Field)
	_, err = s.db.Pool.Exec(ctx, `INSERT INTO conversations (id) VALUES ($1)`, tooLong)
	var pgErr *pgconn.PgError
	require.True(t, errors.As(err, &pgErr), "%v", err)
	require.Equal(t, "23514", pgErr.Code, "check_violation")
	require.Zero(t, s.count(`SELECT count(*)::int FROM conversations WHERE octet_length(id) > 200`))

	s.requireFlowing("special-ids")
	requireNoErrorLogs(t, s.relay, s.worker)
}

// countMatching counts the messages of stream whose subject matches filter.
func countMatching(ctx context.Context, t *testing.T, js jetstream.JetStream, stream, filter string) int {
	t.Helper()
	st, err := js.Stream(ctx, stream)
	require.NoError(t, err)
	info, err := st.Info(ctx, jetstream.WithSubjectFilter(filter))
	require.NoError(t, err)
	n := 0
	for _, c := range info.State.Subjects {
		n += int(c)
	}
	return n
}
