package e2e

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"math/rand/v2"
	"slices"
	"sort"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/batonhq/baton/wire"
)

var (
	chaosDuration = flag.Duration("chaos.duration", 110*time.Second,
		"how long the chaos run sends and injects faults (setup and drain come on top, about a minute)")
	chaosSeed    = flag.Uint64("chaos.seed", 0, "seed of the fault schedule, to replay a run (0: a random one)")
	chaosCluster = flag.Duration("chaos.cluster", 45*time.Second,
		"how long TestChaosCluster, the chaos run on a 3-node JetStream cluster with R3 streams, sends and injects faults")
)

// drainTimeout bounds the wait, after the faults, for every accepted message to end.
const drainTimeout = 2 * time.Minute

// TestChaos runs the whole system, every program a process, through a schedule of faults
// drawn from a seed, beside a neighbour, and checks what it did (see README, the chaos run).
func TestChaos(t *testing.T) { runChaos(t, *chaosDuration, false) }

// TestChaosCluster is the chaos run on a 3-node JetStream cluster with R3 streams, where
// NATS faults stop one node (often a stream's leader) and the stream fence works hardest.
func TestChaosCluster(t *testing.T) { runChaos(t, *chaosCluster, true) }

// runChaos runs the system for length through the faults of a schedule, on one NATS server
// or on a cluster, and checks it.
func runChaos(t *testing.T, length time.Duration, cluster bool) {
	seed := *chaosSeed
	if seed == 0 {
		seed = rand.Uint64N(1<<53) + 1
	}
	lengthFlag, test := "chaos.duration", "TestChaos"
	if cluster {
		lengthFlag, test = "chaos.cluster", "TestChaosCluster"
	}
	t.Logf("chaos seed %d (replay with -chaos.seed=%d), duration %v, cluster %v", seed, seed, length, cluster)
	t.Cleanup(func() {
		if t.Failed() {
			t.Logf("CHAOS RUN FAILED: replay with go test ./e2e -run '^%s$' -chaos.seed=%d -%s=%v", test, seed, lengthFlag, length)
		}
	})
	faults := schedule(seed, length)
	background := backgroundSchedule(seed, length)
	for _, f := range faults {
		t.Logf("scheduled %v", f)
	}
	for _, f := range background {
		t.Logf("scheduled in the background %v", f)
	}
	ctx, cancel := context.WithTimeout(t.Context(), length+drainTimeout+5*time.Minute)
	defer cancel()

	began := time.Now()
	// The neighbour comes first: its transaction is open across the slot's creation.
	var slotWait func() string
	s := startSystem(t, ctx, cluster, func(s *system) {
		if err := createNeighbour(ctx, s); err != nil {
			t.Fatal(err)
		}
		slotWait = s.openAcrossSlotCreation(ctx)
	})
	t.Logf("neighbour's transaction open across the slot's creation: %s", slotWait())
	baseline := s.idleGoroutines(ctx)
	t.Logf("system up in %v; idle goroutines %v", time.Since(began).Round(time.Millisecond), baseline)
	neighbourCtx, stopNeighbour := context.WithCancel(ctx)
	defer stopNeighbour()
	neighbourDone := s.startNeighbour(neighbourCtx, seed)
	l := s.startLoad(ctx)
	start := time.Now()
	bgDone := make(chan map[string]int, 1)
	go func() { bgDone <- s.runBackground(ctx, start, background) }() // ends with the schedule
	counts, defects := s.runFaults(ctx, start, faults)
	for k, n := range <-bgDone {
		counts[k] += n
	}
	sleep(ctx, time.Until(start.Add(length)))
	stopNeighbour()
	for k, n := range neighbourDone() {
		counts[k] += n
	}
	sent := l.finish()
	s.heal(ctx)
	t.Logf("load and faults done after %v: %d messages accepted, %d send retries, %d of them found their message already accepted",
		time.Since(start).Round(time.Millisecond), len(sent), l.retries.Load(), l.again.Load())
	drained := time.Now()

	c := newChecker(t, ctx, s)
	c.failures = append(c.failures, defects...)
	c.failures = append(c.failures, l.failures...)
	c.all(sent, baseline, drainTimeout)
	t.Logf("drained and checked in %v", time.Since(drained).Round(time.Millisecond))

	kinds := make([]string, 0, len(counts))
	for k, n := range counts {
		kinds = append(kinds, fmt.Sprintf("%s:%d", k, n))
	}
	sort.Strings(kinds)
	var busy int64
	for _, p := range s.procs {
		busy += p.busyWaits.Load()
	}
	t.Logf("chaos: cluster=%v messages=%d faults=%s replies=%d visible_errors=%d lost=%d doubled=%d finished_unpublished=%d neighbour_dead_letters=%d walsender_busy_waits=%d seed=%d",
		cluster, len(sent), strings.Join(kinds, ","), c.replies, c.visibleErrors, c.lost, c.doubled, c.unpublished, c.neighbourDeadLetters, busy, seed)
	if len(c.failures) > 0 {
		t.Errorf("%d failures:\n%s", len(c.failures), strings.Join(c.failures, "\n"))
		t.Logf("state: %s", c.state())
		t.Logf("logs:\n%s", s.logs(40))
	}
}

