package badinput

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"github.com/jackc/pgx/v5/pgxpool"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/stretchr/testify/require"

	"github.com/batonhq/baton/internal/testsvc"
	"github.com/batonhq/baton/producer"
	"github.com/batonhq/baton/wire"
)

// system is one whole Baton for one test: its own database, NATS server and slot, `baton
// relay` and one echoagent worker as processes, and a producer.
type system struct {
	t       *testing.T
	db      *testsvc.Database
	natsURL string
	nc      *nats.Conn
	js      jetstream.JetStream
	prod    *producer.Producer
	app     *pgxpool.Pool // the producer's: roles.sql's app role, as deployed
	relay   *testsvc.Process
	worker  *testsvc.Process
	// turns holds every turn event the relay published, as a core NATS subscription to the
	// turn subjects sees them (options.watchTurns): the turns stream is a work queue that
	// deletes what the worker acknowledged, and no consumer besides the worker's may read it.
	turns *turnWatch
}

// turnWatch records the messages published on the turn subjects.
type turnWatch struct {
	mu   sync.Mutex
	msgs []*nats.Msg
}

// watchTurns subscribes to every turn subject on nc until the test ends.
func watchTurns(t *testing.T, nc *nats.Conn) *turnWatch {
	t.Helper()
	w := &turnWatch{}
	sub, err := nc.Subscribe(wire.StreamFilter(wire.DefaultSubjectPrefix, wire.KindTurns), func(m *nats.Msg) {
		w.mu.Lock()
		w.msgs = append(w.msgs, m)
		w.mu.Unlock()
	})
	require.NoError(t, err)
	require.NoError(t, sub.SetPendingLimits(-1, -1))
	require.NoError(t, nc.Flush())
	t.Cleanup(func() { _ = sub.Unsubscribe() })
	return w
}

// published returns the turn events published so far, replays included.
func (w *turnWatch) published() []*nats.Msg {
	w.mu.Lock()
	defer w.mu.Unlock()
	return append([]*nats.Msg(nil), w.msgs...)
}

// publishedTurns returns the turn events the relay published, once per Nats-Msg-Id (a replay
// the stream dropped as a duplicate is left out), in the order first seen, numbered from 1 in
// Sequence. It stands for reading AGENT_TURNS, a work queue whose events are gone once the
// worker acknowledged them.
func (s *system) publishedTurns() []*jetstream.RawStreamMsg {
	require.NotNil(s.t, s.turns, "start the system with options.watchTurns")
	var out []*jetstream.RawStreamMsg
	seen := map[string]bool{}
	for _, m := range s.turns.published() {
		id := m.Header.Get(nats.MsgIdHdr)
		if seen[id] {
			continue
		}
		seen[id] = true
		out = append(out, &jetstream.RawStreamMsg{Subject: m.Subject, Sequence: uint64(len(out) + 1), Header: m.Header, Data: m.Data})
	}
	return out
}

// options change what start builds.
type options struct {
	// maxPayload, when set, runs a NATS server of the test's own with that max_payload
	// instead of testsvc's (1 MiB).
	maxPayload int32
	// maxContentBytes is the producer's Config.MaxContentBytes (0: its default, 1 MiB).
	maxContentBytes int
	// watchTurns subscribes to the turn subjects (see publishedTurns). The subscription
	// answers for the subjects: a publish to a deleted turns stream then gets no PubAck
	// instead of "no responders".
	watchTurns bool
}

// start brings up the system and waits until the relay streams and the worker consumes.
func start(t *testing.T, o options) *system {
	t.Helper()
	s := &system{t: t, db: testsvc.NewDatabase(t)}
	if o.maxPayload > 0 {
		s.natsURL = startNATS(t, o.maxPayload)
	} else {
		s.natsURL = testsvc.StartNATS(t).URL()
	}
	nc, err := nats.Connect(s.natsURL, nats.MaxReconnects(-1), nats.ReconnectWait(50*time.Millisecond))
	require.NoError(t, err)
	t.Cleanup(nc.Close)
	s.nc = nc
	s.js, err = jetstream.New(nc)
	require.NoError(t, err)
	if o.watchTurns {
		s.turns = watchTurns(t, nc)
	}
	s.prod, err = producer.New(producer.Config{MaxContentBytes: o.maxContentBytes})
	s.app = s.db.RolePool(t, testsvc.RoleApp)
	require.NoError(t, err)
	s.relay = s.startRelay()
	s.relay.WaitLog(t, `"msg":"streaming"`, time.Minute)
	s.worker = s.startProcess("worker", testsvc.RoleWorker, testsvc.Binary(t, "github.com/batonhq/baton/examples/echoagent"))
	s.worker.WaitLog(t, `"msg":"echoagent started"`, time.Minute)
	return s
}

