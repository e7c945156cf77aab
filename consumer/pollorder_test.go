package consumer

import (
	"context"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/batonhq/baton/internal/testsvc"
)

// groupedPendingSQL is the definition pendingConversationsSQL keeps, written as the grouping
// of every pending row that it was before issue 28: up to $2 conversations whose oldest pending
// row at least $1 ms old is claimable, oldest first, busy conversations left out.
const groupedPendingSQL = `SELECT conversation_id FROM agent_outbox
	WHERE status = 'pending' AND created_at <= now() - $1 * interval '1 millisecond'
	  AND conversation_id NOT IN (SELECT conversation_id FROM agent_outbox WHERE status = 'processing')
	GROUP BY conversation_id
	HAVING (array_agg(available_at <= now() OR NOT isfinite(available_at) ORDER BY id))[1]
	ORDER BY min(id) LIMIT $2`

// The page a poll finds is the one the grouping of every pending row defines, whichever way the
// poll gets it: from the window of oldest rows (it fills the page, or holds every pending row),
// or from the visit of every conversation (it does not). Pages of 3 here: a window of 12 rows.
func TestPendingConversationsKeepTheirOrder(t *testing.T) {
	const limit = 3
	type row struct {
		conv string
		age  time.Duration // before now
		// status is pending unless set; wait, when set, is available_at - now.
		status string
		wait   string
	}
	// rows builds n pending rows of conv, each age old.
	rows := func(conv string, n int, age time.Duration) []row {
		out := make([]row, n)
		for i := range out {
			out[i] = row{conv: conv, age: age}
		}
		return out
	}
	cat := func(parts ...[]row) []row {
		var out []row
		for _, p := range parts {
			out = append(out, p...)
		}
		return out
	}
	hour := time.Hour
	cases := []struct {
		name   string
		rows   []row // in id order
		minAge time.Duration
		want   []string
	}{
		{name: "interleaved: the window fills the page",
			rows: cat(rows("a", 1, hour), rows("b", 1, hour), rows("a", 1, hour), rows("c", 1, hour), rows("d", 1, hour), rows("e", 1, hour)),
			want: []string{"a", "b", "c"}},
		{name: "fewer rows than the window",
			rows: cat(rows("a", 2, hour), rows("b", 1, hour)),
			want: []string{"a", "b"}},
		{name: "the window is one conversation's: every conversation is visited",
			rows: cat(rows("a", 20, hour), rows("b", 1, hour), rows("c", 2, hour), rows("d", 1, hour)),
			want: []string{"a", "b", "c"}},
		{name: "the window is a busy conversation's",
			rows: cat([]row{{conv: "a", age: hour, status: "processing"}}, rows("a", 20, hour), rows("c", 1, hour), rows("b", 1, hour)),
			want: []string{"c", "b"}},
		{name: "busy and backing-off conversations in the window",
			rows: cat([]row{{conv: "a", age: hour, status: "processing"}, {conv: "b", age: hour, wait: "1 hour"}},
				rows("a", 2, hour), rows("b", 2, hour), rows("c", 1, hour), rows("d", 1, hour), rows("e", 1, hour), rows("f", 1, hour)),
			want: []string{"c", "d", "e"}},
		{name: "a head backing off for ever is claimable; a later row's backoff does not count",
			rows: cat([]row{{conv: "a", age: hour, wait: "infinity"}, {conv: "b", age: hour}, {conv: "b", age: hour, wait: "1 hour"}, {conv: "c", age: hour, wait: "1 minute"}}),
			want: []string{"a", "b"}},
		{name: "backing off past the window",
			rows: cat(rows("a", 13, hour), []row{{conv: "b", age: hour, wait: "1 hour"}, {conv: "c", age: hour}}, rows("b", 1, hour)),
			want: []string{"a", "c"}},
		{name: "rows younger than minAge do not count",
			rows:   cat([]row{{conv: "a", age: time.Second}, {conv: "b", age: hour}, {conv: "a", age: hour}, {conv: "c", age: time.Second}}),
			minAge: time.Minute,
			want:   []string{"b", "a"}},
		{name: "rows younger than minAge past the window",
			rows:   cat(rows("y", 20, time.Second), rows("a", 1, hour), rows("b", 1, hour), rows("y", 1, hour)),
			minAge: time.Minute,
			want:   []string{"a", "b", "y"}},
		{name: "nothing pending",
			rows: cat([]row{{conv: "a", age: hour, status: "done"}}),
			want: []string{}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			ctx := context.Background()
			db := testsvc.NewDatabase(t)
			for i, r := range tc.rows {
				conversations(t, db, r.conv)
				msg := r.conv + "-" + string(rune('a'+i))
				_, err := db.Pool.Exec(ctx, `
					WITH m AS (INSERT INTO messages (id, conversation_id, role, content) VALUES ($1, $2, 'user', 'hi') RETURNING id)
					INSERT INTO agent_outbox (conversation_id, message_id, status, created_at, available_at, run_id)
					SELECT $2, id, coalesce(nullif($3, ''), 'pending'), now() - $4 * interval '1 microsecond',
					       CASE WHEN $5 = '' THEN now() WHEN $5 = 'infinity' THEN 'infinity' ELSE now() + $5::interval END,
					       CASE WHEN $3 = 'processing' THEN gen_random_uuid() END
					FROM m`, msg, r.conv, r.status, r.age.Microseconds(), r.wait)
				require.NoError(t, err)
			}
			grouped, err := db.Pool.Query(ctx, groupedPendingSQL, tc.minAge.Milliseconds(), limit)
			require.NoError(t, err)
			want, err := pgx.CollectRows(grouped, pgx.RowTo[string])
			require.NoError(t, err)
			require.Equal(t, tc.want, want, "the case's expectation disagrees with the definition")

			page, err := testStore(db.RolePool(t, testsvc.RoleWorker)).pendingConversations(ctx, tc.minAge, limit)
			require.NoError(t, err)
			got := []string{}
			for _, p := range page {
				got = append(got, p.conversationID)
				// since is when the conversation's oldest pending row (old enough) was written.
				since := testsvc.Query[time.Time](t, db, `SELECT created_at FROM agent_outbox
					WHERE conversation_id = $1 AND status = 'pending' AND created_at <= now() - $2 * interval '1 millisecond'
					ORDER BY id LIMIT 1`, p.conversationID, tc.minAge.Milliseconds())
				require.Equal(t, since[0].UTC(), p.since.UTC(), "since of %s", p.conversationID)
			}
			require.Equal(t, tc.want, got)
		})
	}
}
