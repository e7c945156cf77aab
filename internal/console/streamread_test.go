package console

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/batonhq/baton/internal/testsvc"
)

// TestRowCache: a poll's rows (read without contents) keep the contents cached for them while
// the message's row version, the reply's id and the reply's version are the ones cached; any
// other row is read again with its contents, and taken whole from that read.
func TestRowCache(t *testing.T) {
	t.Parallel()
	str := func(s string) *string { return &s }
	ver := func(v uint32) *uint32 { return &v }
	// row is a message as read with contents (content "c-<id>", reply text "r-<id>" when a
	// reply is given); probe is the same row as read without contents.
	row := func(id string, version uint32, reply string, replyVersion uint32, status string) messageRow {
		r := messageRow{ID: id, Content: "c-" + id, MessageVersion: version, Status: str(status)}
		if reply != "" {
			r.ReplyID, r.ReplyContent, r.ReplyVersion = str(reply), str("r-"+id), ver(replyVersion)
		}
		return r
	}
	probe := func(r messageRow) messageRow {
		r.Content, r.ReplyContent = "", nil
		return r
	}
	cached := newRowCache([]messageRow{
		row("a", 10, "", 0, "pending"),
		row("b", 11, "rb", 20, "done"),
		row("c", 12, "", 0, "processing"),
	})

	cases := []struct {
		name    string
		probed  []messageRow
		missing []string
		read    []messageRow // what messagesByIDSQL returns for missing
		want    []messageRow
	}{
		{
			name:   "nothing changed: no read",
			probed: []messageRow{probe(row("a", 10, "", 0, "pending")), probe(row("b", 11, "rb", 20, "done")), probe(row("c", 12, "", 0, "processing"))},
			want:   []messageRow{row("a", 10, "", 0, "pending"), row("b", 11, "rb", 20, "done"), row("c", 12, "", 0, "processing")},
		},
		{
			name:   "a state changed, contents did not: no read",
			probed: []messageRow{probe(row("a", 10, "", 0, "processing")), probe(row("b", 11, "rb", 20, "done"))},
			want:   []messageRow{row("a", 10, "", 0, "processing"), row("b", 11, "rb", 20, "done")},
		},
		{
			name:    "a new message",
			probed:  []messageRow{probe(row("a", 10, "", 0, "pending")), probe(row("d", 13, "", 0, "pending"))},
			missing: []string{"d"},
			read:    []messageRow{row("d", 13, "", 0, "pending")},
			want:    []messageRow{row("a", 10, "", 0, "pending"), row("d", 13, "", 0, "pending")},
		},
		{
			name:    "a reply appeared",
			probed:  []messageRow{probe(row("c", 12, "rc", 21, "done"))},
			missing: []string{"c"},
			read:    []messageRow{row("c", 12, "rc", 21, "done")},
			want:    []messageRow{row("c", 12, "rc", 21, "done")},
		},
		{
			name:    "the reply was updated, or replaced by another",
			probed:  []messageRow{probe(row("b", 11, "rb", 22, "done")), probe(row("c", 12, "other", 20, "done"))},
			missing: []string{"b", "c"},
			read:    []messageRow{row("b", 11, "rb", 22, "done"), row("c", 12, "other", 20, "done")},
			want:    []messageRow{row("b", 11, "rb", 22, "done"), row("c", 12, "other", 20, "done")},
		},
		{
			name:    "the reply went away",
			probed:  []messageRow{probe(row("b", 11, "", 0, "done"))},
			missing: []string{"b"},
			read:    []messageRow{row("b", 11, "", 0, "done")},
			want:    []messageRow{row("b", 11, "", 0, "done")},
		},
		{
			name:    "the message row was updated",
			probed:  []messageRow{probe(row("a", 14, "", 0, "pending"))},
			missing: []string{"a"},
			read:    []messageRow{row("a", 14, "", 0, "pending")},
			want:    []messageRow{row("a", 14, "", 0, "pending")},
		},
		{
			name:    "changed again between the probe and the read: the read's row, whole",
			probed:  []messageRow{probe(row("c", 12, "", 0, "processing")), probe(row("d", 13, "", 0, "pending"))},
			missing: []string{"d"},
			read:    []messageRow{row("d", 13, "rd", 23, "done")},
			want:    []messageRow{row("c", 12, "", 0, "processing"), row("d", 13, "rd", 23, "done")},
		},
		{
			name:    "deleted between the probe and the read: left out",
			probed:  []messageRow{probe(row("a", 10, "", 0, "pending")), probe(row("d", 13, "", 0, "pending"))},
			missing: []string{"d"},
			want:    []messageRow{row("a", 10, "", 0, "pending")},
		},
		{
			name: "an empty conversation",
			want: []messageRow{},
		},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			require.Equal(t, c.missing, cached.missing(c.probed))
			rows, next := cached.complete(c.probed, c.read)
			require.Equal(t, c.want, rows)
			require.Equal(t, newRowCache(c.want), next)
			require.NotNil(t, next, "a nil cache would make the next poll read everything")
			require.Empty(t, next.missing(rows), "the next poll, with nothing changed, reads nothing")
		})
	}
}

