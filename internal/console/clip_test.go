package console

import (
	"context"
	"fmt"
	"net/http"
	"strings"
	"testing"
	"time"
	"unicode/utf8"

	"github.com/stretchr/testify/require"

	"github.com/batonhq/baton/internal/testsvc"
)

// text is k characters cycling through one-, two-, three- and four-byte ones.
func text(k int) string {
	chars := []rune("aé€😀")
	var b strings.Builder
	for i := range k {
		b.WriteRune(chars[i%len(chars)])
	}
	return b.String()
}

// clipped is what clip must return: s when it has at most n characters, else its first n
// characters and "…".
func clipped(s string, n int) string {
	if utf8.RuneCountInString(s) <= n {
		return s
	}
	i := 0
	for range n {
		_, size := utf8.DecodeRuneInString(s[i:])
		i += size
	}
	return s[:i] + "…"
}

// TestClip: clip cuts a text to its limit in characters, marking a cut with "…", exactly as
// the expression it replaced (length and left over the whole value) did, for texts under, at
// and over the limit, of one- to four-byte characters, stored inline or TOASTed (compressed or
// not), and NULL.
func TestClip(t *testing.T) {
	t.Parallel()
	db := testsvc.NewDatabase(t)
	ctx := context.Background()
	exec(t, db.Pool, `CREATE TABLE clip_cases (id int PRIMARY KEY, v text)`)
	var values []*string
	add := func(s string) { values = append(values, &s) }
	for _, n := range []int{1, 5, nameChars, chatTextChars, timelineTextChars} {
		for _, k := range []int{n - 1, n, n + 1, 2 * n} {
			add(text(k))
			add(strings.Repeat("é", k))
			add(strings.Repeat("😀", k))
			add(strings.Repeat("x", k))
		}
	}
	add("")
	values = append(values, nil)
	add(strings.Repeat("é", 100000)) // compressed when TOASTed
	add(strings.Repeat("😀", 300000))
	for i, v := range values {
		exec(t, db.Pool, `INSERT INTO clip_cases VALUES ($1, $2)`, i, v)
	}
	// Poorly compressible, stored out of line uncompressed: 1 MB of hex.
	exec(t, db.Pool, `INSERT INTO clip_cases SELECT 1000 + k, (SELECT string_agg(md5(random()::text || h), '')
		FROM generate_series(1, 32768 + 0 * k) h) FROM generate_series(0, 1) k`)
	exec(t, db.Pool, `UPDATE clip_cases SET v = v || 'é😀' WHERE id = 1001`)
	var toasted int
	require.NoError(t, db.Pool.QueryRow(ctx, `SELECT count(*) FROM clip_cases WHERE pg_column_size(v) < octet_length(v)`).Scan(&toasted))
	require.Positive(t, toasted, "no case is TOASTed")

	for _, n := range []int{1, 5, nameChars, chatTextChars, timelineTextChars} {
		old := fmt.Sprintf("CASE WHEN length(v) > %[1]d THEN left(v, %[1]d) || '…' ELSE v END", n)
		rows, err := db.Pool.Query(ctx, `SELECT id, v, `+clip("v", n)+`, `+old+` FROM clip_cases ORDER BY id`)
		require.NoError(t, err)
		checked := 0
		for rows.Next() {
			var id int
			var v, got, was *string
			require.NoError(t, rows.Scan(&id, &v, &got, &was))
			if v == nil {
				require.Nil(t, got, "NULL stays NULL")
				require.Nil(t, was)
				continue
			}
			require.NotNil(t, got)
			require.Equal(t, clipped(*v, n), *got, "case %d (%d characters), limit %d", id, utf8.RuneCountInString(*v), n)
			require.Equal(t, *was, *got, "case %d, limit %d: not what the old expression gave", id, n)
			checked++
		}
		require.NoError(t, rows.Err())
		require.Equal(t, len(values)+1, checked, n)
	}
}

// TestChatClipsUnchanged: the chat's texts (a message and its reply) under, at and over
// chatTextChars, of multibyte characters, read by GET .../messages, by a stream's first read
// and by its read of what changed (a reply appearing), are cut exactly as before.
func TestChatClipsUnchanged(t *testing.T) {
	t.Parallel()
	e := setup(t, Config{PollInterval: 20 * time.Millisecond}, false)
	e.createConversation(t, "conv-1")
	lengths := []int{chatTextChars - 1, chatTextChars, chatTextChars + 1, 50 * chatTextChars}
	for i, k := range lengths {
		exec(t, e.db.Pool, `INSERT INTO messages (id, conversation_id, role, content, created_at)
			VALUES ($1, 'conv-1', 'user', $2, now() + $3 * interval '1 second')`, fmt.Sprintf("m%d", i), text(k), i)
		exec(t, e.db.Pool, `INSERT INTO agent_outbox (conversation_id, message_id) VALUES ('conv-1', $1)`, fmt.Sprintf("m%d", i))
	}
	s := e.openStream(t, "conv-1")
	first := <-s.events
	require.True(t, first.Full)
	require.Len(t, first.Messages, len(lengths))
	for i, k := range lengths {
		require.Equal(t, clipped(text(k), chatTextChars), first.Messages[i].Content, "message of %d characters", k)
	}
	for i, k := range lengths {
		id := fmt.Sprintf("m%d", i)
		w := worker{t: t, e: e, conv: "conv-1", msgID: id, runID: fmt.Sprintf("00000000-0000-4000-8000-0000000001%02d", i), worker: "w"}
		w.claim()
		w.reply("assistant", strings.Repeat("😀", k), "")
		v := s.view(t, id, StateReplied)
		require.Equal(t, clipped(strings.Repeat("😀", k), chatTextChars), v.Reply, "reply of %d characters", k)
		require.Equal(t, clipped(text(k), chatTextChars), v.Content)
	}
	code, body := e.do(t, http.MethodGet, "/api/conversations/conv-1/messages", nil)
	require.Equal(t, http.StatusOK, code)
	for i, k := range lengths {
		require.Contains(t, string(body), fmt.Sprintf(`"id":"m%d"`, i))
		require.Contains(t, string(body), clipped(strings.Repeat("😀", k), chatTextChars))
	}
}
