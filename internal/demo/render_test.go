package demo

import (
	"bytes"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

func TestPercentile(t *testing.T) {
	t.Parallel()
	ds := make([]time.Duration, 100)
	for i := range ds {
		ds[i] = time.Duration(i+1) * time.Millisecond
	}
	require.Equal(t, 50*time.Millisecond, percentile(ds, 50))
	require.Equal(t, 99*time.Millisecond, percentile(ds, 99))
	require.Equal(t, 100*time.Millisecond, percentile(ds, 100))
	require.Equal(t, 7*time.Millisecond, percentile([]time.Duration{7 * time.Millisecond}, 99))
	require.Equal(t, time.Millisecond, percentile(ds[:2], 50))
}

func summary(t *testing.T, r *Result) string {
	t.Helper()
	var b bytes.Buffer
	require.NoError(t, WriteSummary(&b, r))
	return b.String()
}

func TestWriteSummary(t *testing.T) {
	t.Parallel()
	ok := Result{
		Messages: 10, Conversations: 2, MaxAttempts: 2, FailEvery: 2,
		TurnsStream: "AGENT_TURNS", OutcomesStream: "AGENT_OUTCOMES",
		Started: true, SendTime: 2 * time.Second,
		Counts: Counts{Sent: 10, Relayed: 10, Received: 10, Answered: 10, Replied: 5, Failed: 5, Retries: 1},
		Latency: Latency{
			Reply:      []time.Duration{0, 1500 * time.Microsecond, 2 * time.Second},
			ReplyEarly: 1,
			Relay:      []time.Duration{3 * time.Microsecond},
		},
		Database: Database{OutboxRows: 10, Replies: 5, ReplyP50: time.Millisecond, ReplyP99: 3 * time.Millisecond,
			WorkerTurns: []WorkerTurns{{"w1", 6}, {"w2", 9}}, Lookups: 15},
	}
	require.Equal(t, `summary:
  sent: 10 messages to 2 conversations in 2.0s (5 msg/s)
  retries accepted as duplicates: 1 of 1 (same id sent again: AlreadyAccepted, same outbox id)
  outbox rows: 10 for 10 accepted messages (no second row for a retry)
  relayed: 10 of 10 accepted messages in stream AGENT_TURNS
  replied: 5 (answered by an assistant reply in stream AGENT_OUTCOMES)
  failed visibly: 5 (an error message in the conversation, after 2 attempts; --fail-every 2)
  lost: 0
  duplicates: 0 (turn events stored twice 0, outcomes stored twice 0, messages answered twice 0)
  commit→reply latency: p50 1.5ms, p99 2s, max 2s (from Send returning to the reply's JetStream store timestamp, over 3 replied messages; 1 stored before Send returned count as 0)
    database side: p50 1ms, p99 3ms (agent_runs.finished_at − agent_outbox.created_at, 5 rows)
  commit→relayed latency: p50 3µs, p99 3µs, max 3µs (from Send returning to the turn event's store timestamp)
  turns: w1 6, w2 9 (attempts included); 15 lookup operations recorded
result: OK: every accepted message reached JetStream once and got exactly one outcome
`, summary(t, &ok))

	lost := ok
	lost.Counts.Received, lost.Counts.Replied, lost.TailTimeout = 9, 3, true
	lost.Database = unknownDatabase
	out := summary(t, &lost)
	require.Contains(t, out, "  lost: 2 (neither a reply nor a visible failure within --tail-timeout; 1 never reached the turns stream)\n")
	require.NotContains(t, out, "outbox rows:")
	require.NotContains(t, out, "database side:")
	require.NotContains(t, out, "result:", "a failed run ends with its verdict, printed by the caller")

	interrupted := lost
	interrupted.Interrupted = true
	out = summary(t, &interrupted)
	require.Contains(t, out, "interrupted while waiting for the outcomes\n")
	require.Contains(t, out, "  lost: 0\n  unfinished (interrupted): 2 (")
	require.Contains(t, out, "result: OK so far (interrupted): nothing doubled\n")
	interrupted.Counts.Sent = 4
	require.Contains(t, summary(t, &interrupted), "interrupted: stopped sending after 4 of 10 messages\n")
}

func TestProgressLine(t *testing.T) {
	t.Parallel()
	c := Counts{Sent: 300, Received: 290, Replied: 250, Failed: 10}
	require.Equal(t, "progress: sent 300/1000, relayed 290, replied 250, failed 10, waiting 40, 200 msg/s, 1.5s",
		progressLine(c, 1000, 1500*time.Millisecond))
}
