package demo

import (
	"fmt"
	"slices"
	"sync"
	"time"
)

// ledger is what the senders and the subscribers observed, safe for concurrent use. Events
// may arrive in any order: a turn event or an outcome can be seen before the Send that
// committed its row returned.
type ledger struct {
	mu        sync.Mutex
	committed map[int64]time.Time // outbox id → when its Send returned (the commit happened before)
	stored    map[int64]time.Time // outbox id → JetStream store timestamp of its turn event
	answers   map[int64]answer    // outbox id → the first outcome that answered it
	outcomes  map[string]struct{} // message ids of the outcomes seen
	retries   int
	retryBad  int
	// Duplicates: turn events stored twice, outcomes stored twice, rows answered twice.
	turnDups, outcomeDups, answeredTwice int
	received                             int // accepted messages whose turn event arrived
	replied, failed                      int // accepted messages answered by a reply, by a visible failure
}

// answer is the outcome that answered an outbox row.
type answer struct {
	failed bool      // a visible failure (role error), not a reply
	stored time.Time // JetStream store timestamp of the outcome
}

// Counts is a consistent view of what a run observed.
type Counts struct {
	Sent     int // distinct messages accepted (outbox ids known)
	Relayed  int // distinct outbox ids of this run in the turns stream
	Received int // accepted messages whose turn event is in the stream
	Answered int // distinct outbox ids of this run answered by an outcome
	Replied  int // accepted messages answered by a reply
	Failed   int // accepted messages answered by a visible failure
	Retries  int // messages sent a second time with the same id
	RetryBad int // retries not recognised as duplicates (not AlreadyAccepted, or another outbox id)
	// TurnDups are turn events stored twice; OutcomeDups outcomes stored twice; AnsweredTwice
	// rows answered by a second outcome.
	TurnDups, OutcomeDups, AnsweredTwice int
}

// Unanswered is the number of accepted messages with neither a reply nor a visible failure.
func (c Counts) Unanswered() int { return c.Sent - c.Replied - c.Failed }

// NotRelayed is the number of accepted messages whose turn event has not arrived.
func (c Counts) NotRelayed() int { return c.Sent - c.Received }

// Settled reports whether every accepted message is in the turns stream and answered.
func (c Counts) Settled() bool { return c.Unanswered() == 0 && c.NotRelayed() == 0 }

// AnsweredUnknown is the number of this run's answered rows whose message the senders never
// saw accepted.
func (c Counts) AnsweredUnknown() int { return c.Answered - c.Replied - c.Failed }

// Duplicates is the number of events stored twice and rows answered twice.
func (c Counts) Duplicates() int { return c.TurnDups + c.OutcomeDups + c.AnsweredTwice }

// DuplicateDetail names the kinds of duplicates with their counts.
func (c Counts) DuplicateDetail() string {
	return fmt.Sprintf("turn events stored twice %d, outcomes stored twice %d, messages answered twice %d",
		c.TurnDups, c.OutcomeDups, c.AnsweredTwice)
}

// Latency holds the latencies of the accepted messages, measured from Send returning (what
// the application knows: the commit happened inside Send) to a JetStream store timestamp. An
// event stored before Send returned counts as zero.
type Latency struct {
	Relay, Reply           []time.Duration // to the turn event, to the reply; sorted
	RelayEarly, ReplyEarly int             // stored before Send returned
}

// sent records an accepted message; returned is when its Send returned.
func (l *ledger) sent(outboxID int64, returned time.Time) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.committed == nil {
		l.committed = map[int64]time.Time{}
	}
	if _, ok := l.committed[outboxID]; ok {
		return
	}
	l.committed[outboxID] = returned
	if _, ok := l.stored[outboxID]; ok { // the event arrived before Send returned
		l.received++
	}
	if a, ok := l.answers[outboxID]; ok {
		l.countAnswer(a)
	}
}

func (l *ledger) countAnswer(a answer) {
	if a.failed {
		l.failed++
	} else {
		l.replied++
	}
}

// retried records a message sent again with the same id; ok says it was recognised as a
// duplicate.
func (l *ledger) retried(ok bool) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.retries++
	if !ok {
		l.retryBad++
	}
}

// relayed records a turn event of this run, stored in JetStream at stored. A second event for
// the same outbox id is a duplicate in the stream.
func (l *ledger) relayed(outboxID int64, stored time.Time) { l.turn(outboxID, stored, true) }

// published records a turn event of this run the relay published at at, as a subscriber of its
// subject sees it (see watchTurns). A second publish of the same outbox id is a replay, which
// the stream's duplicate window drops: not a duplicate.
func (l *ledger) published(outboxID int64, at time.Time) { l.turn(outboxID, at, false) }

func (l *ledger) turn(outboxID int64, stored time.Time, repeatIsDup bool) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.stored == nil {
		l.stored = map[int64]time.Time{}
	}
	if _, ok := l.stored[outboxID]; ok {
		if repeatIsDup {
			l.turnDups++
		}
		return
	}
	l.stored[outboxID] = stored
	if _, ok := l.committed[outboxID]; ok {
		l.received++
	}
}

// outcome records an outcome (message messageID) answering the rows outboxIDs. An outcome seen
// again is a duplicate in the stream and counts once; a row answered by a second outcome is a
// message answered twice.
func (l *ledger) outcome(messageID string, failed bool, outboxIDs []int64, stored time.Time) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.outcomes == nil {
		l.outcomes = map[string]struct{}{}
		l.answers = map[int64]answer{}
	}
	if _, ok := l.outcomes[messageID]; ok {
		l.outcomeDups++
		return
	}
	l.outcomes[messageID] = struct{}{}
	a := answer{failed: failed, stored: stored}
	for _, id := range outboxIDs {
		if _, ok := l.answers[id]; ok {
			l.answeredTwice++
			continue
		}
		l.answers[id] = a
		if _, ok := l.committed[id]; ok {
			l.countAnswer(a)
		}
	}
}

func (l *ledger) snapshot() Counts {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.snapshotLocked()
}

func (l *ledger) snapshotLocked() Counts {
	return Counts{Sent: len(l.committed), Relayed: len(l.stored), Received: l.received,
		Answered: len(l.answers), Replied: l.replied, Failed: l.failed,
		Retries: l.retries, RetryBad: l.retryBad,
		TurnDups: l.turnDups, OutcomeDups: l.outcomeDups, AnsweredTwice: l.answeredTwice}
}

// final returns the counts and the latencies.
func (l *ledger) final() (Counts, Latency) {
	l.mu.Lock()
	defer l.mu.Unlock()
	var lat Latency
	since := func(at, returned time.Time, early *int) time.Duration {
		d := at.Sub(returned)
		if d < 0 {
			*early++
			d = 0
		}
		return d
	}
	for id, c := range l.committed {
		if st, ok := l.stored[id]; ok {
			lat.Relay = append(lat.Relay, since(st, c, &lat.RelayEarly))
		}
		if a, ok := l.answers[id]; ok && !a.failed {
			lat.Reply = append(lat.Reply, since(a.stored, c, &lat.ReplyEarly))
		}
	}
	slices.Sort(lat.Relay)
	slices.Sort(lat.Reply)
	return l.snapshotLocked(), lat
}
