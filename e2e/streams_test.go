package e2e

import (
	"fmt"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/batonhq/baton/consumer"
	"github.com/batonhq/baton/relay"
)

// delivery is a turn event a worker received: which row, from which stored copy.
type delivery struct {
	outboxID int64
	seq      uint64 // the stream sequence of the stored copy
}

// deliveryLog is every turn event the workers received and every turn event a relay's replay
// check did not publish, from their debug log lines.
type deliveryLog struct {
	mu      sync.Mutex
	recs    []delivery
	skipped map[int64]string // outbox id -> why a relay's replay check did not publish its event
	bad     []string         // record lines that did not parse
}

// deliveryRE reads a worker's record of a turn event received (consumer.TurnEventReceivedLog,
// slog's text format): the ids come before the conversation id, which can hold anything.
var deliveryRE = regexp.MustCompile(`msg="` + regexp.QuoteMeta(consumer.TurnEventReceivedLog) + `" outbox_id=(\d+) stream_seq=(\d+) `)

// skippedRE reads a relay's record of a turn event its replay check did not publish
// (relay.ReplaySkippedLog).
var skippedRE = regexp.MustCompile(`msg="` + regexp.QuoteMeta(relay.ReplaySkippedLog) + `" outbox_id=(\d+) why=(` +
	relay.ReplaySkipStored + "|" + relay.ReplaySkipFinished + `)$`)

// add records line if it is a worker's record of a turn event received or a relay's of one
// not published, and reports whether it was.
func (l *deliveryLog) add(line string) bool {
	if strings.Contains(line, relay.ReplaySkippedLog) {
		l.mu.Lock()
		defer l.mu.Unlock()
		m := skippedRE.FindStringSubmatch(line)
		if m == nil {
			l.bad = append(l.bad, line)
			return true
		}
		id, err := strconv.ParseInt(m[1], 10, 64)
		if err != nil {
			l.bad = append(l.bad, line)
			return true
		}
		if l.skipped == nil {
			l.skipped = map[int64]string{}
		}
		if l.skipped[id] != relay.ReplaySkipFinished { // "finished" explains a row never delivered
			l.skipped[id] = m[2]
		}
		return true
	}
	if !strings.Contains(line, consumer.TurnEventReceivedLog) {
		return false
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	m := deliveryRE.FindStringSubmatch(line)
	if m == nil {
		l.bad = append(l.bad, line)
		return true
	}
	id, err1 := strconv.ParseInt(m[1], 10, 64)
	seq, err2 := strconv.ParseUint(m[2], 10, 64)
	if err1 != nil || err2 != nil || seq == 0 {
		l.bad = append(l.bad, line)
		return true
	}
	l.recs = append(l.recs, delivery{id, seq})
	return true
}

func (l *deliveryLog) snapshot() ([]delivery, []string) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return slices.Clone(l.recs), slices.Clone(l.bad)
}

// skippedAs returns why a relay's replay check did not publish outbox row id's turn event
// ("" if none did).
func (l *deliveryLog) skippedAs(id int64) string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.skipped[id]
}

// dropFrom forgets the records of stored copies from stream sequence seq on (a planted
// defect's).
func (l *deliveryLog) dropFrom(seq uint64) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.recs = slices.DeleteFunc(l.recs, func(d delivery) bool { return d.seq >= seq })
}

// checkTurnStream checks, from the workers' and the relays' records, what the turns stream
// held: every outbox row delivered (so stored) but those a relay's replay check found
// finished already (relay/replay.go: a finished row needs no turn event), each from one
// stored copy only (redeliveries of that copy aside), and each conversation's rows stored in
// commit order. The stream is a work queue: what it held is gone once acked, so the records
// are what is left to check. c.outboxConv must be filled (check does it).
func (c *checker) checkTurnStream() {
	// The workers log a record before they ack it: once everything is acked, the records of
	// every row are at most a pipe's read away.
	var recs []delivery
	deadline := time.Now().Add(c.wait)
	for {
		var bad []string
		recs, bad = c.s.deliveries.snapshot()
		for _, b := range bad {
			c.fail("a worker's record of a turn event received that does not parse: %q", b)
		}
		if len(bad) > 0 {
			return
		}
		got := map[int64]bool{}
		for _, d := range recs {
			got[d.outboxID] = true
		}
		var missing []int64
		c.unpublished = 0
		for id := range c.outboxConv {
			switch {
			case got[id]:
			case c.s.deliveries.skippedAs(id) == relay.ReplaySkipFinished:
				c.unpublished++
			default:
				missing = append(missing, id)
			}
		}
		if len(missing) == 0 {
			break
		}
		if time.Now().After(deadline) {
			slices.Sort(missing)
			c.lost += len(missing)
			why := make([]string, 0, 10)
			for _, id := range missing[:min(len(missing), 10)] {
				why = append(why, fmt.Sprintf("%d (replay check: %q)", id, c.s.deliveries.skippedAs(id)))
			}
			c.fail("lost: %d outbox rows never reached a worker from the turns stream, and no relay found them finished before publishing; first %s",
				len(missing), strings.Join(why, ", "))
			break
		}
		time.Sleep(200 * time.Millisecond)
	}

	copies := map[int64][]uint64{} // outbox id -> the stream sequences it was delivered from
	stored := map[uint64]int64{}   // stream sequence -> outbox id
	for _, d := range recs {
		if prev, ok := stored[d.seq]; ok && prev != d.outboxID {
			c.fail("turns stream sequence %d was delivered as outbox row %d and as %d", d.seq, prev, d.outboxID)
			continue
		}
		if _, ok := stored[d.seq]; !ok {
			stored[d.seq] = d.outboxID
			copies[d.outboxID] = append(copies[d.outboxID], d.seq)
		}
	}
	for id, seqs := range copies {
		if _, ok := c.outboxConv[id]; !ok {
			c.fail("the turns stream held outbox row %d (stream sequences %v), which Postgres does not hold", id, seqs)
		}
		if len(seqs) > 1 {
			slices.Sort(seqs)
			c.doubled++
			c.fail("doubled: outbox row %d was delivered from %d stored copies of the turns stream (stream sequences %v)", id, len(seqs), seqs)
		}
	}

	// Each conversation's stored events, in stream order, name its rows in commit order (a
	// conversation's messages are sent one after another, so outbox ids are commit order).
	seqs := make([]uint64, 0, len(stored))
	for seq := range stored {
		seqs = append(seqs, seq)
	}
	slices.Sort(seqs)
	last := map[string]delivery{}
	for _, seq := range seqs {
		id := stored[seq]
		conv, ok := c.outboxConv[id]
		if !ok {
			continue
		}
		if prev, ok := last[conv]; ok && prev.outboxID >= id {
			c.fail("conversation %q: the turns stream holds its events out of commit order: outbox row %d at stream sequence %d after row %d at %d",
				conv, id, seq, prev.outboxID, prev.seq)
		}
		last[conv] = delivery{id, seq}
	}
}

// repeats lists the stored outcomes whose message id the stream holds more than once, as
// failure messages.
func repeats(stored []storedOutcome) []string {
	at := map[string][]uint64{}
	var order []string
	for _, o := range stored {
		if len(at[o.id]) == 0 {
			order = append(order, o.id)
		}
		at[o.id] = append(at[o.id], o.seq)
	}
	var out []string
	for _, id := range order {
		if len(at[id]) > 1 {
			out = append(out, fmt.Sprintf("doubled: outcome %q is stored %d times in the outcomes stream (stream sequences %v)", id, len(at[id]), at[id]))
		}
	}
	return out
}