// idleGoroutines returns, per kind of process, the most goroutines one of its processes runs
// while idle, before the load: the most of three samples over a second, once every process
// answers (a worker still starting its consumer runs fewer).
func (s *system) idleGoroutines(ctx context.Context) map[string]float64 {
	out := map[string]float64{}
	for round := range 3 {
		if round > 0 {
			time.Sleep(500 * time.Millisecond)
		}
		for _, p := range s.procs {
			if p.metricsAddr == "" {
				continue
			}
			var v float64
			deadline := time.Now().Add(30 * time.Second)
			for {
				var err error
				if v, err = p.metric(ctx, "go_goroutines"); err == nil {
					break
				}
				if time.Now().After(deadline) {
					s.t.Fatalf("%s: %v", p.name, err)
				}
				time.Sleep(100 * time.Millisecond)
			}
			out[p.kind] = max(out[p.kind], v)
		}
	}
	return out
}

// checker drains the system after the faults and checks what it did.
type checker struct {
	t   *testing.T
	s   *system
	ctx context.Context
	// wait bounds each wait for the system to get somewhere (the subscriber, the slot, the
	// acks, idle processes), once drained.
	wait time.Duration

	failures                              []string
	replies, visibleErrors, lost, doubled int
	neighbourDeadLetters                  int // the neighbour's baton.answers messages set aside
	// unpublished counts the outbox rows whose turn event a relay's replay check did not
	// publish because the row was finished already.
	unpublished int
	nonUser     map[string]string // reply message id -> conversation
	outboxConv  map[int64]string  // outbox id -> conversation
}

func newChecker(t *testing.T, ctx context.Context, s *system) *checker {
	return &checker{t: t, s: s, ctx: ctx, wait: time.Minute}
}

// all drains the system and runs every check.
func (c *checker) all(sent []accepted, baseline map[string]float64, drainWithin time.Duration) {
	if c.drain(len(sent), drainWithin) {
		c.check(sent)
		c.awaitSubscriber()
		c.checkSubscriber(c.s.outcomes.snapshot())
		c.checkStreams()
		c.checkLeaks(baseline)
	}
	c.checkCrashes()
	c.checkPrivileges()
}

// checkCrashes records every exit of a process the test did not cause.
func (c *checker) checkCrashes() {
	for _, p := range c.s.procs {
		c.failures = append(c.failures, p.takeCrashes()...)
	}
}

func (c *checker) fail(format string, args ...any) {
	c.failures = append(c.failures, fmt.Sprintf(format, args...))
}

// drain waits until Postgres holds every accepted message's row, none pending or processing.
func (c *checker) drain(want int, within time.Duration) bool {
	deadline := time.Now().Add(within)
	nextLog := time.Now().Add(10 * time.Second)
	for {
		var rows, open int
		err := c.s.pool.QueryRow(c.ctx, `SELECT count(*), count(*) FILTER (WHERE status IN ('pending', 'processing'))
			FROM agent_outbox`).Scan(&rows, &open)
		if err == nil && rows >= want && open == 0 {
			return true
		}
		if time.Now().After(deadline) {
			c.fail("not drained after %v: %d rows of %d accepted, %d pending or processing (err %v)", within, rows, want, open, err)
			return false
		}
		if time.Now().After(nextLog) {
			c.t.Logf("draining: %d rows of %d, %d pending or processing", rows, want, open)
			nextLog = time.Now().Add(10 * time.Second)
		}
		time.Sleep(200 * time.Millisecond)
	}
}

