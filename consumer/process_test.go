package consumer_test

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/stretchr/testify/require"

	"github.com/batonhq/baton/internal/testsvc"
)

// echoagentBinary is examples/echoagent built once per test binary, for tests that run
// workers as processes and kill them.
func echoagentBinary(t *testing.T) string {
	return testsvc.Binary(t, "github.com/batonhq/baton/examples/echoagent")
}

// pause is one "PAUSED <point> <run_id> <conversation_id>" line of a worker process.
type pause struct{ point, runID, conversationID string }

// workerProcess is examples/echoagent running as a child process.
type workerProcess struct {
	cmd    *exec.Cmd
	paused chan pause
	exited chan struct{}
	err    error // cmd.Wait's result, set before exited is closed
	log    testsvc.Buffer
}

// startWorker starts an echoagent process on the bundle's database (as the worker role) and NATS
// server. The test's
// cleanup stops it with SIGTERM and requires a clean exit, unless the test killed it.
func (b *bundle) startWorker(args ...string) *workerProcess {
	t := b.t
	t.Helper()
	cmd := exec.Command(echoagentBinary(t), args...)
	cmd.Env = append(os.Environ(),
		"BATON_DATABASE_URL="+b.db.RoleURL(testsvc.RoleWorker),
		"BATON_NATS_URL="+b.nc.ConnectedUrl(),
		"BATON_METRICS_ADDR=",
		"BATON_LOG_LEVEL=debug",
	)
	p := &workerProcess{cmd: cmd, paused: make(chan pause, 16), exited: make(chan struct{})}
	cmd.Stdout = &testsvc.LineWriter{Line: func(line string) {
		f := strings.Fields(line)
		if len(f) == 4 && f[0] == "PAUSED" {
			select {
			case p.paused <- pause{f[1], f[2], f[3]}:
			default:
			}
		}
	}}
	cmd.Stderr = &p.log
	require.NoError(t, cmd.Start())
	go func() {
		p.err = cmd.Wait()
		close(p.exited)
	}()
	t.Cleanup(func() {
		select {
		case <-p.exited:
		default:
			_ = cmd.Process.Signal(syscall.SIGTERM)
			select {
			case <-p.exited:
				if p.err != nil {
					t.Errorf("worker %d did not stop cleanly on SIGTERM: %v", cmd.Process.Pid, p.err)
				}
			case <-time.After(30 * time.Second):
				t.Errorf("worker %d did not stop within 30s of SIGTERM", cmd.Process.Pid)
				p.kill(t)
			}
		}
		if t.Failed() {
			t.Logf("worker %d %v log:\n%s", cmd.Process.Pid, args, p.log.Tail(16<<10))
		}
	})
	return p
}

// terminate sends SIGTERM and requires a clean exit within 30s.
func (p *workerProcess) terminate(t *testing.T) {
	t.Helper()
	require.NoError(t, p.cmd.Process.Signal(syscall.SIGTERM))
	select {
	case <-p.exited:
		require.NoError(t, p.err, "worker %d did not exit cleanly on SIGTERM", p.cmd.Process.Pid)
	case <-time.After(30 * time.Second):
		t.Fatalf("worker %d did not exit within 30s of SIGTERM", p.cmd.Process.Pid)
	}
}

// kill sends SIGKILL and waits until the process is gone.
func (p *workerProcess) kill(t *testing.T) {
	t.Helper()
	_ = p.cmd.Process.Kill()
	select {
	case <-p.exited:
	case <-time.After(30 * time.Second):
		t.Fatalf("worker %d did not exit after SIGKILL", p.cmd.Process.Pid)
	}
}

// waitPaused waits for the process to report that a turn reached its --pause-at point.
func (p *workerProcess) waitPaused(t *testing.T, within time.Duration) pause {
	t.Helper()
	select {
	case ps := <-p.paused:
		return ps
	case <-p.exited:
		t.Fatalf("worker exited before pausing: %v", p.err)
	case <-time.After(within):
		t.Fatalf("worker did not pause within %v", within)
	}
	return pause{}
}

// waitEventsAcked waits until the workers' durable consumer holds nothing: every turn event
// was delivered and acked.
func (b *bundle) waitEventsAcked(within time.Duration) {
	t := b.t
	t.Helper()
	js, err := jetstream.New(b.nc)
	require.NoError(t, err)
	var info *jetstream.ConsumerInfo
	require.Eventually(t, func() bool {
		info = b.consumerInfo(js)
		return info != nil && info.NumAckPending == 0 && info.NumPending == 0
	}, within, 20*time.Millisecond, "turn events not all acked")
	t.Logf("consumer: delivered %d, redelivered %d, ack floor %d", info.Delivered.Stream, info.NumRedelivered, info.AckFloor.Stream)
}

func (b *bundle) consumerInfo(js jetstream.JetStream) *jetstream.ConsumerInfo {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	c, err := js.Consumer(ctx, "AGENT_TURNS", "baton-workers")
	if err != nil {
		return nil
	}
	info, err := c.Info(ctx)
	if err != nil {
		return nil
	}
	return info
}

