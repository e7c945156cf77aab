package relay_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/stretchr/testify/require"

	"github.com/batonhq/baton/internal/testsvc"
	"github.com/batonhq/baton/relay"
	"github.com/batonhq/baton/wire"
)

func TestMain(m *testing.M) { os.Exit(testsvc.MainNoLeaks(m)) }

// bundle is what a relay test needs: its own database, NATS server and slot.
type bundle struct {
	db   *testsvc.Database
	nats *testsvc.NATS
	nc   *nats.Conn
	js   jetstream.JetStream
	cfg  relay.Config
}

func setup(t *testing.T) *bundle {
	t.Helper()
	db := testsvc.NewDatabase(t)
	ns := testsvc.StartNATS(t)
	nc, err := nats.Connect(ns.URL(), nats.MaxReconnects(-1), nats.ReconnectWait(50*time.Millisecond))
	require.NoError(t, err)
	t.Cleanup(nc.Close)
	js, err := jetstream.New(nc)
	require.NoError(t, err)
	return &bundle{db: db, nats: ns, nc: nc, js: js, cfg: relay.Config{
		DatabaseURL:    db.RoleURL(testsvc.RoleRelay), // as deployed: roles.sql's relay role
		NATS:           nc,
		Slot:           db.Name, // slots are cluster-wide: one per test
		StatusInterval: 100 * time.Millisecond,
		MinBackoff:     20 * time.Millisecond,
		MaxBackoff:     500 * time.Millisecond,
		AckTimeout:     2 * time.Second,
		Logger:         slog.New(slog.NewTextHandler(testWriter{t}, &slog.HandlerOptions{Level: slog.LevelDebug})),
	}}
}

type testWriter struct{ t *testing.T }

func (w testWriter) Write(p []byte) (int, error) {
	w.t.Log(strings.TrimSpace(string(p)))
	return len(p), nil
}

// start runs a relay until the test ends and returns it.
func (b *bundle) start(t *testing.T) *relay.Relay {
	t.Helper()
	r, err := relay.New(b.cfg)
	require.NoError(t, err)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- r.Run(ctx) }()
	t.Cleanup(func() {
		cancel()
		select {
		case err := <-done:
			require.NoError(t, err)
		case <-time.After(30 * time.Second):
			t.Error("relay did not stop within 30s")
		}
	})
	return r
}

// run starts a relay for a test that reads Run's result from done (buffered: a test that took
// the value puts it back). The cleanup stops the relay and waits for Run.
func (b *bundle) run(t *testing.T) (r *relay.Relay, done chan error) {
	t.Helper()
	r, err := relay.New(b.cfg)
	require.NoError(t, err)
	ctx, cancel := context.WithCancel(context.Background())
	done = make(chan error, 1)
	go func() { done <- r.Run(ctx) }()
	t.Cleanup(func() {
		cancel()
		select {
		case err := <-done:
			t.Logf("relay stopped: %v", err)
		case <-time.After(30 * time.Second):
			t.Error("relay did not stop within 30s")
		}
	})
	return r, done
}

// startActive starts a relay and waits until it streams from its slot, so that what the test
// commits next reaches it through the stream, not the first-start backfill.
func (b *bundle) startActive(t *testing.T) *relay.Relay {
	t.Helper()
	r := b.start(t)
	require.Eventually(t, r.Active, time.Minute, 5*time.Millisecond, "relay never became active")
	return r
}

func ctxT(t *testing.T, d time.Duration) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), d)
	t.Cleanup(cancel)
	return ctx
}

func createConversations(t *testing.T, pool *pgxpool.Pool, ids ...string) {
	t.Helper()
	_, err := pool.Exec(context.Background(), `INSERT INTO conversations (id) SELECT unnest($1::text[])`, ids)
	require.NoError(t, err)
}

