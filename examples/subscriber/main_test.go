package main

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"os"
	"os/exec"
	"regexp"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/stretchr/testify/require"

	"github.com/batonhq/baton/consumer"
	"github.com/batonhq/baton/internal/testsvc"
	"github.com/batonhq/baton/producer"
	"github.com/batonhq/baton/relay"
	"github.com/batonhq/baton/wire"
)

func TestMain(m *testing.M) { os.Exit(testsvc.MainNoLeaks(m)) }

// subscriberBinary is this package's program, built once per test binary and run as a process.
func subscriberBinary(t *testing.T) string {
	return testsvc.Binary(t, "github.com/batonhq/baton/examples/subscriber")
}

// subscriberProcess is the subscriber running as a child process.
type subscriberProcess struct {
	cmd            *exec.Cmd
	stdout, stderr testsvc.Buffer
	exited         chan struct{}
	err            error // Wait's result, set before exited is closed
}

// startSubscriber runs the subscriber against natsURL. stop (also run at cleanup) ends it
// with SIGTERM and requires a clean exit.
func startSubscriber(t *testing.T, natsURL string, args ...string) *subscriberProcess {
	t.Helper()
	p := &subscriberProcess{cmd: exec.Command(subscriberBinary(t), args...), exited: make(chan struct{})}
	for _, kv := range os.Environ() {
		if !strings.HasPrefix(kv, "BATON_") {
			p.cmd.Env = append(p.cmd.Env, kv)
		}
	}
	p.cmd.Env = append(p.cmd.Env, "BATON_NATS_URL="+natsURL, "BATON_LOG_LEVEL=debug")
	p.cmd.Stdout, p.cmd.Stderr = &p.stdout, &p.stderr
	require.NoError(t, p.cmd.Start())
	go func() {
		p.err = p.cmd.Wait() // returns after stdout and stderr were copied
		close(p.exited)
	}()
	t.Cleanup(func() { p.stop(t) })
	return p
}

// stop sends SIGTERM, waits for the exit and returns the printed lines.
func (p *subscriberProcess) stop(t *testing.T) []string {
	t.Helper()
	select {
	case <-p.exited:
	default:
		_ = p.cmd.Process.Signal(syscall.SIGTERM)
		select {
		case <-p.exited:
		case <-time.After(30 * time.Second):
			_ = p.cmd.Process.Kill()
			<-p.exited
			t.Errorf("subscriber %v did not stop within 30s of SIGTERM", p.cmd.Args)
		}
	}
	require.NoError(t, p.err, "subscriber %v exited uncleanly; stderr:\n%s", p.cmd.Args, p.stderr.String())
	out := strings.TrimSuffix(p.stdout.String(), "\n")
	if out == "" {
		return nil
	}
	return strings.Split(out, "\n")
}

var lineRE = regexp.MustCompile(`^seq=(\d+) conversation=(\S+) role=(assistant|error) message=(\S+) answers=(\S+) content=(".*"|\(omitted: \d+ bytes\))$`)

type line struct{ seq, conversation, role, message, answers, content string }

func parseLines(t *testing.T, lines []string) []line {
	t.Helper()
	out := make([]line, len(lines))
	for i, l := range lines {
		m := lineRE.FindStringSubmatch(l)
		require.NotNil(t, m, "unexpected line %q", l)
		out[i] = line{m[1], m[2], m[3], m[4], m[5], m[6]}
	}
	return out
}

// messageIDs returns the printed message ids, requiring each at most once.
func messageIDs(t *testing.T, lines []line) []string {
	t.Helper()
	seen := map[string]bool{}
	var ids []string
	for _, l := range lines {
		require.False(t, seen[l.message], "message %s printed twice", l.message)
		seen[l.message] = true
		ids = append(ids, l.message)
	}
	return ids
}

// bundle is a live Baton: database, NATS, relay and an echo worker.
type bundle struct {
	t    *testing.T
	db   *testsvc.Database
	ns   *testsvc.NATS
	nc   *nats.Conn
	js   jetstream.JetStream
	prod *producer.Producer
}