// requireNoOverlappingRuns checks from agent_runs that no two runs of a conversation overlap;
// a run that has not finished lasts forever.
func requireNoOverlappingRuns(t *testing.T, b *bundle) {
	t.Helper()
	require.Equal(t, []int{0}, testsvc.Query[int](t, b.db, `SELECT count(*)::int FROM agent_runs a JOIN agent_runs r
		ON r.conversation_id = a.conversation_id AND r.run_id < a.run_id
		WHERE tstzrange(a.started_at, a.finished_at) && tstzrange(r.started_at, r.finished_at)`),
		"runs of one conversation overlap")
}

func TestThreeWorkerProcesses(t *testing.T) {
	t.Parallel()
	const convs, perConv = 200, 10
	b := setup(t, jetStream)
	for range 3 {
		b.startWorker("--source", "jetstream")
	}
	start := time.Now()
	var wg sync.WaitGroup
	for c := range convs {
		conv := fmt.Sprintf("c%03d", c)
		b.conversation(conv)
		wg.Go(func() { // a burst: the conversation's messages back to back
			for i := range perConv {
				b.send(conv, fmt.Sprintf("%s-m%d", conv, i), fmt.Sprintf("%s/%d", conv, i))
			}
		})
	}
	wg.Wait()
	b.waitTerminal(3 * time.Minute)
	t.Logf("%d messages answered %v after the first send", convs*perConv, time.Since(start).Round(time.Millisecond))

	// Every user message is answered by exactly one committed reply, and each reply echoes
	// exactly the messages that point to it, in order.
	type answered struct {
		Conv, Content, Status string
		ReplyID, Role, Reply  *string
		ReplyAt               *time.Time
	}
	res, err := b.db.Pool.Query(context.Background(), `SELECT o.conversation_id, m.content, o.status, o.reply_id, r.role, r.content, r.created_at
		FROM agent_outbox o JOIN messages m ON m.id = o.message_id LEFT JOIN messages r ON r.id = o.reply_id
		ORDER BY o.conversation_id, o.id`)
	require.NoError(t, err)
	rows, err := pgx.CollectRows(res, pgx.RowToStructByPos[answered])
	require.NoError(t, err)
	require.Len(t, rows, convs*perConv)
	replies := map[string]bool{}
	for i := 0; i < len(rows); {
		first := rows[i]
		require.Equal(t, "done", first.Status, "conversation %s: %s", first.Conv, first.Content)
		require.NotNil(t, first.ReplyID, "conversation %s: %s", first.Conv, first.Content)
		require.Equal(t, "assistant", *first.Role)
		require.False(t, replies[*first.ReplyID], "reply %s answers rows that are not adjacent in message order", *first.ReplyID)
		replies[*first.ReplyID] = true
		var parts []string
		j := i
		for ; j < len(rows) && rows[j].Conv == first.Conv && rows[j].ReplyID != nil && *rows[j].ReplyID == *first.ReplyID; j++ {
			parts = append(parts, rows[j].Content)
		}
		require.Equal(t, "echo: "+strings.Join(parts, " | "), *first.Reply)
		// Replies in message order: a later message's reply is committed after the earlier ones'.
		if i > 0 && rows[i-1].Conv == first.Conv {
			require.False(t, first.ReplyAt.Before(*rows[i-1].ReplyAt),
				"conversation %s: the reply to %q was committed before the reply to %q", first.Conv, first.Content, rows[i-1].Content)
		}
		i = j
	}
	require.Equal(t, []int{len(replies)}, testsvc.Query[int](t, b.db, `SELECT count(*)::int FROM messages WHERE role <> 'user'`),
		"replies that answer no message, or error messages")

	requireNoOverlappingRuns(t, b)
	require.Equal(t, []int{0}, testsvc.Query[int](t, b.db, `SELECT count(*)::int FROM agent_runs WHERE outcome IS DISTINCT FROM 'done'`))
	workers := testsvc.Query[string](t, b.db, `SELECT DISTINCT worker FROM agent_runs ORDER BY 1`)
	t.Logf("%d replies from %d runs by %d workers", len(replies), testsvc.Query[int](t, b.db, `SELECT count(*)::int FROM agent_runs`)[0], len(workers))
	require.Len(t, workers, 3, "every worker process took turns")

	b.waitEventsAcked(time.Minute)
}