// send commits one user message and its outbox row, the way the producer does.
func send(ctx context.Context, db interface {
	QueryRow(context.Context, string, ...any) pgx.Row
}, conv, msgID string) (int64, error) {
	var id int64
	err := db.QueryRow(ctx, `WITH m AS (INSERT INTO messages (id, conversation_id, role, content)
			VALUES ($1, $2, 'user', 'hello') RETURNING id, conversation_id)
		INSERT INTO agent_outbox (conversation_id, message_id) SELECT conversation_id, id FROM m RETURNING id`,
		msgID, conv).Scan(&id)
	return id, err
}

type got struct {
	seq     uint64
	stored  time.Time
	subject string
	header  nats.Header
	data    []byte
}

// waitStream waits until stream holds at least n messages and returns them all in order.
func (b *bundle) waitStream(t *testing.T, stream string, n int, within time.Duration) []got {
	t.Helper()
	b.waitStreamCount(t, stream, n, within)
	return b.readStream(t, stream)
}

// waitStreamCount waits until stream holds at least n messages and returns how many it holds,
// without reading them (hundreds of megabytes would overrun the test's subscription).
func (b *bundle) waitStreamCount(t *testing.T, stream string, n int, within time.Duration) uint64 {
	t.Helper()
	ctx := ctxT(t, within+30*time.Second)
	var held uint64
	require.Eventually(t, func() bool {
		s, err := b.js.Stream(ctx, stream)
		if err != nil {
			return false
		}
		// A new session writes its fence, then deletes the previous one: the fences are counted
		// before and after the messages, and the higher count is taken, so that a fence
		// written in between never passes for an event.
		before, err := streamFences(ctx, s)
		if err != nil {
			return false
		}
		info, err := s.Info(ctx)
		if err != nil {
			return false
		}
		after, err := streamFences(ctx, s)
		if err != nil {
			return false
		}
		fences := max(before, after)
		held = info.State.Msgs - min(fences, info.State.Msgs)
		return held >= uint64(n)
	}, within, 20*time.Millisecond, "stream %s never reached %d messages", stream, n)
	return held
}

// readStream returns every message stream holds, in order. The turns stream is a work queue,
// where an ordered consumer (ack none) is refused: it reads with a pull consumer of its own
// that never acknowledges, so nothing is deleted, and deletes it afterwards. No other consumer
// may exist on a work queue's subjects meanwhile (the relay tests run no workers); a test that
// has one reads with testsvc.StreamMsgs instead.
func (b *bundle) readStream(t *testing.T, stream string) []got {
	t.Helper()
	ctx := ctxT(t, 2*time.Minute)
	s, err := b.js.Stream(ctx, stream)
	require.NoError(t, err)
	info, err := s.Info(ctx)
	require.NoError(t, err)
	total := int(info.State.Msgs)
	if total == 0 {
		return nil
	}
	// A cluster's stream may not answer a consumer request at once (a leader election).
	var cons jetstream.Consumer
	require.Eventually(t, func() bool {
		cons, err = s.CreateConsumer(ctx, jetstream.ConsumerConfig{AckPolicy: jetstream.AckExplicitPolicy, AckWait: time.Hour,
			MaxAckPending: -1, DeliverPolicy: jetstream.DeliverAllPolicy, InactiveThreshold: time.Minute})
		return !errors.Is(err, nats.ErrNoResponders)
	}, 30*time.Second, 50*time.Millisecond, "no answer to the consumer request")
	require.NoError(t, err)
	defer func() { require.NoError(t, s.DeleteConsumer(ctx, cons.CachedInfo().Name)) }()
	var out []got
	// A new consumer of a cluster's stream may answer a pull with "no responders" until its
	// leader is elected (seen in CI on an R3 stream): such a pull is made again, bounded.
	deadline := time.Now().Add(30 * time.Second)
	for read := 0; read < total; {
		batch, err := cons.Fetch(min(total-read, 1000), jetstream.FetchMaxWait(5*time.Second))
		require.NoError(t, err)
		for m := range batch.Messages() {
			read++
			if wire.IsFenceSubject(m.Subject()) {
				continue // the relay's fence, not an event
			}
			md, err := m.Metadata()
			require.NoError(t, err)
			out = append(out, got{seq: md.Sequence.Stream, stored: md.Timestamp, subject: m.Subject(), header: m.Headers(), data: m.Data()})
		}
		if errors.Is(batch.Error(), nats.ErrNoResponders) && time.Now().Before(deadline) {
			time.Sleep(50 * time.Millisecond)
			continue
		}
		require.NoError(t, batch.Error())
	}
	return out
}

