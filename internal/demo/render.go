package demo

import (
	"fmt"
	"io"
	"strings"
	"time"
)

// WriteSummary writes r as the summary `baton demo` ends with: what was sent, relayed,
// answered, lost and doubled, the latencies, the turns per worker and, when r.Verdict is nil,
// the result line. It returns the first write error.
func WriteSummary(w io.Writer, r *Result) error {
	var werr error
	p := func(format string, args ...any) {
		if werr == nil {
			_, werr = fmt.Fprintf(w, format, args...)
		}
	}
	c := r.Counts
	switch {
	case r.Interrupted && c.Sent < r.Messages:
		p("interrupted: stopped sending after %d of %d messages\n", c.Sent, r.Messages)
	case r.Interrupted:
		p("interrupted while waiting for the outcomes\n")
	}
	p("summary:\n")
	p("  sent: %d messages to %d conversations in %.1fs (%.0f msg/s)\n",
		c.Sent, r.Conversations, r.SendTime.Seconds(), float64(c.Sent)/max(r.SendTime.Seconds(), 1e-3))
	p("  retries accepted as duplicates: %d of %d (same id sent again: AlreadyAccepted, same outbox id)\n",
		c.Retries-c.RetryBad, c.Retries)
	if r.Database.OutboxRows >= 0 {
		p("  outbox rows: %d for %d accepted messages (no second row for a retry)\n", r.Database.OutboxRows, c.Sent)
	}
	p("  relayed: %d of %d accepted messages in stream %s\n", c.Received, c.Sent, r.TurnsStream)
	if n := c.Relayed - c.Received; n > 0 {
		p("  turn events for messages no sender saw accepted: %d\n", n)
	}
	p("  replied: %d (answered by an assistant reply in stream %s)\n", c.Replied, r.OutcomesStream)
	failed := "an error message in the conversation"
	if r.FailEvery > 0 {
		failed += fmt.Sprintf(", after %d attempts; --fail-every %d", r.MaxAttempts, r.FailEvery)
	}
	p("  failed visibly: %d (%s)\n", c.Failed, failed)
	if n := c.AnsweredUnknown(); n > 0 {
		p("  outcomes for messages no sender saw accepted: %d\n", n)
	}
	switch n := c.Unanswered(); {
	case r.Interrupted:
		p("  lost: 0\n")
		p("  unfinished (interrupted): %d (accepted; no reply or failure yet when the demo stopped)\n", n)
	case n > 0:
		detail := "neither a reply nor a visible failure"
		if r.TailTimeout {
			detail += " within --tail-timeout"
		}
		if nr := c.NotRelayed(); nr > 0 {
			detail += fmt.Sprintf("; %d never reached the turns stream", nr)
		}
		p("  lost: %d (%s)\n", n, detail)
	default:
		p("  lost: 0\n")
	}
	p("  duplicates: %d (%s)\n", c.Duplicates(), c.DuplicateDetail())
	l := r.Latency
	if len(l.Reply) > 0 {
		p("  commit→reply latency: p50 %s, p99 %s, max %s (from Send returning to the reply's JetStream "+
			"store timestamp, over %d replied messages%s)\n",
			fmtLatency(percentile(l.Reply, 50)), fmtLatency(percentile(l.Reply, 99)), fmtLatency(l.Reply[len(l.Reply)-1]),
			len(l.Reply), earlyNote(l.ReplyEarly))
	}
	if r.Database.Replies > 0 {
		p("    database side: p50 %s, p99 %s (agent_runs.finished_at − agent_outbox.created_at, %d rows)\n",
			fmtLatency(r.Database.ReplyP50), fmtLatency(r.Database.ReplyP99), r.Database.Replies)
	}
	if len(l.Relay) > 0 {
		p("  commit→relayed latency: p50 %s, p99 %s, max %s (from Send returning to the turn event's "+
			"store timestamp%s)\n",
			fmtLatency(percentile(l.Relay, 50)), fmtLatency(percentile(l.Relay, 99)), fmtLatency(l.Relay[len(l.Relay)-1]),
			earlyNote(l.RelayEarly))
	}
	if len(r.Database.WorkerTurns) > 0 {
		parts := make([]string, len(r.Database.WorkerTurns))
		for i, wt := range r.Database.WorkerTurns {
			parts[i] = fmt.Sprintf("%s %d", wt.Name, wt.Runs)
		}
		ops := ""
		if r.Database.Lookups >= 0 {
			ops = fmt.Sprintf("; %d lookup operations recorded", r.Database.Lookups)
		}
		p("  turns: %s (attempts included)%s\n", strings.Join(parts, ", "), ops)
	}
	if err := r.Verdict(); err == nil {
		if r.Interrupted {
			p("result: OK so far (interrupted): nothing doubled\n")
		} else {
			p("result: OK: every accepted message reached JetStream once and got exactly one outcome\n")
		}
	}
	return werr
}

// progressLine is the line the progress report prints: the counts of messages out of
// messages, after elapsed.
func progressLine(c Counts, messages int, elapsed time.Duration) string {
	secs := elapsed.Seconds()
	return fmt.Sprintf("progress: sent %d/%d, relayed %d, replied %d, failed %d, waiting %d, %.0f msg/s, %.1fs",
		c.Sent, messages, c.Received, c.Replied, c.Failed, c.Unanswered(), float64(c.Sent)/max(secs, 1e-3), secs)
}

// earlyNote mentions the events stored before Send returned, which count as 0.
func earlyNote(n int) string {
	if n == 0 {
		return ""
	}
	return fmt.Sprintf("; %d stored before Send returned count as 0", n)
}

func fmtLatency(d time.Duration) string {
	switch {
	case d >= time.Second:
		return d.Round(10 * time.Millisecond).String()
	case d >= time.Millisecond:
		return d.Round(100 * time.Microsecond).String()
	default:
		return d.Round(time.Microsecond).String()
	}
}

// percentile returns the p-th percentile (nearest rank) of sorted, which must not be empty.
func percentile(sorted []time.Duration, p int) time.Duration {
	i := (len(sorted)*p + 99) / 100 // ceil(n*p/100)
	return sorted[min(max(i-1, 0), len(sorted)-1)]
}
