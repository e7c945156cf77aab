package demo

import (
	"strconv"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

func newDemo(t *testing.T, cfg Config) *Demo {
	t.Helper()
	d, err := New(cfg)
	require.NoError(t, err)
	return d
}

func TestNew(t *testing.T) {
	t.Parallel()
	d := newDemo(t, Config{})
	require.Regexp(t, `^demo-[0-9a-z]+$`, d.RunID())
	require.Equal(t, DefaultMessages, d.cfg.Messages)
	require.Equal(t, DefaultConversations, d.cfg.Conversations)
	require.Equal(t, DefaultTailTimeout, d.cfg.TailTimeout)
	require.Zero(t, d.cfg.Rate, "a zero rate sends as fast as possible")
	require.Equal(t, "AGENT_TURNS", d.stream)
	require.Equal(t, "AGENT_OUTCOMES", d.outcomes)

	_, err := New(Config{Messages: -1, Rate: -1, FailEvery: -2})
	require.ErrorContains(t, err, "Messages must not be negative")
	require.ErrorContains(t, err, "Rate must not be negative")
	require.ErrorContains(t, err, "FailEvery must not be negative")
}

func TestDemoFails(t *testing.T) {
	t.Parallel()
	d := newDemo(t, Config{RunID: "demo-x", FailEvery: 3})
	var failing []int
	for i := range 10 {
		if d.fails("demo-x-c" + strconv.Itoa(i)) {
			failing = append(failing, i)
		}
	}
	require.Equal(t, []int{2, 5, 8}, failing)
	require.False(t, d.fails("other-c2"), "conversations that are not the demo's never fail")
	require.False(t, d.fails("demo-x-cx"))
	require.False(t, newDemo(t, Config{RunID: "demo-x"}).fails("demo-x-c2"))

	require.EqualError(t, d.TurnFailure("demo-x-c2"), "the demo fails every turn of every 3th conversation (--fail-every)")
	require.NoError(t, d.TurnFailure("demo-x-c3"))
}

func TestVerdict(t *testing.T) {
	t.Parallel()
	ok := Result{Database: Database{OutboxRows: 10},
		Counts: Counts{Sent: 10, Relayed: 10, Received: 10, Answered: 10, Replied: 8, Failed: 2, Retries: 1}}
	require.NoError(t, ok.Verdict(), "visible failures are outcomes, not losses")

	lost := ok
	lost.Counts.Received, lost.Counts.Relayed, lost.Counts.Replied, lost.TailTimeout = 9, 9, 6, true
	require.EqualError(t, lost.Verdict(), "FAILED: 2 of 10 accepted messages got neither a reply nor a visible failure "+
		"within --tail-timeout; 1 of 10 accepted messages never reached the turns stream")
	lost.Interrupted = true
	require.NoError(t, lost.Verdict(), "an interrupted demo has not lost what it did not wait for")

	doubled := ok
	doubled.Interrupted = true
	doubled.Counts.TurnDups, doubled.Counts.AnsweredTwice, doubled.Counts.RetryBad, doubled.Database.OutboxRows = 1, 2, 1, 11
	require.EqualError(t, doubled.Verdict(), "FAILED: 3 duplicates (turn events stored twice 1, outcomes stored twice 0, "+
		"messages answered twice 2); 1 retries were not recognised as duplicates; 11 outbox rows for 10 accepted messages")

	uncounted := ok
	uncounted.Database.OutboxRows = -1
	require.NoError(t, uncounted.Verdict())
}

// TestLedger feeds the ledger the way the senders and subscribers do, in racy orders.
func TestLedger(t *testing.T) {
	t.Parallel()
	var l ledger
	t0 := time.Now()
	l.sent(1, t0)
	l.sent(2, t0)
	l.relayed(1, t0.Add(time.Millisecond))
	l.relayed(3, t0.Add(-time.Millisecond)) // before its Send returned
	l.relayed(1, t0.Add(2*time.Millisecond))
	l.outcome("reply:a", false, []int64{1, 3}, t0.Add(10*time.Millisecond))
	l.outcome("reply:a", false, []int64{1, 3}, t0.Add(11*time.Millisecond)) // stored twice
	l.outcome("error:b", true, []int64{3}, t0.Add(12*time.Millisecond))     // row 3 answered twice
	c := l.snapshot()
	require.Equal(t, 2, c.Sent)
	require.Equal(t, 1, c.Received)
	require.Equal(t, 1, c.Replied)
	require.Equal(t, 1, c.Unanswered())
	require.False(t, c.Settled())
	require.Equal(t, 1, c.AnsweredUnknown(), "row 3 was answered before its Send returned")

	l.sent(3, t0.Add(20*time.Millisecond))
	l.relayed(2, t0.Add(time.Millisecond))
	l.outcome("reply:c", false, []int64{2}, t0.Add(5*time.Millisecond))
	c, lat := l.final()
	require.Equal(t, Counts{Sent: 3, Relayed: 3, Received: 3, Answered: 3, Replied: 3,
		TurnDups: 1, OutcomeDups: 1, AnsweredTwice: 1}, c)
	require.True(t, c.Settled())
	require.Equal(t, 3, c.Duplicates())
	require.Equal(t, []time.Duration{0, time.Millisecond, time.Millisecond}, lat.Relay)
	require.Equal(t, 1, lat.RelayEarly)
	require.Equal(t, []time.Duration{0, 5 * time.Millisecond, 10 * time.Millisecond}, lat.Reply)
	require.Equal(t, 1, lat.ReplyEarly)
}