// row is an accepted message's request and how it ended.
type row struct {
	OutboxID       int64
	MessageID      string
	ConversationID string
	Content        string
	Status         string
	Attempts       int
	ReplyID        *string
	ReplyRole      *string
	ReplyContent   *string
	Writes         int // write operations recorded by runs that claimed the row
}

// check compares what Postgres holds with what the producers sent.
func (c *checker) check(sent []accepted) {
	res, err := c.s.pool.Query(c.ctx, `SELECT o.id, m.id, o.conversation_id, m.content, o.status, o.attempts,
			o.reply_id, r.role, r.content,
			(SELECT count(*)::int FROM agent_runs ar JOIN operations op ON op.run_id = ar.run_id AND op.effect = 'write'
			 WHERE o.id = ANY (ar.outbox_ids))
		FROM agent_outbox o JOIN messages m ON m.id = o.message_id LEFT JOIN messages r ON r.id = o.reply_id
		ORDER BY o.id`)
	if err != nil {
		c.fail("read rows: %v", err)
		return
	}
	rows, err := pgx.CollectRows(res, pgx.RowToStructByPos[row])
	if err != nil {
		c.fail("read rows: %v", err)
		return
	}
	byMsg := map[string]row{}
	c.outboxConv = map[int64]string{}
	for _, r := range rows {
		byMsg[r.MessageID] = r
		c.outboxConv[r.OutboxID] = r.ConversationID
	}
	if len(rows) != len(sent) {
		c.fail("agent_outbox holds %d rows, the producers had %d messages accepted", len(rows), len(sent))
	}
	contents := map[string]string{} // user content -> message id
	for _, a := range sent {
		r, ok := byMsg[a.id]
		switch {
		case !ok:
			c.lost++
			c.fail("lost: accepted message %q of %q has no outbox row", a.id, a.conversation)
			continue
		case r.ConversationID != a.conversation || r.Content != a.content:
			c.fail("message %q: stored in %q with %q, sent to %q with %q", a.id, r.ConversationID, r.Content, a.conversation, a.content)
		}
		contents[a.content] = a.id
		switch {
		case r.ReplyID == nil || r.ReplyRole == nil:
			c.lost++
			c.fail("lost: message %q (outbox %d, %s) has no reply", a.id, r.OutboxID, r.Status)
		case r.Status == "done" && *r.ReplyRole == "assistant":
			c.replies++
			if !slices.Contains(echoParts(*r.ReplyContent), a.content) {
				c.fail("message %q (outbox %d): its reply %q does not answer %q", a.id, r.OutboxID, *r.ReplyContent, a.content)
			}
		case r.Status == "error" && *r.ReplyRole == "error":
			c.visibleErrors++
			// A visible error only where a write operation exists or attempts ran out.
			if r.Writes == 0 && r.Attempts < workerMaxAttempts {
				c.fail("message %q (outbox %d): a visible error after %d attempts without a write operation", a.id, r.OutboxID, r.Attempts)
			}
		default:
			c.fail("message %q (outbox %d): status %s with a reply of role %s", a.id, r.OutboxID, r.Status, *r.ReplyRole)
		}
		if r.Writes > 1 {
			c.doubled++
			c.fail("doubled: message %q (outbox %d): %d write operations", a.id, r.OutboxID, r.Writes)
		}
	}

	// Every reply and error message answers rows, and each user message is echoed once.
	res, err = c.s.pool.Query(c.ctx, `SELECT m.id, m.conversation_id, m.role, m.content,
			EXISTS (SELECT 1 FROM agent_outbox o WHERE o.reply_id = m.id)
		FROM messages m WHERE m.role <> 'user'`)
	if err != nil {
		c.fail("read replies: %v", err)
		return
	}
	type reply struct {
		ID, Conversation, Role, Content string
		Answers                         bool
	}
	replies, err := pgx.CollectRows(res, pgx.RowToStructByPos[reply])
	if err != nil {
		c.fail("read replies: %v", err)
		return
	}
	c.nonUser = map[string]string{}
	echoed := map[string]int{}
	for _, r := range replies {
		c.nonUser[r.ID] = r.Conversation
		if !r.Answers {
			c.doubled++
			c.fail("doubled: %s message %q in %q answers no row: %q", r.Role, r.ID, r.Conversation, r.Content)
		}
		if r.Role == "assistant" {
			for _, part := range echoParts(r.Content) {
				echoed[part]++
			}
		}
	}
	for content, n := range echoed {
		if n > 1 {
			c.doubled++
			c.fail("doubled: message %q (%q) is echoed by %d replies", contents[content], content, n)
		}
	}

	// No two runs of a conversation overlap (an unfinished run lasts forever).
	var overlaps int
	if err := c.s.pool.QueryRow(c.ctx, `SELECT count(*)::int FROM agent_runs a JOIN agent_runs r
		ON r.conversation_id = a.conversation_id AND r.run_id < a.run_id
		WHERE tstzrange(a.started_at, a.finished_at) && tstzrange(r.started_at, r.finished_at)`).Scan(&overlaps); err != nil {
		c.fail("read runs: %v", err)
	} else if overlaps > 0 {
		c.fail("%d pairs of runs of one conversation overlap", overlaps)
	}
}