// startRelay starts `baton relay` on the test's database, NATS server and slot.
func (s *system) startRelay() *testsvc.Process {
	return s.startProcess("relay", testsvc.RoleRelay, testsvc.Binary(s.t, "github.com/batonhq/baton/cmd/baton"), "relay")
}

// startNATS starts a NATS server with JetStream and the given max_payload, stopped when the
// test ends.
func startNATS(t *testing.T, maxPayload int32) string {
	t.Helper()
	srv, err := server.NewServer(&server.Options{
		ServerName: "badinput",
		Host:       "127.0.0.1",
		Port:       -1,
		JetStream:  true,
		StoreDir:   t.TempDir(),
		MaxPayload: maxPayload,
		NoSigs:     true,
		NoLog:      true,
	})
	require.NoError(t, err)
	go srv.Start()
	require.True(t, srv.ReadyForConnections(30*time.Second), "nats server not ready")
	t.Cleanup(func() {
		srv.Shutdown()
		srv.WaitForShutdown()
	})
	return srv.ClientURL()
}

// startProcess starts bin with args on the system's database, logged in as role (as deployed),
// and NATS server. The test's cleanup stops it with SIGTERM and requires a clean exit.
func (s *system) startProcess(name string, role testsvc.Role, bin string, args ...string) *testsvc.Process {
	return testsvc.StartProcess(s.t, name, bin, []string{
		"BATON_DATABASE_URL=" + s.db.RoleURL(role),
		"BATON_NATS_URL=" + s.natsURL,
		"BATON_SLOT=" + s.db.Name, // slots are cluster-wide: one per test
		"BATON_METRICS_ADDR=",
		"BATON_LOG_LEVEL=info",
		"BATON_LOG_FORMAT=json",
	}, args...)
}

// ctx returns a context ending after d or with the test.
func ctxFor(t *testing.T, d time.Duration) context.Context {
	ctx, cancel := context.WithTimeout(t.Context(), d)
	t.Cleanup(cancel)
	return ctx
}

// conversation creates a conversation through the producer.
func (s *system) conversation(id string) {
	s.t.Helper()
	_, err := s.prod.CreateConversation(ctxFor(s.t, 30*time.Second), s.app, id)
	require.NoError(s.t, err, "create conversation %q", id)
}

// send sends a user message through the producer and requires it accepted.
func (s *system) send(conv, id, content string) {
	s.t.Helper()
	_, err := s.prod.Send(ctxFor(s.t, 30*time.Second), s.app, producer.Message{ConversationID: conv, ID: id, Content: content})
	require.NoError(s.t, err, "send %q to %q", id, conv)
}

// answer is how an accepted message ended: its outbox row's status and the message that
// answered it.
type answer struct {
	status, lastError    string
	replyID, role, reply string
}

// awaitAnswer waits until the outbox row of message id is terminal (done or error) and
// returns it with its reply.
func (s *system) awaitAnswer(id string, within time.Duration) answer {
	t := s.t
	t.Helper()
	ctx := ctxFor(t, within+10*time.Second)
	var a answer
	require.Eventually(t, func() bool {
		err := s.db.Pool.QueryRow(ctx, `SELECT o.status, coalesce(o.last_error, ''), coalesce(o.reply_id, ''),
				coalesce(m.role, ''), coalesce(m.content, '')
			FROM agent_outbox o LEFT JOIN messages m ON m.id = o.reply_id WHERE o.message_id = $1`, id).
			Scan(&a.status, &a.lastError, &a.replyID, &a.role, &a.reply)
		return err == nil && (a.status == "done" || a.status == "error")
	}, within, 20*time.Millisecond, "message %q never answered (last seen %+v)", id, a)
	return a
}

// requireAllAnswered waits until every accepted message has a terminal outbox row with a
// reply, and every reply (assistant or error message) is in the outcomes stream: nothing
// accepted was lost.
func (s *system) requireAllAnswered(within time.Duration) { s.requireAnswered(within, time.Time{}) }

// requireAnswered is requireAllAnswered for a test that deleted the outcomes stream: only the
// replies created after since must be in it.
func (s *system) requireAnswered(within time.Duration, since time.Time) {
	t := s.t
	t.Helper()
	ctx := ctxFor(t, within+10*time.Second)
	var open []string
	defer func() {
		if t.Failed() {
			t.Logf("unanswered: %d, first %q", len(open), open[:min(len(open), 10)])
		}
	}()
	require.Eventually(t, func() bool {
		rows, err := s.db.Pool.Query(ctx, `SELECT message_id FROM agent_outbox
			WHERE status NOT IN ('done', 'error') OR reply_id IS NULL ORDER BY id`)
		if err != nil {
			return false
		}
		open = open[:0]
		for rows.Next() {
			var id string
			if rows.Scan(&id) == nil {
				open = append(open, id)
			}
		}
		rows.Close()
		return rows.Err() == nil && len(open) == 0
	}, within, 20*time.Millisecond, "accepted messages never answered")
	replies := testsvc.Query[string](t, s.db, `SELECT id FROM messages WHERE role IN ('assistant', 'error') AND created_at > $1`, since)
	require.Eventually(t, func() bool {
		msgs, err := s.tryReadStream("AGENT_OUTCOMES")
		if err != nil {
			return false
		}
		published := map[string]bool{}
		for _, m := range msgs {
			var ev wire.OutcomeEvent
			if json.Unmarshal(m.Data, &ev) == nil {
				published[ev.MessageID] = true
			}
		}
		for _, id := range replies {
			if !published[id] {
				return false
			}
		}
		return true
	}, within, 50*time.Millisecond, "replies committed in Postgres since %v never reached the outcomes stream", since)
}