// fenceMsgs returns how many fence messages stream s holds (one per slot and stream): the
// prefixes of the relay tests are one token.
func fenceMsgs(ctx context.Context, t *testing.T, s jetstream.Stream) uint64 {
	t.Helper()
	n, err := streamFences(ctx, s)
	require.NoError(t, err)
	return n
}

// streamFences is fenceMsgs for a condition polled until it holds: a replicated stream's API
// may not answer for a moment ("no responders" while its leader moves), which is "not yet".
func streamFences(ctx context.Context, s jetstream.Stream) (uint64, error) {
	info, err := s.Info(ctx, jetstream.WithSubjectFilter("*."+wire.KindFence+".>"))
	if err != nil {
		return 0, err
	}
	var n uint64
	for _, c := range info.State.Subjects {
		n += c
	}
	return n, nil
}

// assertExactlyOnceInOrder checks that the turns stream holds each outbox id once, and that
// within each conversation they appear in increasing id order (each test producer commits a
// conversation's rows one after another, so id order is commit order there).
func assertExactlyOnceInOrder(t *testing.T, msgs []got, want map[int64]string) {
	t.Helper()
	seen := map[int64]bool{}
	last := map[string]int64{}
	for _, m := range msgs {
		id, err := strconv.ParseInt(m.header.Get(wire.HeaderOutboxID), 10, 64)
		require.NoError(t, err)
		require.False(t, seen[id], "outbox id %d published twice", id)
		seen[id] = true
		conv, ok := want[id]
		require.True(t, ok, "unexpected outbox id %d", id)
		require.Greater(t, id, last[conv], "conversation %s: outbox %d after %d", conv, id, last[conv])
		last[conv] = id
	}
	require.Len(t, seen, len(want), "every outbox id exactly once")
}

func TestRelaysTenThousandRowsInOrder(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := ctxT(t, 3*time.Minute)
	const convs, perConv = 100, 100
	ids := make([]string, convs)
	for i := range ids {
		ids[i] = fmt.Sprintf("conv-%03d", i)
	}
	createConversations(t, b.db.Pool, ids...)
	b.start(t)

	want := map[int64]string{}
	var mu sync.Mutex
	var wg sync.WaitGroup
	for w := range 8 {
		wg.Go(func() {
			for c := w; c < convs; c += 8 {
				for i := range perConv {
					id, err := send(ctx, b.db.Pool, ids[c], fmt.Sprintf("%s-m%03d", ids[c], i))
					if !assertNoError(t, err) {
						return
					}
					mu.Lock()
					want[id] = ids[c]
					mu.Unlock()
				}
			}
		})
	}
	wg.Wait()
	msgs := b.waitStream(t, "AGENT_TURNS", convs*perConv, 2*time.Minute)
	assertExactlyOnceInOrder(t, msgs, want)

	// Headers and body as DESIGN.md specifies.
	m := msgs[0]
	id, _ := strconv.ParseInt(m.header.Get(wire.HeaderOutboxID), 10, 64)
	var ev wire.TurnEvent
	require.NoError(t, json.Unmarshal(m.data, &ev))
	require.Equal(t, id, ev.OutboxID)
	require.Equal(t, want[id], ev.ConversationID)
	require.Equal(t, "pending", ev.Status)
	require.Zero(t, ev.Attempts)
	require.WithinDuration(t, time.Now(), ev.CreatedAt, 5*time.Minute)
	require.Equal(t, ev.ConversationID, m.header.Get(wire.HeaderConversationID))
	require.Equal(t, ev.MessageID, m.header.Get(wire.HeaderMessageID))
	require.Equal(t, wire.TurnMsgID(id), m.header.Get(nats.MsgIdHdr))
	wantSubj, _ := wire.TurnSubject("agent", ev.ConversationID)
	require.Equal(t, wantSubj, m.subject)
	require.NotContains(t, string(m.data), "hello", "the turn event carries no message content")

	// The slot is confirmed up to the end: nothing held.
	requireSlotCaughtUp(t, b)
}