// echoParts returns the messages an echo reply ("echo: a | b") answers.
func echoParts(reply string) []string {
	body, ok := strings.CutPrefix(reply, "echo: ")
	if !ok {
		return nil
	}
	return strings.Split(body, " | ")
}

// awaitSubscriber waits until the subscriber printed every reply and error message.
func (c *checker) awaitSubscriber() {
	deadline := time.Now().Add(c.wait)
	for {
		seen := map[string]bool{}
		for _, l := range c.s.outcomes.snapshot() {
			seen[l.MessageID] = true
		}
		missing := 0
		for id := range c.nonUser {
			if !seen[id] {
				missing++
			}
		}
		if missing == 0 {
			return
		}
		if time.Now().After(deadline) {
			c.fail("the subscriber has not printed %d of %d outcomes after %v", missing, len(c.nonUser), c.wait)
			return
		}
		time.Sleep(200 * time.Millisecond)
	}
}

// checkSubscriber checks that the subscriber printed each outcome once, nothing else, and
// each conversation's in commit order.
func (c *checker) checkSubscriber(lines []subscriberLine) {
	c.s.outcomes.mu.Lock()
	for _, b := range c.s.outcomes.bad {
		c.fail("subscriber printed an unreadable line: %q", b)
	}
	c.s.outcomes.mu.Unlock()
	seen := map[string]int{}
	got := map[string][]string{}
	printedSeq := map[string]uint64{}
	for _, l := range lines {
		if _, ok := printedSeq[l.MessageID]; !ok {
			printedSeq[l.MessageID] = l.Seq
		}
		seen[l.MessageID]++
		if seen[l.MessageID] == 2 {
			c.doubled++
			c.fail("doubled: the subscriber printed outcome %q twice", l.MessageID)
		}
		conv, ok := c.nonUser[l.MessageID]
		switch {
		case !ok:
			c.fail("the subscriber printed outcome %q, which is not in Postgres", l.MessageID)
		case conv != l.ConversationID:
			c.fail("the subscriber printed outcome %q for %q, Postgres has it in %q", l.MessageID, l.ConversationID, conv)
		}
		if seen[l.MessageID] == 1 {
			got[l.ConversationID] = append(got[l.ConversationID], l.MessageID)
		}
	}
	want, err := c.commitOrder()
	if err != nil {
		c.fail("read replies: %v", err)
		return
	}
	var orders map[string]string // read once, at the first failure
	var readErr string
	for conv, ids := range want {
		if !slices.Equal(ids, got[conv]) {
			if orders == nil {
				orders, readErr = c.streamOrders()
			}
			i := 0
			for i < min(len(ids), len(got[conv])) && ids[i] == got[conv][i] {
				i++
			}
			printed, committed := "nothing", "nothing"
			if i < len(got[conv]) {
				printed = got[conv][i]
			}
			if i < len(ids) {
				committed = ids[i]
			}
			c.fail("conversation %q: the subscriber printed its outcomes out of commit order: %d printed, %d committed; the %d-th printed is %s, the %d-th committed %s\n"+
				"  printed (id@stream seq): %s\n  committed: %s\n  stream order: %s",
				conv, len(got[conv]), len(ids), i+1, printed, i+1, committed,
				withSeqs(got[conv], printedSeq), strings.Join(ids, " "), orders[conv]+readErr)
		}
	}
}