// requireFlowing proves the relay and the worker still serve other conversations: a new
// message on a new, plain conversation gets its echo reply and its outcome event.
func (s *system) requireFlowing(tag string) {
	t := s.t
	t.Helper()
	conv := "flowing-" + tag
	s.conversation(conv)
	s.send(conv, conv+"-m", "still there?")
	a := s.awaitAnswer(conv+"-m", time.Minute)
	require.Equal(t, "done", a.status, "a plain message after %s: %+v", tag, a)
	require.Equal(t, "echo: still there?", a.reply)
	s.awaitOutcome(a.replyID, time.Minute)
	s.relay.RequireRunning(t)
	s.worker.RequireRunning(t)
}

// awaitOutcome waits for the outcome event of reply message id and returns it.
func (s *system) awaitOutcome(id string, within time.Duration) (wire.OutcomeEvent, *jetstream.RawStreamMsg) {
	t := s.t
	t.Helper()
	var ev wire.OutcomeEvent
	var found *jetstream.RawStreamMsg
	require.Eventually(t, func() bool {
		msgs, err := s.tryReadStream("AGENT_OUTCOMES")
		if err != nil {
			return false
		}
		for _, m := range msgs {
			var e wire.OutcomeEvent
			if json.Unmarshal(m.Data, &e) == nil && e.MessageID == id {
				ev, found = e, m
				return true
			}
		}
		return false
	}, within, 50*time.Millisecond, "no outcome event for reply %q", id)
	return ev, found
}

// readStream returns every message stream holds now (none when it does not exist).
func (s *system) readStream(name string) []*jetstream.RawStreamMsg {
	s.t.Helper()
	msgs, err := s.tryReadStream(name)
	require.NoError(s.t, err)
	return msgs
}

// tryReadStream is readStream for conditions polled by require.Eventually, which must not
// fail the test from their goroutine.
func (s *system) tryReadStream(name string) ([]*jetstream.RawStreamMsg, error) {
	ctx, cancel := context.WithTimeout(s.t.Context(), 30*time.Second)
	defer cancel()
	st, err := s.js.Stream(ctx, name)
	if errors.Is(err, jetstream.ErrStreamNotFound) {
		return nil, nil
	}
	if err != nil {
		return nil, fmt.Errorf("stream %s: %w", name, err)
	}
	info, err := st.Info(ctx)
	if err != nil {
		return nil, fmt.Errorf("stream %s: %w", name, err)
	}
	var out []*jetstream.RawStreamMsg
	for seq := info.State.FirstSeq; info.State.Msgs > 0 && seq <= info.State.LastSeq; seq++ {
		m, err := st.GetMsg(ctx, seq)
		if errors.Is(err, jetstream.ErrMsgNotFound) {
			continue
		}
		if err != nil {
			return nil, fmt.Errorf("stream %s seq %d: %w", name, seq, err)
		}
		if wire.IsFenceSubject(m.Subject) {
			continue // the relay's fence, not an event
		}
		out = append(out, m)
	}
	return out, nil
}

// dbNow returns the database's clock.
func (s *system) dbNow() time.Time {
	s.t.Helper()
	now := testsvc.Query[time.Time](s.t, s.db, `SELECT clock_timestamp()`)
	return now[0]
}

// requireNoErrorLogs fails the test when a process logged at ERROR.
func requireNoErrorLogs(t *testing.T, ps ...*testsvc.Process) {
	t.Helper()
	for _, p := range ps {
		for _, l := range p.LogLines() {
			require.NotContains(t, l, `"level":"ERROR"`, "%s logged an error", p.Name)
		}
	}
}

// filled returns n bytes of printable text.
func filled(n int) string {
	b := make([]byte, n)
	for i := range b {
		b[i] = 'a' + byte(i%26)
	}
	return string(b)
}

// count returns the first column of a single-row query as an int.
func (s *system) count(sql string, args ...any) int {
	s.t.Helper()
	n := testsvc.Query[int](s.t, s.db, sql, args...)
	require.Len(s.t, n, 1)
	return n[0]
}
