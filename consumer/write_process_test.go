package consumer_test

import (
	"context"
	"slices"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/batonhq/baton/internal/testsvc"
)

// writeTestArgs are the arguments of every worker in this file: a short lease and recovery
// interval so a second worker recovers the first one's run quickly, and a short ack wait so it
// gets the first one's events.
var writeTestArgs = []string{"--source", "jetstream", "--lease", "2s", "--recovery-interval", "100ms", "--ack-wait", "2s"}

// TestWorkerStoppedDuringWriteTool stops a worker process while its write tool is in flight
// and starts another. Rule: a write operation row exists ⇒ the effect may have happened ⇒ the
// turn never replays automatically, whatever the row's status and however the worker ended:
// the request ends as a visible failure (an error message, outbox row error), the next
// worker never calls the write tool for it, and the conversation goes on normally.
func TestWorkerStoppedDuringWriteTool(t *testing.T) {
	for _, tc := range []struct {
		name string
		// stop ends the first worker. recovered says the turn is still processing afterwards
		// and the second worker's recovery ends it; otherwise the first worker ended it itself.
		stop      func(t *testing.T, p *workerProcess)
		recovered bool
	}{
		// The grace (200ms) runs out while the tool waits: the tool's ctx is cancelled and it
		// returns that error, as an HTTP call cancelled mid-flight would.
		{name: "SIGTERM", stop: func(t *testing.T, p *workerProcess) { p.terminate(t) }},
		{name: "SIGKILL", stop: func(t *testing.T, p *workerProcess) { p.kill(t) }, recovered: true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			b := setup(t, jetStream)
			b.conversation("c")
			first := b.startWorker(slices.Concat(writeTestArgs, []string{"--pause-at", "during-write", "--shutdown-grace", "200ms"})...)
			m1 := b.send("c", "m1", "hello")

			paused := first.waitPaused(t, time.Minute)
			require.Equal(t, "during-write", paused.point)
			require.Equal(t, "c", paused.conversationID)
			require.Equal(t, []string{"running"}, testsvc.Query[string](t, b.db,
				`SELECT status FROM operations WHERE run_id = $1 AND effect = 'write'`, paused.runID),
				"the write operation is recorded before the tool runs")
			tc.stop(t, first)

			if tc.recovered {
				b.startWorker(slices.Concat(writeTestArgs, []string{"--write-tool"})...)
				b.waitTerminal(time.Minute)
			}
			// The write may have happened: m1 ends as a visible failure, counted once, and is
			// never handed back to pending (status, attempts).
			require.Equal(t, []string{"error 1"}, testsvc.Query[string](t, b.db,
				`SELECT status || ' ' || attempts FROM agent_outbox WHERE id = $1`, m1),
				"the request was not failed visibly after its write tool was interrupted")
			require.Equal(t, []string{"error"}, testsvc.Query[string](t, b.db,
				`SELECT role FROM messages WHERE conversation_id = 'c' AND role <> 'user' ORDER BY created_at, id`))
			require.Equal(t, []string{"error"}, testsvc.Query[string](t, b.db, `SELECT r.role FROM agent_outbox o
				JOIN messages r ON r.id = o.reply_id WHERE o.id = $1`, m1))
			require.Equal(t, []string{paused.runID}, testsvc.Query[string](t, b.db,
				`SELECT run_id::text FROM operations WHERE conversation_id = 'c' AND effect = 'write'`),
				"write operations of the conversation")

			// The conversation goes on: a second worker answers m2 with its own write, and
			// leaves m1 alone.
			if !tc.recovered {
				b.startWorker(slices.Concat(writeTestArgs, []string{"--write-tool"})...)
			}
			m2 := b.send("c", "m2", "again")
			b.waitTerminal(time.Minute)
			require.Equal(t, []string{"done 1"}, testsvc.Query[string](t, b.db,
				`SELECT status || ' ' || attempts FROM agent_outbox WHERE id = $1`, m2))
			require.Equal(t, []string{"echo: again"}, testsvc.Query[string](t, b.db, `SELECT r.content FROM agent_outbox o
				JOIN messages r ON r.id = o.reply_id WHERE o.id = $1 AND r.role = 'assistant'`, m2))
			require.Equal(t, []string{"error 1"}, testsvc.Query[string](t, b.db,
				`SELECT status || ' ' || attempts FROM agent_outbox WHERE id = $1`, m1))
			require.Equal(t, []string{"error", "assistant"}, testsvc.Query[string](t, b.db,
				`SELECT role FROM messages WHERE conversation_id = 'c' AND role <> 'user' ORDER BY created_at, id`))
			require.Equal(t, []int{2}, testsvc.Query[int](t, b.db,
				`SELECT count(*)::int FROM operations WHERE conversation_id = 'c' AND effect = 'write'`),
				"write operations: m1's interrupted one and m2's")
			require.Equal(t, []int{1}, testsvc.Query[int](t, b.db,
				`SELECT count(*)::int FROM operations WHERE run_id = $1 AND effect = 'write'`, paused.runID))
			require.Equal(t, []int{0}, testsvc.Query[int](t, b.db, `SELECT count(*)::int FROM operations WHERE status = 'running'`),
				"operations left running")
			requireNoOverlappingRuns(t, b)
			b.waitEventsAcked(time.Minute)
		})
	}
}