// commitOrder returns each conversation's replies and visible errors (their message ids) in
// the order they were committed.
func (c *checker) commitOrder() (map[string][]string, error) {
	res, err := c.s.pool.Query(c.ctx, `SELECT conversation_id, id FROM messages WHERE role <> 'user' ORDER BY created_at, id`)
	if err != nil {
		return nil, err
	}
	want := map[string][]string{}
	var conv, id string
	_, err = pgx.ForEachRow(res, []any{&conv, &id}, func() error {
		want[conv] = append(want[conv], id)
		return nil
	})
	return want, err
}

// withSeqs lists ids as id@seq.
func withSeqs(ids []string, seq map[string]uint64) string {
	out := make([]string, len(ids))
	for i, id := range ids {
		out[i] = fmt.Sprintf("%s@%d", id, seq[id])
	}
	return strings.Join(out, " ")
}

// storedOutcome is an outcome as the outcomes stream holds it.
type storedOutcome struct {
	id, conversation string
	seq              uint64
}

// storedOutcomes reads the outcomes stream's messages whose subject match accepts, in stream
// order (see streamMessages).
func (c *checker) storedOutcomes(match func(subject string) bool) ([]storedOutcome, error) {
	var out []storedOutcome
	err := c.streamMessages("AGENT_OUTCOMES", match, func(msg *jetstream.RawStreamMsg) error {
		var ev struct {
			MessageID      string `json:"message_id"`
			ConversationID string `json:"conversation_id"`
		}
		if err := json.Unmarshal(msg.Data, &ev); err != nil {
			return fmt.Errorf("outcome %d on %s: %w", msg.Sequence, msg.Subject, err)
		}
		out = append(out, storedOutcome{ev.MessageID, ev.ConversationID, msg.Sequence})
		return nil
	})
	return out, err
}

// streamMessages calls each with the messages of stream whose subject match accepts, in
// stream order, read one by one from the stream's leader (a consumer may have no leader for a
// while in a cluster still settling after its restarts: it answers "no responders"); a read
// that fails is retried, for up to 30s in all.
func (c *checker) streamMessages(stream string, match func(subject string) bool, each func(*jetstream.RawStreamMsg) error) error {
	ctx, cancel := context.WithTimeout(c.ctx, 30*time.Second)
	defer cancel()
	js, err := jetstream.New(c.s.nc)
	if err != nil {
		return err
	}
	var st jetstream.Stream
	for st, err = js.Stream(ctx, stream); err != nil; st, err = js.Stream(ctx, stream) {
		if ctx.Err() != nil {
			return err
		}
		time.Sleep(200 * time.Millisecond)
	}
	state := st.CachedInfo().State
	for seq := state.FirstSeq; seq <= state.LastSeq && seq > 0; seq++ {
		msg, err := st.GetMsg(ctx, seq)
		if errors.Is(err, jetstream.ErrMsgNotFound) {
			continue
		}
		if err != nil {
			if ctx.Err() != nil {
				return fmt.Errorf("%s at stream sequence %d: %w", stream, seq, err)
			}
			seq--
			time.Sleep(200 * time.Millisecond)
			continue
		}
		if !match(msg.Subject) {
			continue
		}
		if err := each(msg); err != nil {
			return err
		}
	}
	return nil
}

// streamOrders reads the outcomes stream once and returns each conversation's outcomes as
// message id@stream sequence in stream order, and what went wrong reading it ("" if nothing):
// whether an order failure is the stream's or the delivery's.
func (c *checker) streamOrders() (map[string]string, string) {
	stored, err := c.storedOutcomes(func(subject string) bool { return strings.HasPrefix(subject, "agent.outcomes.") })
	orders := map[string]string{}
	for conv, ids := range withStreamSeqs(stored) {
		orders[conv] = strings.Join(ids, " ")
	}
	if err != nil {
		return orders, fmt.Sprintf(" (read the stream: %v)", err)
	}
	return orders, ""
}

// withStreamSeqs lists each conversation's stored outcomes as message id@stream sequence.
func withStreamSeqs(stored []storedOutcome) map[string][]string {
	orders := map[string][]string{}
	for _, o := range stored {
		orders[o.conversation] = append(orders[o.conversation], fmt.Sprintf("%s@%d", o.id, o.seq))
	}
	return orders
}