func assertNoError(t *testing.T, err error) bool {
	t.Helper()
	if err != nil {
		t.Error(err)
		return false
	}
	return true
}

// requireSlotCaughtUp waits until the slot's confirmed_flush_lsn reaches the current WAL
// insert position as of the call.
func requireSlotCaughtUp(t *testing.T, b *bundle) {
	t.Helper()
	ctx := ctxT(t, time.Minute)
	var target string
	require.NoError(t, b.db.Pool.QueryRow(ctx, `SELECT pg_current_wal_insert_lsn()::text`).Scan(&target))
	require.Eventually(t, func() bool {
		var ok bool
		err := b.db.Pool.QueryRow(ctx, `SELECT confirmed_flush_lsn >= $2::pg_lsn FROM pg_replication_slots WHERE slot_name = $1`,
			b.cfg.Slot, target).Scan(&ok)
		return err == nil && ok
	}, 30*time.Second, 20*time.Millisecond, "slot never confirmed %s", target)
}

func TestBackfillPublishesExistingRowsOnce(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := ctxT(t, 3*time.Minute)
	convs := []string{"a", "b", "c", "d", "e"}
	createConversations(t, b.db.Pool, convs...)
	want := map[int64]string{}
	// 1,000 rows from the polling era, some already claimed, some finished.
	for i := range 1000 {
		c := convs[i%len(convs)]
		id, err := send(ctx, b.db.Pool, c, fmt.Sprintf("old-%d", i))
		require.NoError(t, err)
		want[id] = c
	}
	_, err := b.db.Pool.Exec(ctx, `UPDATE agent_outbox SET status = 'processing' WHERE id % 10 = 1`)
	require.NoError(t, err)
	var done []int64
	require.NoError(t, b.db.Pool.QueryRow(ctx, `WITH d AS (UPDATE agent_outbox SET status = 'done' WHERE id % 10 = 2 RETURNING id)
		SELECT array_agg(id) FROM d`).Scan(&done))
	for _, id := range done {
		delete(want, id) // finished work is not replayed
	}

	// Writers keep committing while the relay creates its slot and backfills.
	stop := make(chan struct{})
	var wg sync.WaitGroup
	var mu sync.Mutex
	for w := range 3 {
		wg.Go(func() {
			for i := 0; ; i++ {
				select {
				case <-stop:
					return
				default:
				}
				c := convs[w]
				id, err := send(ctx, b.db.Pool, c, fmt.Sprintf("new-%d-%d", w, i))
				if !assertNoError(t, err) {
					return
				}
				mu.Lock()
				want[id] = c
				mu.Unlock()
			}
		})
	}
	r := b.start(t)
	require.Eventually(t, r.Active, time.Minute, 10*time.Millisecond)
	// Let the writers run into streaming too.
	before := len(b.readStream(t, "AGENT_TURNS"))
	require.Eventually(t, func() bool { return len(b.readStream(t, "AGENT_TURNS")) > before+200 }, time.Minute, 50*time.Millisecond)
	close(stop)
	wg.Wait()

	msgs := b.waitStream(t, "AGENT_TURNS", len(want), time.Minute)
	// Backfill order is id order; rows of one conversation committed in id order here.
	assertExactlyOnceInOrder(t, msgs, want)

	var rows int64
	require.NoError(t, b.db.Pool.QueryRow(ctx, `SELECT backfill_rows FROM baton_relay_slots WHERE slot_name = $1`, b.cfg.Slot).Scan(&rows))
	require.GreaterOrEqual(t, rows, int64(1000-len(done)))
}