// TestWorkerFrozenPastItsLease freezes a worker (SIGSTOP) in its model call until its lease
// expires and another worker has recovered and answered the turn, then resumes it (SIGCONT).
// Rule: a run that lost its turn never starts a tool, so the resumed turn calls none; the
// request is answered once, with one write.
//
// The model call (1s) ends while the worker is frozen (at least the 2s lease), so on SIGCONT
// the model returns and the turn goes on to its tools, racing its own lease renewal: either
// the fenced operation insert refuses the first tool, or the renewal finds the lease lost
// first and cancels the turn. Both happen; neither may record a tool call. (A model call
// longer than the freeze would always lose to the renewal and never reach the tools.)
func TestWorkerFrozenPastItsLease(t *testing.T) {
	t.Parallel()
	b := setup(t, jetStream)
	b.conversation("c")
	first := b.startWorker(slices.Concat(writeTestArgs, []string{"--write-tool", "--model-latency", "1s"})...)
	m1 := b.send("c", "m1", "hello")

	var run1 string
	require.Eventually(t, func() bool {
		err := b.db.Pool.QueryRow(context.Background(), `SELECT run_id::text FROM agent_outbox
			WHERE id = $1 AND status = 'processing'`, m1).Scan(&run1)
		return err == nil
	}, time.Minute, 10*time.Millisecond, "the first worker never claimed m1")
	require.NoError(t, first.cmd.Process.Signal(syscall.SIGSTOP))
	resumed := false
	t.Cleanup(func() { // so the worker's own cleanup can stop it if the test ends early
		if !resumed {
			_ = first.cmd.Process.Signal(syscall.SIGCONT)
		}
	})
	require.Equal(t, []int{0}, testsvc.Query[int](t, b.db, `SELECT count(*)::int FROM operations WHERE run_id = $1`, run1),
		"the worker was frozen after its model call, not in it")

	b.startWorker(slices.Concat(writeTestArgs, []string{"--write-tool"})...)
	require.Eventually(t, func() bool {
		var status string
		err := b.db.Pool.QueryRow(context.Background(), `SELECT status FROM agent_outbox WHERE id = $1`, m1).Scan(&status)
		return err == nil && status == "done"
	}, time.Minute, 10*time.Millisecond, "the second worker did not answer m1 after the first one's lease expired")

	// Resume the first worker: its model call returns and its turn goes on to the tools. Then
	// stop it; its 10s shutdown grace lets the turn run to its end, so once the process has
	// exited the turn has done all it was going to do.
	require.NoError(t, first.cmd.Process.Signal(syscall.SIGCONT))
	resumed = true
	first.terminate(t)

	run2 := testsvc.Query[string](t, b.db, `SELECT run_id::text FROM agent_outbox WHERE id = $1`, m1)
	require.NotEqual(t, []string{run1}, run2)
	require.Equal(t, run2, testsvc.Query[string](t, b.db,
		`SELECT run_id::text FROM operations WHERE conversation_id = 'c' AND effect = 'write'`),
		"write operations of the conversation: exactly the answering run's one")
	require.Equal(t, []int{0}, testsvc.Query[int](t, b.db, `SELECT count(*)::int FROM operations WHERE run_id = $1`, run1),
		"a run that lost its turn started a tool")
	require.Equal(t, []string{"assistant"}, testsvc.Query[string](t, b.db,
		`SELECT role FROM messages WHERE conversation_id = 'c' AND role <> 'user' ORDER BY created_at, id`))
	require.Equal(t, []string{"done 2"}, testsvc.Query[string](t, b.db,
		`SELECT status || ' ' || attempts FROM agent_outbox WHERE id = $1`, m1))
	require.Equal(t, []string{"recovered"}, testsvc.Query[string](t, b.db, `SELECT outcome FROM agent_runs WHERE run_id = $1`, run1))
	requireNoOverlappingRuns(t, b)
	b.waitEventsAcked(time.Minute)
}