// TestKillWorkerAtEachPoint kills a worker process with SIGKILL at each point of a turn and
// starts another: a turn without side effects is replayed exactly once; one after a write tool
// ends as a visible error; no row stays processing and every event is acked.
func TestKillWorkerAtEachPoint(t *testing.T) {
	// Every worker of a test uses these: a short lease and recovery interval so the second one
	// recovers the first one's run quickly, and a short ack wait so it gets the dead one's events.
	common := []string{"--source", "jetstream", "--lease", "2s", "--recovery-interval", "100ms", "--ack-wait", "2s"}
	for _, tc := range []struct {
		name        string
		args        []string // of the worker that is killed
		beforeClaim bool     // kill while the worker holds the event, before it claims
		replayed    bool     // no side effect: replayed once; else a visible error
	}{
		{name: "before claim", args: []string{"--debounce", "1h"}, beforeClaim: true, replayed: true},
		{name: "during the model call", args: []string{"--pause-at", "model"}, replayed: true},
		{name: "after a read tool", args: []string{"--pause-at", "after-read"}, replayed: true},
		{name: "after a write tool", args: []string{"--pause-at", "after-write"}},
		{name: "before the final commit", args: []string{"--pause-at", "before-commit"}, replayed: true},
		{name: "before the final commit after a write tool", args: []string{"--pause-at", "before-commit", "--write-tool"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			b := setup(t, jetStream)
			b.conversation("c")
			first := b.startWorker(append(common, tc.args...)...)
			id := b.send("c", "m1", "hello")

			var killed pause
			if tc.beforeClaim {
				// The worker holds the event, waiting out its debounce, and has claimed nothing.
				js, err := jetstream.New(b.nc)
				require.NoError(t, err)
				require.Eventually(t, func() bool {
					info := b.consumerInfo(js)
					return info != nil && info.NumAckPending == 1 && info.NumPending == 0
				}, time.Minute, 10*time.Millisecond, "the worker never took the event")
				require.Equal(t, []string{"pending"}, testsvc.Query[string](t, b.db, `SELECT status FROM agent_outbox WHERE id = $1`, id))
				first.kill(t)
				require.Equal(t, []int{0}, testsvc.Query[int](t, b.db, `SELECT count(*)::int FROM agent_runs`))
			} else {
				killed = first.waitPaused(t, time.Minute)
				require.Equal(t, "c", killed.conversationID)
				require.Equal(t, []string{"processing"}, testsvc.Query[string](t, b.db,
					`SELECT status FROM agent_outbox WHERE id = $1 AND run_id = $2`, id, killed.runID))
				first.kill(t)
			}

			b.startWorker(common...)
			b.waitTerminal(time.Minute)

			roles := testsvc.Query[string](t, b.db, `SELECT role FROM messages WHERE conversation_id = 'c' AND role <> 'user' ORDER BY created_at`)
			runs := testsvc.Query[string](t, b.db, `SELECT outcome FROM agent_runs ORDER BY started_at`)
			require.Equal(t, []int{0}, testsvc.Query[int](t, b.db, `SELECT count(*)::int FROM agent_runs WHERE finished_at IS NULL`))
			require.Equal(t, []int{0}, testsvc.Query[int](t, b.db, `SELECT count(*)::int FROM operations WHERE status = 'running'`),
				"operations left running")
			switch {
			case tc.beforeClaim:
				// Never claimed: one run, which answers.
				require.Equal(t, []string{"assistant"}, roles)
				require.Equal(t, []string{"done"}, runs)
				require.Equal(t, []string{"done 1"}, testsvc.Query[string](t, b.db, `SELECT status || ' ' || attempts FROM agent_outbox WHERE id = $1`, id))
			case tc.replayed:
				// Replayed exactly once: the killed run was recovered, one more run answered.
				require.Equal(t, []string{"assistant"}, roles)
				require.Equal(t, []string{"recovered", "done"}, runs)
				require.Equal(t, []string{"recovered"}, testsvc.Query[string](t, b.db, `SELECT outcome FROM agent_runs WHERE run_id = $1`, killed.runID))
				require.Equal(t, []string{"done 2"}, testsvc.Query[string](t, b.db, `SELECT status || ' ' || attempts FROM agent_outbox WHERE id = $1`, id))
				require.Equal(t, []string{"echo: hello"}, testsvc.Query[string](t, b.db, `SELECT r.content FROM agent_outbox o
					JOIN messages r ON r.id = o.reply_id WHERE o.id = $1`, id))
			default:
				// A side effect ran: a visible error, no replay.
				require.Equal(t, []string{"error"}, roles)
				require.Len(t, runs, 1, "the turn was replayed after a side effect")
				require.Contains(t, []string{"recovered", "error"}, runs[0])
				require.Equal(t, []string{"error 1"}, testsvc.Query[string](t, b.db, `SELECT status || ' ' || attempts FROM agent_outbox WHERE id = $1`, id))
				require.Equal(t, []string{"error"}, testsvc.Query[string](t, b.db, `SELECT r.role FROM agent_outbox o
					JOIN messages r ON r.id = o.reply_id WHERE o.id = $1`, id))
				// The write is still on record, attached to the error message.
				require.Equal(t, []int{1}, testsvc.Query[int](t, b.db, `SELECT count(*)::int FROM operations o JOIN agent_outbox x ON x.reply_id = o.message_id
					WHERE o.run_id = $1 AND o.effect = 'write' AND o.status IN ('done', 'error') AND x.id = $2`, killed.runID, id))
			}
			requireNoOverlappingRuns(t, b)
			b.waitEventsAcked(time.Minute)
		})
	}
}
