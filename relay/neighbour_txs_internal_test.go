package relay

import (
	"fmt"
	"math/rand/v2"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/stretchr/testify/require"
)

// Transactions without events behind an unacknowledged one are one entry: the held
// transaction's and one position for the rest, whose end is the newest of them. Nothing is
// confirmed before the held event's PubAck, then everything at once.
func TestEmptyTransactionsBehindAnEventAreOneEntry(t *testing.T) {
	f := newFakePipeline(t, 100)
	e1, m1 := event("conv.a")
	f.step(t, begin(), e1, commit(100))
	lsn := uint64(100)
	for i := range 10_000 {
		lsn += 10
		if i%100 == 0 {
			f.step(t, keepalive(lsn))
			continue
		}
		f.step(t, item{kind: itemBegin, commitTime: time.Unix(int64(i), 0)}, item{kind: itemIgnored}, commit(lsn))
	}
	require.Equal(t, 2, len(f.txs), "the held transaction and one position behind it")
	require.EqualValues(t, lsn, f.txs[1].end, "the position is the newest end")
	require.Equal(t, time.Unix(9999, 0), f.txs[1].commitTime, "and the newest transaction's commit time")
	require.Zero(t, f.lsn(), "nothing confirmed past the unacknowledged event")

	e2, m2 := event("conv.b")
	f.step(t, begin(), e2, commit(lsn+10), begin(), commit(lsn+20), begin(), commit(lsn+30), keepalive(lsn+40))
	require.Equal(t, 4, len(f.txs), "an event's transaction ends the run; the next run is one entry again")
	f.ackMsg(t, m2)
	require.Zero(t, f.lsn(), "the later event's PubAck confirms nothing while the first waits")
	f.ackMsg(t, m1)
	require.EqualValues(t, lsn+40, f.lsn(), "the first PubAck confirms every position behind it")
	require.Empty(t, f.txs)
}

// A transaction whose events all had their PubAck before its commit is finished at its commit:
// it joins the run before it like a transaction without events, and is confirmed with it.
func TestTransactionAcknowledgedBeforeItsCommitJoinsTheRun(t *testing.T) {
	f := newFakePipeline(t, 100)
	e1, m1 := event("conv.a")
	e2, m2 := event("conv.b")
	f.step(t, begin(), e1, commit(100), begin(), commit(200), begin(), e2)
	f.ackMsg(t, m2)
	f.step(t, commit(300))
	require.Equal(t, 2, len(f.txs))
	require.EqualValues(t, 300, f.txs[1].end)
	f.ackMsg(t, m1)
	require.EqualValues(t, 300, f.lsn())
}

// refPipeline is the confirmation of a pipeline that keeps one entry per transaction and
// keepalive, as the pipeline did before it merged runs without events (mergeLast): the model
// the merged FIFO must confirm exactly like.
type refPipeline struct {
	txs       []*refEntry
	cur       *refEntry
	confirmed uint64
}

type refEntry struct {
	end     uint64
	pending int
	closed  bool
	events  bool // it had events: the entries a bounded FIFO may hold
}

func (r *refPipeline) handle(it item, tx **refEntry) {
	switch it.kind {
	case itemBegin:
		r.cur = &refEntry{}
		r.txs = append(r.txs, r.cur)
	case itemCommit:
		r.cur.end, r.cur.closed = uint64(it.lsn), true
		r.cur = nil
		r.advance()
	case itemKeepalive:
		if r.cur == nil {
			if len(r.txs) == 0 {
				r.confirmed = max(r.confirmed, uint64(it.lsn))
			} else if last := r.txs[len(r.txs)-1]; last.closed && last.end < uint64(it.lsn) {
				r.txs = append(r.txs, &refEntry{end: uint64(it.lsn), closed: true})
			}
		}
	case itemEvent:
		r.cur.pending++
		r.cur.events = true
		*tx = r.cur
	}
}

func (r *refPipeline) ack(tx *refEntry) {
	tx.pending--
	r.advance()
}

func (r *refPipeline) advance() {
	for len(r.txs) > 0 && r.txs[0].closed && r.txs[0].pending == 0 {
		r.confirmed = max(r.confirmed, r.txs[0].end)
		r.txs = r.txs[1:]
	}
}

// eventEntries returns how many entries of the model had events: the merged FIFO holds at
// most two entries for each (its own and the run behind it) and the open transaction.
func (r *refPipeline) eventEntries() int {
	n := 0
	for _, e := range r.txs {
		if e.events {
			n++
		}
	}
	return n
}

// The merged FIFO confirms exactly what one entry per transaction and keepalive confirms, at
// the same steps, whatever the mix of transactions with and without events, keepalives and
// PubAcks in any order; and it holds at most two entries per transaction with events.
func TestMergedConfirmationMatchesOneEntryPerTransaction(t *testing.T) {
	for seed := range uint64(20) {
		t.Run(fmt.Sprint(seed), func(t *testing.T) {
			rng := rand.New(rand.NewPCG(seed, 27))
			f := newFakePipeline(t, 1<<20)
			var ref refPipeline
			type held struct {
				msg *nats.Msg
				tx  *refEntry
			}
			var inFlight []held
			var lsn uint64
			open := false
			for step := range 5000 {
				var it item
				var msg *nats.Msg
				switch r := rng.IntN(100); {
				case r < 30 && len(inFlight) > 0: // a PubAck, of any event in flight
					i := rng.IntN(len(inFlight))
					h := inFlight[i]
					inFlight = append(inFlight[:i], inFlight[i+1:]...)
					f.ackMsg(t, h.msg)
					ref.ack(h.tx)
					require.Equal(t, ref.confirmed, uint64(f.lsn()), "step %d: after a PubAck", step)
					continue
				case r < 45:
					lsn += uint64(1 + rng.IntN(5))
					it = keepalive(lsn)
				case !open:
					it, open = begin(), true
				case r < 70: // most transactions end without events
					lsn += uint64(1 + rng.IntN(5))
					it, open = commit(lsn), false
				case r < 80:
					it = item{kind: itemIgnored}
				default:
					it, msg = event(fmt.Sprintf("conv.%d", step)) // its own subject: sent at once
				}
				var tx *refEntry
				f.step(t, it)
				ref.handle(it, &tx)
				if msg != nil {
					inFlight = append(inFlight, held{msg: msg, tx: tx})
				}
				require.Equal(t, ref.confirmed, uint64(f.lsn()), "step %d: after item kind %d", step, it.kind)
				require.LessOrEqual(t, len(f.txs), 2*ref.eventEntries()+1, "step %d: entries", step)
			}
			for _, h := range inFlight {
				f.ackMsg(t, h.msg)
				ref.ack(h.tx)
				require.Equal(t, ref.confirmed, uint64(f.lsn()), "draining")
			}
		})
	}
}