func setup(t *testing.T) *bundle {
	t.Helper()
	b := &bundle{t: t, db: testsvc.NewDatabase(t), ns: testsvc.StartNATS(t)}
	nc, err := nats.Connect(b.ns.URL(), nats.MaxReconnects(-1))
	require.NoError(t, err)
	t.Cleanup(nc.Close)
	b.nc = nc
	b.js, err = jetstream.New(nc)
	require.NoError(t, err)
	b.prod, err = producer.New(producer.Config{})
	require.NoError(t, err)

	discard := slog.New(slog.NewTextHandler(io.Discard, nil))
	r, err := relay.New(relay.Config{DatabaseURL: b.db.RoleURL(testsvc.RoleRelay), NATS: nc, Slot: b.db.Name,
		StatusInterval: 100 * time.Millisecond, Logger: discard})
	require.NoError(t, err)
	b.background("relay", r.Run)
	require.Eventually(t, r.Active, time.Minute, 5*time.Millisecond, "relay never became active")

	w, err := consumer.New(consumer.Config{Pool: b.db.RolePool(t, testsvc.RoleWorker), NATS: nc, Logger: discard,
		Handler: func(_ context.Context, turn *consumer.Turn) (consumer.Reply, error) {
			return consumer.Reply{Content: "echo: " + turn.Messages[0].Content}, nil
		}})
	require.NoError(t, err)
	b.background("worker", w.Run)
	return b
}

// background runs fn until the test ends.
func (b *bundle) background(what string, fn func(context.Context) error) {
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- fn(ctx) }()
	b.t.Cleanup(func() {
		cancel()
		select {
		case err := <-done:
			require.NoError(b.t, err, what)
		case <-time.After(30 * time.Second):
			b.t.Errorf("%s did not stop within 30s", what)
		}
	})
}

func (b *bundle) ctx() context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	b.t.Cleanup(cancel)
	return ctx
}

// send commits a user message; the worker answers it and the relay publishes the reply.
func (b *bundle) send(conv, id string) int64 {
	res, err := b.prod.Send(b.ctx(), b.db.Pool, producer.Message{ConversationID: conv, ID: id, Content: "hello " + id})
	require.NoError(b.t, err)
	return res.OutboxID
}

// waitOutcomes waits until the outcomes stream holds n messages.
func (b *bundle) waitOutcomes(n uint64) jetstream.StreamState {
	b.t.Helper()
	var state jetstream.StreamState
	var events uint64
	require.Eventually(b.t, func() bool {
		s, err := b.js.Stream(b.ctx(), "AGENT_OUTCOMES")
		if err != nil {
			return false
		}
		state = s.CachedInfo().State
		events, err = wire.StreamEvents(b.ctx(), s, "agent", wire.KindOutcomes) // not the relay's fence
		return err == nil && events >= n
	}, time.Minute, 10*time.Millisecond, "outcomes stream never reached %d outcomes", n)
	require.Equal(b.t, n, events)
	return state
}

// waitHandled waits until durable acked every message of the outcomes stream: everything was
// printed (or skipped) and the lines are written.
func (b *bundle) waitHandled(durable string) {
	b.t.Helper()
	require.Eventually(b.t, func() bool {
		c, err := b.js.Consumer(b.ctx(), "AGENT_OUTCOMES", durable)
		if err != nil {
			return false
		}
		info := c.CachedInfo()
		s, err := b.js.Stream(b.ctx(), "AGENT_OUTCOMES")
		if err != nil || info.NumPending != 0 || info.NumAckPending != 0 {
			return false
		}
		// The stream's last outcome, not its last message: the relay's fence is one of those.
		last, err := s.GetLastMsgForSubject(b.ctx(), "agent.outcomes.>")
		return err == nil && info.AckFloor.Stream == last.Sequence
	}, time.Minute, 20*time.Millisecond, "durable %s never acked the whole stream", durable)
}

// reply returns the id of the n-th (from 1) reply or error message of conv, waiting for it:
// the relay may publish a commit a moment before other sessions see it.
func (b *bundle) reply(conv string, n int) string {
	b.t.Helper()
	var id string
	require.Eventually(b.t, func() bool {
		err := b.db.Pool.QueryRow(b.ctx(), `SELECT id FROM messages WHERE conversation_id = $1 AND role <> 'user'
			ORDER BY created_at, id OFFSET $2 LIMIT 1`, conv, n-1).Scan(&id)
		return err == nil
	}, 10*time.Second, 10*time.Millisecond, "conversation %s has no reply %d", conv, n)
	return id
}