func TestHostileConversationIDs(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := ctxT(t, 2*time.Minute)
	long := ""
	for len(long) < 200 {
		long += "x"
	}
	emojiLong := ""
	for len(emojiLong)+4 <= 200 {
		emojiLong += "🙂"
	}
	encodedLooking := "~YWJj"
	hostile := []string{"a.b", "*", ">", "a b", " ", "🙂", long, emojiLong, encodedLooking, "YWJj", "abc",
		"agent.turns.x", "tab\there", "new\nline", "a.*", "x>"}
	createConversations(t, b.db.Pool, hostile...)
	b.startActive(t)
	want := map[int64]string{}
	for i, c := range hostile {
		id, err := send(ctx, b.db.Pool, c, fmt.Sprintf("m%d", i))
		require.NoError(t, err)
		want[id] = c
	}
	msgs := b.waitStream(t, "AGENT_TURNS", len(hostile), time.Minute)
	assertExactlyOnceInOrder(t, msgs, want)
	subjects := map[string]string{}
	for _, m := range msgs {
		var ev wire.TurnEvent
		require.NoError(t, json.Unmarshal(m.data, &ev))
		require.Equal(t, want[ev.OutboxID], ev.ConversationID, "body carries the exact id")
		kind, conv, err := wire.ParseSubject("agent", m.subject)
		require.NoError(t, err, "subject %q", m.subject)
		require.Equal(t, wire.KindTurns, kind)
		require.Equal(t, ev.ConversationID, conv, "subject %q decodes to its own conversation", m.subject)
		prev, dup := subjects[m.subject]
		require.False(t, dup, "conversations %q and %q share subject %q", prev, conv, m.subject)
		subjects[m.subject] = conv
	}

	// A reader of one conversation's subject sees only its own events: the stream's last
	// message on that subject is that conversation's, and the only one.
	s, err := b.js.Stream(ctx, "AGENT_TURNS")
	require.NoError(t, err)
	for _, c := range hostile {
		subj, err := wire.TurnSubject("agent", c)
		require.NoError(t, err)
		m, err := s.GetLastMsgForSubject(ctx, subj)
		require.NoError(t, err, "conversation %q", c)
		var ev wire.TurnEvent
		require.NoError(t, json.Unmarshal(m.Data, &ev))
		require.Equal(t, c, ev.ConversationID)
		info, err := s.Info(ctx, jetstream.WithSubjectFilter(subj))
		require.NoError(t, err)
		require.Equal(t, map[string]uint64{subj: 1}, info.State.Subjects, "conversation %q", c)
	}
}

func TestLargeOutcomeIsFlaggedNotDropped(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := ctxT(t, 2*time.Minute)
	createConversations(t, b.db.Pool, "big")
	b.startActive(t)
	big := make([]byte, 5<<20)
	for i := range big {
		big[i] = 'a' + byte(i%26)
	}
	_, err := b.db.Pool.Exec(ctx, `INSERT INTO messages (id, conversation_id, role, content) VALUES
		('r-big', 'big', 'assistant', $1), ('r-small', 'big', 'assistant', 'fine'), ('u1', 'big', 'user', 'not an outcome')`, string(big))
	require.NoError(t, err)
	// The relay keeps flowing: a later turn still arrives.
	_, err = send(ctx, b.db.Pool, "big", "after")
	require.NoError(t, err)

	outcomes := b.waitStream(t, "AGENT_OUTCOMES", 2, time.Minute)
	require.Len(t, outcomes, 2, "user messages are not outcomes")
	var first, second wire.OutcomeEvent
	require.NoError(t, json.Unmarshal(outcomes[0].data, &first))
	require.NoError(t, json.Unmarshal(outcomes[1].data, &second))
	require.Equal(t, "r-big", first.MessageID)
	require.True(t, first.ContentOmitted)
	require.Empty(t, first.Content)
	require.Equal(t, len(big), first.ContentBytes)
	require.Equal(t, "true", outcomes[0].header.Get(wire.HeaderContentOmitted))
	require.Equal(t, "assistant", first.Role)
	require.Equal(t, "r-small", second.MessageID)
	require.Equal(t, "fine", second.Content)
	require.False(t, second.ContentOmitted)
	b.waitStream(t, "AGENT_TURNS", 1, time.Minute)
}