// checkStreamOrder checks that the outcomes stream holds each conversation's outcomes, each
// once, in commit order: what the relay promises, whatever a subscriber then does.
func (c *checker) checkStreamOrder() {
	want, err := c.commitOrder()
	if err != nil {
		c.fail("read replies: %v", err)
		return
	}
	stored, err := c.storedOutcomes(func(subject string) bool { return strings.HasPrefix(subject, "agent.outcomes.") })
	if err != nil {
		c.fail("read the outcomes stream: %v", err)
		return
	}
	for _, r := range repeats(stored) {
		c.doubled++
		c.fail("%s", r)
	}
	got, seen := map[string][]string{}, map[string]bool{}
	for _, o := range stored {
		if !seen[o.id] {
			seen[o.id] = true
			got[o.conversation] = append(got[o.conversation], o.id)
		}
	}
	orders := withStreamSeqs(stored)
	for conv, ids := range want {
		if !slices.Equal(ids, got[conv]) {
			c.fail("conversation %q: the outcomes stream holds its outcomes out of commit order or incomplete\n  committed: %s\n  stream order: %s",
				conv, strings.Join(ids, " "), strings.Join(orders[conv], " "))
		}
	}
}

// checkStreams checks the slot's confirmed position caught up with the WAL, every turn event
// was acked, what the turns and outcomes streams held, and that nothing went to the
// dead-letter stream.
func (c *checker) checkStreams() {
	var target string
	if err := c.s.pool.QueryRow(c.ctx, `SELECT pg_current_wal_lsn()::text`).Scan(&target); err != nil {
		c.fail("read wal position: %v", err)
		return
	}
	deadline := time.Now().Add(c.wait)
	for {
		var caught bool
		var confirmed *string
		err := c.s.pool.QueryRow(c.ctx, `SELECT confirmed_flush_lsn::text, confirmed_flush_lsn >= $1::pg_lsn
			FROM pg_replication_slots WHERE slot_name = 'baton'`, target).Scan(&confirmed, &caught)
		if err == nil && caught {
			break
		}
		if time.Now().After(deadline) {
			c.fail("the slot's confirmed LSN %v has not reached %s after %v (err %v)", confirmed, target, c.wait, err)
			break
		}
		time.Sleep(200 * time.Millisecond)
	}

	js, err := jetstream.New(c.s.nc)
	if err != nil {
		c.fail("jetstream: %v", err)
		return
	}
	ctx, cancel := context.WithTimeout(c.ctx, c.wait+10*time.Second)
	defer cancel()
	deadline = time.Now().Add(c.wait)
	for {
		cons, err := js.Consumer(ctx, "AGENT_TURNS", "baton-workers")
		var info *jetstream.ConsumerInfo
		if err == nil {
			info, err = cons.Info(ctx)
		}
		if err == nil && info.NumAckPending == 0 && info.NumPending == 0 {
			break
		}
		if time.Now().After(deadline) {
			if info != nil {
				c.fail("turn events not all acked: %d pending, %d awaiting ack", info.NumPending, info.NumAckPending)
			} else {
				c.fail("turn events: %v", err)
			}
			break
		}
		time.Sleep(200 * time.Millisecond)
	}
	c.checkTurnStream()
	c.checkStreamOrder()
	c.checkDeadLetters(ctx, js)
}

// neighbourMark starts every baton.answers message the neighbour emits that the relay sets
// aside (neighbour_test.go): the dead-letter stream may hold those, and nothing else.
const neighbourMark = "neighbour"

