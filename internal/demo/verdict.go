package demo

import (
	"errors"
	"fmt"
	"strings"
	"time"
)

// Result is what a run found, and the plan it was judged against.
type Result struct {
	// The plan: from Config.
	Messages, Conversations int
	MaxAttempts, FailEvery  int
	TurnsStream             string
	OutcomesStream          string

	Started     bool // sending began
	Interrupted bool // the caller's context ended (Ctrl-C) before the run finished
	TailTimeout bool // the wait for the outcomes ran out
	SendTime    time.Duration
	Counts      Counts
	Latency     Latency
	Database    Database
}

// Database is what the database says at the end of the run. A count of -1 could not be read.
type Database struct {
	OutboxRows int64 // agent_outbox rows of this run
	// Replies is the number of rows answered by a reply; ReplyP50 and ReplyP99 the
	// percentiles of agent_runs.finished_at − agent_outbox.created_at over them.
	Replies            int64
	ReplyP50, ReplyP99 time.Duration
	WorkerTurns        []WorkerTurns
	Lookups            int64 // lookup operations of this run's turns
}

// unknownDatabase is a Database with every count unknown.
var unknownDatabase = Database{OutboxRows: -1, Replies: -1, Lookups: -1}

// WorkerTurns is how many runs (attempts included) a worker made for the run's conversations.
type WorkerTurns struct {
	Name string
	Runs int64
}

// Verdict is nil when nothing was lost or doubled, and otherwise an error listing what was.
// Visible failures are outcomes, not losses. An interrupted run is judged on what it saw:
// what it did not wait for is unfinished, not lost; duplicates and extra outbox rows fail it
// all the same. A count the database could not give is not judged.
func (r *Result) Verdict() error {
	c := r.Counts
	var problems []string
	if n := c.Duplicates(); n > 0 {
		problems = append(problems, fmt.Sprintf("%d duplicates (%s)", n, c.DuplicateDetail()))
	}
	if c.RetryBad > 0 {
		problems = append(problems, fmt.Sprintf("%d retries were not recognised as duplicates", c.RetryBad))
	}
	if r.Database.OutboxRows >= 0 && r.Database.OutboxRows != int64(c.Sent) {
		problems = append(problems, fmt.Sprintf("%d outbox rows for %d accepted messages", r.Database.OutboxRows, c.Sent))
	}
	if !r.Interrupted {
		if n := c.Unanswered(); n > 0 {
			p := fmt.Sprintf("%d of %d accepted messages got neither a reply nor a visible failure", n, c.Sent)
			if r.TailTimeout {
				p += " within --tail-timeout"
			}
			problems = append(problems, p)
		}
		if n := c.NotRelayed(); n > 0 {
			problems = append(problems, fmt.Sprintf("%d of %d accepted messages never reached the turns stream", n, c.Sent))
		}
	}
	if len(problems) == 0 {
		return nil
	}
	return errors.New("FAILED: " + strings.Join(problems, "; "))
}