// TestStreamSeesEveryChange: a stream that reads contents only of what changed still shows
// every change a read of everything showed: a message's content updated, its reply's content
// updated, its reply replaced by another, a worker renamed; and nothing when nothing changed.
func TestStreamSeesEveryChange(t *testing.T) {
	t.Parallel()
	e := setup(t, Config{PollInterval: 20 * time.Millisecond}, false)
	e.createConversation(t, "conv-1")
	e.send(t, "conv-1", "m1", "hello")
	e.send(t, "conv-1", "m2", "second")
	s := e.openStream(t, "conv-1")
	require.Len(t, (<-s.events).Messages, 2)

	w := worker{t: t, e: e, conv: "conv-1", msgID: "m1", runID: "00000000-0000-4000-8000-000000000011", worker: "worker-a"}
	w.claim()
	require.Equal(t, "worker-a", s.view(t, "m1", StateRunning).Worker)
	exec(t, e.db.Pool, `UPDATE agent_runs SET worker = 'worker-b' WHERE run_id = $1`, w.runID)
	require.Equal(t, "worker-b", s.next(t).Worker)
	w.reply("assistant", "echo: hello", "")
	require.Equal(t, "echo: hello", s.view(t, "m1", StateReplied).Reply)

	exec(t, e.db.Pool, `UPDATE messages SET content = 'hello, edited' WHERE id = 'm1'`)
	require.Equal(t, "hello, edited", s.next(t).Content)
	exec(t, e.db.Pool, `UPDATE messages SET content = 'echo: edited' WHERE id = 'baton:reply:m1'`)
	require.Equal(t, "echo: edited", s.next(t).Reply)
	exec(t, e.db.Pool, `INSERT INTO messages (id, conversation_id, role, content) VALUES ('other-reply', 'conv-1', 'assistant', 'another answer')`)
	exec(t, e.db.Pool, `UPDATE agent_outbox SET reply_id = 'other-reply' WHERE message_id = 'm1'`)
	require.Equal(t, "another answer", s.next(t).Reply)
	// An update that changes no view (a row written again as it was) sends nothing; m2's
	// change after it is the next event.
	exec(t, e.db.Pool, `UPDATE messages SET content = content WHERE id = 'm1'`)
	exec(t, e.db.Pool, `UPDATE messages SET content = 'second, edited' WHERE id = 'm2'`)
	v := s.next(t)
	require.Equal(t, "m2", v.ID)
	require.Equal(t, "second, edited", v.Content)
}

// next returns the one message view of the stream's next event.
func (s *stream) next(t *testing.T) MessageView {
	t.Helper()
	select {
	case ev := <-s.events:
		require.False(t, ev.Full)
		require.Len(t, ev.Messages, 1)
		return ev.Messages[0]
	case <-time.After(waitFor):
		t.Fatal("no event")
		return MessageView{}
	}
}

// TestStreamReadsScanNoWholeTable: the stream's two reads (every poll, and for what changed)
// read by index on tables of realistic size, as TestAttackQueriesScanWholeTables requires of
// the console's other periodic reads.
func TestStreamReadsScanNoWholeTable(t *testing.T) {
	t.Parallel()
	db := testsvc.NewDatabase(t)
	const n = 30000
	exec(t, db.Pool, `INSERT INTO conversations (id) SELECT 'c' || g % 300 FROM generate_series(0, 299) g`)
	exec(t, db.Pool, `INSERT INTO messages (id, conversation_id, role, content, created_at)
		SELECT 'm' || g, 'c' || g % 300, 'user', 'hello', now() - g * interval '1 second' FROM generate_series(1, $1) g`, n)
	exec(t, db.Pool, `INSERT INTO messages (id, conversation_id, role, content, created_at)
		SELECT 'r' || g, 'c' || g % 300, 'assistant', 'echo', now() - g * interval '1 second' FROM generate_series(1, $1) g`, n)
	exec(t, db.Pool, `INSERT INTO agent_outbox (conversation_id, message_id, status, attempts, reply_id)
		SELECT 'c' || g % 300, 'm' || g, 'done', 1, 'r' || g FROM generate_series(1, $1) g`, n)
	exec(t, db.Pool, `INSERT INTO agent_runs (run_id, conversation_id, outbox_ids, worker, started_at)
		SELECT gen_random_uuid(), 'c' || g % 300, ARRAY[g::bigint], 'w', now() FROM generate_series(1, $1) g`, n)
	exec(t, db.Pool, `ANALYZE conversations, messages, agent_outbox, agent_runs`)
	ids := make([]string, 0, maxMessages)
	for i := range maxMessages {
		ids = append(ids, fmt.Sprintf("m%d", 1+i*300))
	}
	for name, q := range map[string][]any{
		messageVersionsSQL: {"c1", maxMessages},
		messagesByIDSQL:    {ids, "c1"},
	} {
		var plan []map[string]any
		require.NoError(t, db.Pool.QueryRow(context.Background(), "EXPLAIN (FORMAT JSON) "+name, q...).Scan(&plan), name)
		require.Empty(t, seqScans(plan[0]["Plan"]), name)
	}
}