// checkDeadLetters fails the run on every dead-letter record but the neighbour's malformed
// baton.answers messages, which the relay rightly sets aside.
func (c *checker) checkDeadLetters(ctx context.Context, js jetstream.JetStream) {
	st, err := js.Stream(ctx, "AGENT_DEADLETTER")
	if err != nil {
		if !strings.Contains(err.Error(), "not found") {
			c.fail("dead-letter stream: %v", err)
		}
		return
	}
	n, err := wire.StreamEvents(ctx, st, "agent", wire.KindDeadLetter)
	if err != nil {
		c.fail("dead-letter stream: %v", err)
		return
	}
	if n == 0 {
		return
	}
	var read, theirs uint64
	err = c.streamMessages("AGENT_DEADLETTER", func(subject string) bool { return strings.HasPrefix(subject, "agent.deadletter.") },
		func(m *jetstream.RawStreamMsg) error {
			read++
			var rec wire.DeadLetter
			if err := json.Unmarshal(m.Data, &rec); err != nil {
				c.fail("a dead-letter record that is not JSON: %q", m.Data)
				return nil
			}
			if rec.Kind == wire.DeadLetterAnswers && strings.HasPrefix(string(rec.Raw), neighbourMark) {
				theirs++
				return nil
			}
			c.fail("a record in the dead-letter stream: kind %s, table %q, reason %s, %d bytes: %.200q",
				rec.Kind, rec.Table, rec.Reason, rec.RawBytes, rec.Raw)
			return nil
		})
	if err != nil || read != n {
		c.fail("read the dead-letter stream: %d of %d records (%v)", read, n, err)
	}
	c.neighbourDeadLetters = int(theirs)
}

// goroutineSlack is how many goroutines above its kind's idle count before the load a process
// may run once the system is idle again: pools that grew under load keep connections.
const goroutineSlack = 15

// checkLeaks checks the processes' goroutines and connections, once idle again.
func (c *checker) checkLeaks(baseline map[string]float64) {
	deadline := time.Now().Add(c.wait)
	for {
		var problems, seen []string
		for _, p := range c.s.procs {
			figures := p.name + ":"
			if p.metricsAddr != "" {
				n, err := p.metric(c.ctx, "go_goroutines")
				if err != nil {
					problems = append(problems, err.Error())
				} else if n > baseline[p.kind]+goroutineSlack {
					problems = append(problems, fmt.Sprintf("%s runs %.0f goroutines, %.0f when idle before the load", p.name, n, baseline[p.kind]))
				}
				figures += fmt.Sprintf(" goroutines=%.0f", n)
			}
			n := 0
			for _, px := range p.nats {
				n += px.Conns()
			}
			if n != 1 {
				problems = append(problems, fmt.Sprintf("%s has %d connections to NATS, want 1", p.name, n))
			}
			figures += fmt.Sprintf(" nats=%d", n)
			if p.pg != nil {
				bound := workerPoolMax
				if p.kind == "relay" {
					bound = relayConnsMax
				}
				n := p.pg.Conns()
				if n > bound || n == 0 {
					problems = append(problems, fmt.Sprintf("%s has %d connections to Postgres, want 1 to %d", p.name, n, bound))
				}
				figures += fmt.Sprintf(" pg=%d", n)
			}
			seen = append(seen, figures)
		}
		if len(problems) == 0 {
			c.t.Logf("idle again: %s (idle before the load: %v goroutines)", strings.Join(seen, ", "), baseline)
			return
		}
		if time.Now().After(deadline) {
			for _, pr := range problems {
				c.fail("leak: %s", pr)
			}
			return
		}
		time.Sleep(500 * time.Millisecond)
	}
}

// state describes Postgres's rows for a failure report.
func (c *checker) state() string {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	var b strings.Builder
	res, err := c.s.pool.Query(ctx, `SELECT status, count(*) FROM agent_outbox GROUP BY 1 ORDER BY 1`)
	if err == nil {
		var st string
		var n int
		_, err = pgx.ForEachRow(res, []any{&st, &n}, func() error { fmt.Fprintf(&b, "%s=%d ", st, n); return nil })
	}
	res, err2 := c.s.pool.Query(ctx, `SELECT coalesce(outcome, 'open'), count(*) FROM agent_runs GROUP BY 1 ORDER BY 1`)
	if err2 == nil {
		var st string
		var n int
		b.WriteString("runs: ")
		_, err2 = pgx.ForEachRow(res, []any{&st, &n}, func() error { fmt.Fprintf(&b, "%s=%d ", st, n); return nil })
	}
	var slot string
	err3 := c.s.pool.QueryRow(ctx, `SELECT format('slot active=%s confirmed=%s wal=%s', active, confirmed_flush_lsn, pg_current_wal_lsn())
		FROM pg_replication_slots WHERE slot_name = 'baton'`).Scan(&slot)
	b.WriteString(slot)
	for _, e := range []error{err, err2, err3} {
		if e != nil {
			fmt.Fprintf(&b, " (%v)", e)
		}
	}
	return b.String()
}