func TestOutcomeCarriesAnsweredOutboxIDs(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := ctxT(t, time.Minute)
	createConversations(t, b.db.Pool, "c")
	b.startActive(t)
	id1, err := send(ctx, b.db.Pool, "c", "u1")
	require.NoError(t, err)
	id2, err := send(ctx, b.db.Pool, "c", "u2")
	require.NoError(t, err)
	tx, err := b.db.Pool.Begin(ctx)
	require.NoError(t, err)
	_, err = tx.Exec(ctx, `SELECT pg_logical_emit_message(true, $1, $2)`, wire.AnswersPrefix,
		fmt.Sprintf(`{"message_id":"r1","outbox_ids":[%d,%d]}`, id1, id2))
	require.NoError(t, err)
	_, err = tx.Exec(ctx, `INSERT INTO messages (id, conversation_id, role, content) VALUES ('r1', 'c', 'assistant', 'hi')`)
	require.NoError(t, err)
	require.NoError(t, tx.Commit(ctx))
	outcomes := b.waitStream(t, "AGENT_OUTCOMES", 1, 30*time.Second)
	var ev wire.OutcomeEvent
	require.NoError(t, json.Unmarshal(outcomes[0].data, &ev))
	require.Equal(t, []int64{id1, id2}, ev.OutboxIDs)
	require.Equal(t, fmt.Sprintf("%d,%d", id1, id2), outcomes[0].header.Get(wire.HeaderOutboxID))
}

func TestSetupErrorsAreClear(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := ctxT(t, time.Minute)
	_, err := b.db.Pool.Exec(ctx, `DROP PUBLICATION baton`)
	require.NoError(t, err)
	r, err := relay.New(b.cfg)
	require.NoError(t, err)
	err = r.Run(ctx)
	require.ErrorIs(t, err, relay.ErrSetup)
	require.ErrorContains(t, err, `publication "baton" does not exist`)

	// A stream that exists with settings the relay cannot work with is named, not overwritten.
	_, err = b.db.Pool.Exec(ctx, `CREATE PUBLICATION baton FOR TABLE agent_outbox, messages WITH (publish = 'insert')`)
	require.NoError(t, err)
	_, err = b.js.CreateStream(ctx, jetstream.StreamConfig{Name: "AGENT_TURNS", Subjects: []string{"agent.turns.>"},
		Storage: jetstream.MemoryStorage})
	require.NoError(t, err)
	r, err = relay.New(b.cfg)
	require.NoError(t, err)
	err = r.Run(ctx)
	require.ErrorIs(t, err, relay.ErrSetup)
	require.ErrorContains(t, err, "storage Memory")

	_, err = relay.New(relay.Config{DatabaseURL: "x", NATS: b.nc, SubjectPrefix: "a.>"})
	require.ErrorIs(t, err, relay.ErrConfig)
	_, err = relay.New(relay.Config{DatabaseURL: "x", NATS: b.nc, Slot: "Bad-Slot"})
	require.ErrorIs(t, err, relay.ErrConfig)
	require.True(t, errors.Is(err, relay.ErrConfig))
}