func TestSubscriberPrintsEachOutcomeOnceAndReplaysFromTime(t *testing.T) {
	t.Parallel()
	b := setup(t)
	for _, c := range []string{"c1", "c2", "c3"} {
		_, err := b.prod.CreateConversation(b.ctx(), b.db.Pool, c)
		require.NoError(t, err)
	}

	// Batch 1: three replies by the worker.
	outbox1 := b.send("c1", "c1-m1")
	b.send("c2", "c2-m1")
	b.send("c3", "c3-m1")
	state := b.waitOutcomes(3)
	batch1 := []string{b.reply("c1", 1), b.reply("c2", 1), b.reply("c3", 1)}
	between := time.Now().UTC()
	require.True(t, state.LastTime.Before(between))

	// Batch 2: two replies by the worker and an error message inserted by hand.
	outbox2 := b.send("c1", "c1-m2")
	b.send("c2", "c2-m2")
	long := "the model failed: " + strings.Repeat("very long reason ", 20)
	_, err := b.db.Pool.Exec(b.ctx(), `INSERT INTO messages (id, conversation_id, role, content) VALUES ('c3-err', 'c3', 'error', $1)`, long)
	require.NoError(t, err)
	b.waitOutcomes(6)
	batch2 := []string{b.reply("c1", 2), b.reply("c2", 2), "c3-err"}

	// A relay replay past the duplicate window: the same outcome stored again under another
	// Nats-Msg-Id, with the same Baton-Message-Id.
	stream, err := b.js.Stream(b.ctx(), "AGENT_OUTCOMES")
	require.NoError(t, err)
	orig, err := stream.GetLastMsgForSubject(b.ctx(), "agent.outcomes.c1")
	require.NoError(t, err)
	require.Equal(t, batch2[0], orig.Header.Get(wire.HeaderMessageID))
	dup := nats.NewMsg(orig.Subject)
	for k, v := range orig.Header {
		dup.Header[k] = append([]string(nil), v...)
	}
	dup.Header.Set(nats.MsgIdHdr, "replayed:"+orig.Header.Get(nats.MsgIdHdr))
	dup.Data = orig.Data
	ack, err := b.js.PublishMsg(b.ctx(), dup)
	require.NoError(t, err)
	require.False(t, ack.Duplicate)
	b.waitOutcomes(7)

	// From the beginning: each of the six outcomes once; the copy skipped. (Conversations run
	// concurrently, so a batch's replies reach the stream in any order.)
	all := startSubscriber(t, b.ns.URL())
	b.waitHandled("outcome-printer")
	lines := parseLines(t, all.stop(t))
	require.Len(t, lines, 6)
	require.ElementsMatch(t, batch1, messageIDs(t, lines[:3]))
	require.ElementsMatch(t, batch2, messageIDs(t, lines[3:]))
	require.Contains(t, all.stderr.String(), "duplicate outcome skipped")
	byID := map[string]line{}
	for _, l := range lines {
		byID[l.message] = l
	}
	want := func(seq, conv, role, message, answers, content string) line {
		return line{seq, conv, role, message, answers, content}
	}
	require.Equal(t, want(byID[batch1[0]].seq, "c1", "assistant", batch1[0], fmt.Sprint(outbox1), `"echo: hello c1-m1"`), byID[batch1[0]])
	require.Equal(t, want(byID[batch2[0]].seq, "c1", "assistant", batch2[0], fmt.Sprint(outbox2), `"echo: hello c1-m2"`), byID[batch2[0]])
	require.Equal(t, want(byID["c3-err"].seq, "c3", "error", "c3-err", "-", fmt.Sprintf("%q", long[:80]+"…")), byID["c3-err"])
	require.Equal(t, "5", lines[3].seq, "batch 2 starts at stream sequence 5 (the relay's fence is sequence 1)")

	// A new durable from a time between the batches: only batch 2, the copy skipped.
	since := startSubscriber(t, b.ns.URL(), "--durable", "since", "--since", between.Format(time.RFC3339Nano))
	b.waitHandled("since")
	require.Equal(t, messageIDs(t, lines[3:]), messageIDs(t, parseLines(t, since.stop(t))))

	// A new durable from a stream sequence: the same.
	fromSeq := startSubscriber(t, b.ns.URL(), "--durable", "from-seq", "--from-seq", lines[3].seq)
	b.waitHandled("from-seq")
	require.Equal(t, messageIDs(t, lines[3:]), messageIDs(t, parseLines(t, fromSeq.stop(t))))

	// The first durable again, now with --since: it keeps its position and prints only what
	// is new.
	b.send("c2", "c2-m3")
	b.waitOutcomes(8)
	again := startSubscriber(t, b.ns.URL(), "--since", between.Format(time.RFC3339Nano))
	b.waitHandled("outcome-printer")
	require.Equal(t, []string{b.reply("c2", 3)}, messageIDs(t, parseLines(t, again.stop(t))))
	require.Contains(t, again.stderr.String(), "durable exists and keeps its position")

	// One conversation's outcomes, through a durable of its own: c1's two replies, the copy
	// skipped, nothing of c2 or c3.
	c1 := startSubscriber(t, b.ns.URL(), "--durable", "c1-only", "--conversation", "c1")
	require.Eventually(t, func() bool {
		c, err := b.js.Consumer(b.ctx(), "AGENT_OUTCOMES", "c1-only")
		if err != nil {
			return false
		}
		info := c.CachedInfo()
		return info.NumPending == 0 && info.NumAckPending == 0 && info.Delivered.Stream == 8 // after the relay's fence
	}, time.Minute, 20*time.Millisecond, "durable c1-only never handled c1's outcomes")
	c1Lines := parseLines(t, c1.stop(t))
	require.Equal(t, []string{batch1[0], batch2[0]}, messageIDs(t, c1Lines))
}

