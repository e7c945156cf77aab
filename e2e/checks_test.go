package e2e

import (
	"context"
	"encoding/json"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/stretchr/testify/require"

	"github.com/batonhq/baton/wire"
)

// TestChaosChecksCatchDefects runs the system without faults, checks it passes the chaos run's
// checks, then plants one defect at a time (in Postgres, in what the subscriber printed, in
// the streams, in a process) and requires the checks to report it: a check that cannot fail
// would let a chaos run pass whatever Baton did.
func TestChaosChecksCatchDefects(t *testing.T) {
	ctx, cancel := context.WithTimeout(t.Context(), 5*time.Minute)
	defer cancel()
	s := startSystem(t, ctx, false, nil)
	baseline := s.idleGoroutines(ctx)
	l := s.startLoad(ctx)
	require.Eventually(t, func() bool {
		l.mu.Lock()
		defer l.mu.Unlock()
		return len(l.accepted) >= 300
	}, time.Minute, 50*time.Millisecond)
	sent := l.finish()
	require.Empty(t, l.failures)

	c := newChecker(t, ctx, s)
	c.all(sent, baseline, time.Minute)
	require.Empty(t, c.failures, "the system without faults passes")
	require.Equal(t, len(sent), c.replies)
	lines := s.outcomes.snapshot()

	exec := func(sql string, args ...any) {
		t.Helper()
		_, err := s.pool.Exec(ctx, sql, args...)
		require.NoError(t, err, sql)
	}
	// The planted defects go to a request whose runs recorded no write operation (a visible
	// error there is never justified by one).
	var firstOutbox int64
	var firstID, firstReply string
	require.NoError(t, s.pool.QueryRow(ctx, `SELECT o.id, o.message_id, o.reply_id FROM agent_outbox o
		WHERE NOT EXISTS (SELECT 1 FROM agent_runs r JOIN operations op ON op.run_id = r.run_id AND op.effect = 'write'
			WHERE o.id = ANY (r.outbox_ids))
		ORDER BY o.id LIMIT 1`).Scan(&firstOutbox, &firstID, &firstReply))
	first := sent[slices.IndexFunc(sent, func(a accepted) bool { return a.id == firstID })]
	// A second conversation's two outcomes, for the order.
	var twice string
	for _, ln := range lines {
		if n := countConv(lines, ln.ConversationID); n >= 2 {
			twice = ln.ConversationID
			break
		}
	}
	require.NotEmpty(t, twice, "a conversation with two outcomes")
	var twiceFirst int64 // the first outbox row of that conversation
	require.NoError(t, s.pool.QueryRow(ctx, `SELECT min(id) FROM agent_outbox WHERE conversation_id = $1`, twice).Scan(&twiceFirst))
	js, err := jetstream.New(s.nc)
	require.NoError(t, err)
	// plantTurnEvent stores one more turn event for an outbox row, as the relay writes it but
	// under a Msg-Id of its own (no duplicate window stops it), waits until a worker received
	// it, and returns the undo: the workers' records of it forgotten (it was acked and is gone).
	plantTurnEvent := func(outboxID int64) func() {
		var ev wire.TurnEvent
		require.NoError(t, s.pool.QueryRow(ctx, `SELECT id, conversation_id, message_id, 'pending', 0, created_at
			FROM agent_outbox WHERE id = $1`, outboxID).Scan(&ev.OutboxID, &ev.ConversationID, &ev.MessageID, &ev.Status, &ev.Attempts, &ev.CreatedAt))
		subject, err := wire.TurnSubject("agent", ev.ConversationID)
		require.NoError(t, err)
		msg := nats.NewMsg(subject)
		msg.Data, err = json.Marshal(ev)
		require.NoError(t, err)
		msg.Header.Set(wire.HeaderOutboxID, strconv.FormatInt(outboxID, 10))
		msg.Header.Set(jetstream.MsgIDHeader, fmt.Sprintf("planted:%d:%d", outboxID, time.Now().UnixNano()))
		ack, err := js.PublishMsg(ctx, msg)
		require.NoError(t, err)
		require.Eventually(t, func() bool {
			recs, _ := s.deliveries.snapshot()
			return slices.Contains(recs, delivery{outboxID, ack.Sequence})
		}, 30*time.Second, 50*time.Millisecond, "a worker receives the planted turn event")
		return func() { s.deliveries.dropFrom(ack.Sequence) }
	}

	cases := []struct {
		name, want string
		plant      func() (undo func())
		check      func(c *checker)
	}{
		{"a message without its reply", "lost: message", func() func() {
			exec(`UPDATE agent_outbox SET reply_id = NULL WHERE id = $1`, firstOutbox)
			return func() { exec(`UPDATE agent_outbox SET reply_id = $2 WHERE id = $1`, firstOutbox, firstReply) }
		}, func(c *checker) { c.check(sent) }},
		{"a second reply to a message", "doubled:", func() func() {
			exec(`INSERT INTO messages (id, conversation_id, role, content) VALUES ('planted-double', $1, 'assistant', $2)`,
				first.conversation, "echo: "+first.content)
			return func() { exec(`DELETE FROM messages WHERE id = 'planted-double'`) }
		}, func(c *checker) { c.check(sent) }},
		{"a visible error with neither a write nor attempts used up", "a visible error after", func() func() {
			exec(`INSERT INTO messages (id, conversation_id, role, content) VALUES ('planted-error', $1, 'error', 'failed')`, first.conversation)
			exec(`UPDATE agent_outbox SET status = 'error', reply_id = 'planted-error' WHERE id = $1`, firstOutbox)
			return func() {
				exec(`UPDATE agent_outbox SET status = 'done', reply_id = $2 WHERE id = $1`, firstOutbox, firstReply)
				exec(`DELETE FROM messages WHERE id = 'planted-error'`)
			}
		}, func(c *checker) { c.check(sent) }},
		{"two write operations for one request", "write operations", func() func() {
			exec(`INSERT INTO operations (run_id, conversation_id, tool, effect)
				SELECT run_id, conversation_id, 'planted', 'write' FROM agent_runs, generate_series(1, 2)
				WHERE $1 = ANY (outbox_ids)`, firstOutbox)
			return func() { exec(`DELETE FROM operations WHERE tool = 'planted'`) }
		}, func(c *checker) { c.check(sent) }},
		{"two runs of a conversation at once", "overlap", func() func() {
			exec(`INSERT INTO agent_runs (run_id, conversation_id, outbox_ids, worker, started_at)
				SELECT gen_random_uuid(), conversation_id, '{}', 'planted', started_at FROM agent_runs WHERE $1 = ANY (outbox_ids)`, firstOutbox)
			return func() { exec(`DELETE FROM agent_runs WHERE worker = 'planted'`) }
		}, func(c *checker) { c.check(sent) }},
		{"a row left processing", "not drained", func() func() {
			exec(`UPDATE agent_outbox SET status = 'processing', run_id = gen_random_uuid(), lease_expires_at = now() + interval '1 hour'
				WHERE id = $1`, firstOutbox)
			return func() {
				exec(`UPDATE agent_outbox SET status = 'done', lease_expires_at = NULL WHERE id = $1`, firstOutbox)
			}
		}, func(c *checker) { c.drain(len(sent), time.Second) }},
		{"an outcome printed twice", "printed outcome", nil, func(c *checker) {
			c.checkSubscriber(append(slices.Clone(lines), lines[0]))
		}},
		{"outcomes printed out of order", "out of commit order", nil, func(c *checker) {
			swapped := slices.Clone(lines)
			i := slices.IndexFunc(swapped, func(l subscriberLine) bool { return l.ConversationID == twice })
			j := i + 1 + slices.IndexFunc(swapped[i+1:], func(l subscriberLine) bool { return l.ConversationID == twice })
			swapped[i], swapped[j] = swapped[j], swapped[i]
			c.checkSubscriber(swapped)
		}},
		{"outcomes stored out of commit order", "outcomes stream holds", func() func() {
			// Postgres's order of the conversation's first two outcomes swapped: the stream's
			// order is now not the commit order.
			swap := `UPDATE messages m SET created_at = o.created_at FROM messages o
				WHERE m.id IN ($1, $2) AND o.id IN ($1, $2) AND o.id <> m.id`
			a, b := lines[slices.IndexFunc(lines, func(l subscriberLine) bool { return l.ConversationID == twice })].MessageID, ""
			for _, l := range lines {
				if l.ConversationID == twice && l.MessageID != a {
					b = l.MessageID
					break
				}
			}
			exec(swap, a, b)
			return func() { exec(swap, a, b) }
		}, func(c *checker) { c.checkStreamOrder() }},
		{"a record in the dead-letter stream", "dead-letter", func() func() {
			_, err := js.Publish(ctx, "agent.deadletter.turn", []byte("{}"))
			require.NoError(t, err)
			return func() {
				st, err := js.Stream(ctx, "AGENT_DEADLETTER")
				require.NoError(t, err)
				require.NoError(t, st.Purge(ctx))
			}
		}, func(c *checker) { c.checkStreams() }},
		{"a connection left open", "connections to NATS", func() func() {
			nc, err := nats.Connect("nats://" + s.named["worker-0"].nats[0].Addr())
			require.NoError(t, err)
			return nc.Close
		}, func(c *checker) { c.checkLeaks(baseline) }},
		{"a process that exited on its own", "exited on its own", func() func() {
			p := s.named["worker-1"]
			exited, err := p.signal(syscall.SIGCONT, false) // a no-op signal, for the exit channel
			require.NoError(t, err)
			require.NoError(t, syscall.Kill(p.pid(), syscall.SIGKILL))
			<-exited
			return func() { p.start(t) }
		}, func(c *checker) { c.checkCrashes() }},
		{"a second stored copy of a turn event", "stored copies of the turns stream", func() func() {
			return plantTurnEvent(firstOutbox)
		}, func(c *checker) { c.checkStreams() }},
		{"a stale turn event after a newer one", "the turns stream holds its events out of commit order", func() func() {
			return plantTurnEvent(twiceFirst)
		}, func(c *checker) { c.checkStreams() }},
		{"a turn event never stored", "never reached a worker", func() func() {
			recs, _ := s.deliveries.snapshot()
			seq := recs[slices.IndexFunc(recs, func(d delivery) bool { return d.outboxID == firstOutbox })].seq
			s.deliveries.mu.Lock()
			s.deliveries.recs = slices.DeleteFunc(s.deliveries.recs, func(d delivery) bool { return d.outboxID == firstOutbox })
			s.deliveries.mu.Unlock()
			return func() {
				s.deliveries.mu.Lock()
				s.deliveries.recs = append(s.deliveries.recs, delivery{firstOutbox, seq})
				s.deliveries.mu.Unlock()
			}
		}, func(c *checker) { c.checkTurnStream() }},
		{"a duplicate outcome", "stored 2 times in the outcomes stream", func() func() {
			st, err := js.Stream(ctx, "AGENT_OUTCOMES")
			require.NoError(t, err)
			orig, err := st.GetMsg(ctx, lines[0].Seq)
			require.NoError(t, err)
			msg := nats.NewMsg(orig.Subject)
			msg.Data, msg.Header = orig.Data, orig.Header
			msg.Header.Set(jetstream.MsgIDHeader, "planted-duplicate-outcome")
			ack, err := js.PublishMsg(ctx, msg)
			require.NoError(t, err)
			return func() { require.NoError(t, st.DeleteMsg(ctx, ack.Sequence)) }
		}, func(c *checker) { c.checkStreamOrder() }},
		// Last: Postgres's log keeps the refusal, which no undo takes back.
		{"a statement that needs a privilege the roles lack", "privilege errors", func() func() {
			worker := rolePool(t, ctx, s.pg, roleOf("worker"), 1)
			_, err := worker.Exec(ctx, `DELETE FROM agent_outbox WHERE id = $1`, firstOutbox)
			require.ErrorContains(t, err, "42501", "baton_worker deletes no outbox row")
			return func() {}
		}, func(c *checker) { c.checkPrivileges() }},
	}
	for _, tc := range cases {
		undo := func() {}
		if tc.plant != nil {
			undo = tc.plant()
		}
		c := newChecker(t, ctx, s)
		c.wait = 2 * time.Second
		c.check(sent) // fills c.nonUser, which the subscriber's check reads
		c.failures = nil
		tc.check(c)
		undo()
		require.True(t, slices.ContainsFunc(c.failures, func(f string) bool { return strings.Contains(f, tc.want) }),
			"%s: want a failure with %q, got %q", tc.name, tc.want, c.failures)
	}
}

// countConv counts the lines of conversation conv.
func countConv(lines []subscriberLine, conv string) int {
	n := 0
	for _, l := range lines {
		if l.ConversationID == conv {
			n++
		}
	}
	return n
}