func TestSubscriberUsage(t *testing.T) {
	t.Parallel()
	for _, tt := range []struct {
		args   []string
		stderr string
	}{
		{[]string{"--since", "yesterday"}, "--since: want an RFC 3339 time"},
		{[]string{"--since", "2026-11-30T00:00:00Z", "--from-seq", "3"}, "--since and --from-seq exclude each other"},
	} {
		cmd := exec.Command(subscriberBinary(t), tt.args...)
		cmd.Env = append(os.Environ(), "BATON_NATS_URL=nats://127.0.0.1:1")
		out, err := cmd.CombinedOutput()
		require.Error(t, err)
		require.Contains(t, string(out), tt.stderr)
	}
	cmd := exec.Command(subscriberBinary(t))
	for _, kv := range os.Environ() {
		if !strings.HasPrefix(kv, "BATON_") {
			cmd.Env = append(cmd.Env, kv)
		}
	}
	out, err := cmd.CombinedOutput()
	require.Error(t, err)
	require.Contains(t, string(out), "BATON_NATS_URL is not set: set it or pass --nats-url")
}

// The dedupe window lives in wire.OutcomeSubscriber now; wire's TestRecentForgetsTheOldest
// checks what this test checked of it.
func TestSubscriberFormatting(t *testing.T) {
	t.Parallel()
	require.Equal(t, "héllo", truncate("héllo", 5))
	require.Equal(t, "hé…", truncate("héllo", 2))
	require.Equal(t, "conv-1", word("conv-1"))
	require.Equal(t, `"two words"`, word("two words"))
	require.Equal(t, `"line\nbreak"`, word("line\nbreak"))
	require.Equal(t, `""`, word(""))
	require.Equal(t, "1,2", joinIDs([]int64{1, 2}))
	require.Equal(t, "-", joinIDs(nil))
}

// TestSubscriberJSON checks --json's line: one JSON object per outcome, the event's fields in
// full (content not cut, ids exact whatever they hold) and the stream sequence.
func TestSubscriberJSON(t *testing.T) {
	t.Parallel()
	var out bytes.Buffer
	p := &printer{out: &out, maxContent: 3, json: true}
	ev := wire.OutcomeEvent{MessageID: "baton:reply:1", ConversationID: "a.b *>\n日本", Role: "assistant",
		Content: "echo: a long reply", ContentBytes: 18, OutboxIDs: []int64{4, 5}}
	require.NoError(t, p.handle(t.Context(), wire.Outcome{Event: ev, StreamSeq: 7}))
	line := out.String()
	require.True(t, strings.HasSuffix(line, "\n"))
	require.Equal(t, 1, strings.Count(line, "\n"), "one line per outcome")
	var got jsonLine
	require.NoError(t, json.Unmarshal([]byte(line), &got))
	require.Equal(t, jsonLine{Seq: 7, OutcomeEvent: ev}, got)
}
