package relay

import (
	"bytes"
	"encoding/binary"
	"fmt"
	"io"
	"net"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pglogrepl"

	"github.com/batonhq/baton/wire"
)

// cutFrames sits between the replication connection's socket and pgx's protocol reader, and
// cuts every CopyData message larger than max to its first cutKeep bytes, reading and dropping
// the rest as it arrives.
//
// pgx receives each protocol message whole (up to 1 GiB) before anything can look at it, and a
// change can be that large: pg_logical_emit_message is executable by every role by default,
// and pgoutput sends every logical message, whatever its prefix, and every inserted value in
// full. Received whole, one such change costs the relay its memory limit, and it meets the same
// change again after every restart. Cut, it costs max at most: the decoder meets a truncated
// change, and cut tells it the change's real size (see cutChange).
//
// Messages are otherwise passed through unchanged, in bulk: Read copies as many whole or
// partial messages as fit, so the reader above still fills its buffer with one call.
type cutFrames struct {
	r   io.Reader
	max int // the largest CopyData body passed whole

	buf        []byte // read from r
	start, end int    // buf[start:end] is read and not yet handled
	rerr       error  // r's error, returned (once) when buf is drained: a read deadline passing is not the end

	pass    int    // bytes of the current message still to pass through
	skip    int    // bytes of a cut message still to drop
	kept    []byte // a cut message's header and first bytes, to pass before going on
	keep    int    // body bytes of the message being cut still to gather into kept
	cutSize int    // the real body size of the message being cut
	seq     uint64 // CopyData messages seen
	// received counts the bytes read from r: bytes arriving are life, also those of a
	// message still arriving or being cut (see reader.checkSilence). Only the reader's
	// goroutine, which reads through f, uses it.
	received int64

	mu  sync.Mutex
	cut map[uint64]int // sequence number (1-based) of a cut CopyData → its real body size

	// behind, when set and true, says the relay is behind the walsender (see bulkLittle).
	behind    atomic.Pointer[atomic.Bool]
	flush     atomic.Pointer[func()] // called before each read of the socket
	lastSmall time.Time              // when a read brought less than bulkLittle, zero after a larger one
	// committed is the commit time of the newest transaction the reader began: how far
	// behind it is, in time (see bulkPause). Only the reader's goroutine, which reads
	// through f, sets it.
	committed time.Time
	// wait waits at most d, returning early once the socket holds bulkLittle bytes where it
	// can tell (see socketWaiter), else sleeping d; longest bounds d.
	wait    func(d time.Duration)
	longest time.Duration
}

// Bulk reads: a client that reads every message as soon as it is sent makes the walsender
// send each message on its own, a write and a wake-up per message, and decode no faster than
// that (FIELD-NOTES; the relay read about 1 KB per read while catching up). One that lets the
// socket fill lets the walsender send in bulk, and spends fewer reads and wake-ups itself. So
// while the relay is behind (its pipeline publishes in batches), a read that brought less than
// bulkLittle is followed by a wait before the next, counted from that read (what the relay did
// in between counts): on a TCP socket the wait ends as soon as the socket holds bulkLittle
// bytes (SO_RCVLOWAT, see socketWaiter), so it adapts to how fast the walsender sends; the
// wait is at most bulkPause. While the relay keeps up, it reads eagerly: a wait would be
// latency.
//
// Measured (baton bench relay --only catchup --rows 100000, 1-row transactions, interleaved
// rounds on 2 cores, relay CPU per row and relay ÷ plain relay): a fixed 400 µs sleep after
// reads under 16 KiB 16.9-18.8 µs/row, 0.88-1.18; waiting for 32 KiB for at most 4 ms
// 12.4-15.7 µs/row, 0.87-1.19; 64 KiB for at most 8 ms no better.
const (
	bulkLittle        = 32 << 10
	bulkPauseShortest = 400 * time.Microsecond
	bulkPauseLongest  = 4 * time.Millisecond
)

// bulkPause returns the longest wait for bulkLittle bytes, for a relay whose newest
// transaction was committed lag ago: a 32nd of that lag, between bulkPauseShortest and
// bulkPauseLongest. Catching up a backlog (a lag of seconds) the wait is as long as it pays; a
// relay that fell a little behind (a busy conversation, a pause of the server) waits little,
// so that what it adds stays small beside the lag it already has. A clock that differs from
// the database server's errs within the same bounds.
func bulkPause(lag time.Duration) time.Duration {
	return min(max(lag/32, bulkPauseShortest), bulkPauseLongest)
}

// cutKeep is how much of a cut message is kept: enough for the XLogData header, the change's
// header (a logical message's prefix, an insert's relation) and a dead-letter record's raw
// bytes (wire.MaxDeadLetterRaw).
const cutKeep = wire.MaxDeadLetterRaw + 1024

// copyDataHeader is a CopyData message's header: 'd' and a length that counts itself.
const copyDataHeader = 5

// newCutFrames returns a cutFrames reading r, cutting CopyData bodies over limit bytes (at least
// cutKeep).
func newCutFrames(r io.Reader, limit int) *cutFrames {
	return &cutFrames{r: r, max: limit, buf: make([]byte, 64<<10), cut: map[uint64]int{}, wait: pause, longest: bulkPauseShortest}
}

// readInBulk makes f wait between small reads while behind is true (see bulkLittle), and
// call flush before each read of the socket: everything read before has been handled then.
func (f *cutFrames) readInBulk(behind *atomic.Bool, flush func()) {
	f.behind.Store(behind)
	f.flush.Store(&flush)
}

// waitOn makes f's waits between small reads end as soon as conn, the connection it reads,
// holds bulkLittle bytes, where the platform and connection allow (see socketWaiter). Elsewhere
// (a Unix socket, TLS) the wait is a plain sleep, which cannot end early: there it stays as short
// as it was measured best, bulkPauseShortest.
func (f *cutFrames) waitOn(conn net.Conn) {
	if wait := socketWaiter(conn, bulkLittle); wait != nil {
		f.wait, f.longest = wait, bulkPauseLongest
	}
}

func (f *cutFrames) Read(p []byte) (int, error) {
	n := 0
	for n < len(p) {
		switch {
		case len(f.kept) > 0 && f.keep == 0:
			c := copy(p[n:], f.kept)
			f.kept = f.kept[c:]
			n += c
			continue
		case f.start == f.end:
			if n > 0 {
				return n, nil // never block with bytes to give
			}
			if err := f.fill(); err != nil {
				return 0, err
			}
			continue
		case f.keep > 0: // before skip: the kept bytes come first
			d := min(f.keep, f.end-f.start)
			f.kept = append(f.kept, f.buf[f.start:f.start+d]...)
			f.start += d
			if f.keep -= d; f.keep == 0 {
				f.noteCut()
			}
			continue
		case f.skip > 0:
			d := min(f.skip, f.end-f.start)
			f.start += d
			f.skip -= d
			continue
		case f.pass > 0:
			c := copy(p[n:], f.buf[f.start:f.start+min(f.pass, f.end-f.start)])
			f.start += c
			f.pass -= c
			n += c
			continue
		}
		// At a message boundary.
		if f.end-f.start < copyDataHeader {
			if n > 0 {
				return n, nil
			}
			if err := f.fill(); err != nil {
				return 0, err
			}
			continue
		}
		h := f.buf[f.start : f.start+copyDataHeader]
		size := int(int32(binary.BigEndian.Uint32(h[1:]))) //nolint:gosec // G115: a length past 2^31 reads as negative, as pgx reads it, and is pgx's to refuse
		if h[0] == 'd' {
			f.seq++
		}
		if h[0] != 'd' || size-4 <= f.max {
			f.pass = 1 + max(size, 4) // a length below 4 is pgx's to refuse
			continue
		}
		// Cut: a header for cutKeep body bytes, then those bytes, then drop the rest.
		body := size - 4
		f.kept = append(f.kept[:0], 'd', 0, 0, 0, 0)
		binary.BigEndian.PutUint32(f.kept[1:], uint32(4+cutKeep))
		f.keep, f.skip = cutKeep, body-cutKeep
		f.start += copyDataHeader
		f.cutSize = body
	}
	return n, nil
}

// fill reads more from r into buf, moving what is unhandled to its front. It returns the
// error of a read that brought nothing; the error of one that brought bytes is returned by
// the next fill, as io.Reader allows both at once.
func (f *cutFrames) fill() error {
	if err := f.rerr; err != nil {
		f.rerr = nil
		return err
	}
	if f.start > 0 {
		f.end = copy(f.buf, f.buf[f.start:f.end])
		f.start = 0
	}
	if flush := f.flush.Load(); flush != nil {
		(*flush)()
	}
	if !f.lastSmall.IsZero() {
		if b := f.behind.Load(); b != nil && b.Load() {
			now := time.Now()
			if d := min(bulkPause(now.Sub(f.committed)), f.longest) - now.Sub(f.lastSmall); d > 0 {
				f.wait(d)
			}
		}
	}
	m, err := f.r.Read(f.buf[f.end:])
	f.received += int64(m)
	if m < bulkLittle {
		f.lastSmall = time.Now()
	} else {
		f.lastSmall = time.Time{}
	}
	f.end += m
	if m == 0 {
		return err
	}
	f.rerr = err
	return nil
}

// noteCut records the real size of the message just cut, by its sequence number.
func (f *cutFrames) noteCut() {
	f.mu.Lock()
	f.cut[f.seq] = f.cutSize
	f.mu.Unlock()
}

// takeCut returns, if the seq-th CopyData message (1-based) was cut, its real body size, and
// forgets it. Only a message of cutKeep bytes can have been cut.
func (f *cutFrames) takeCut(seq uint64, data []byte) (int, bool) {
	if len(data) != cutKeep {
		return 0, false
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	size, ok := f.cut[seq]
	delete(f.cut, seq)
	return size, ok
}

// decodeCutAt is decodeAt for a change that cutFrames cut: walData is the start of a pgoutput
// message of size bytes. A cut insert into a table the relay publishes, or a cut answers
// message, becomes its dead-letter record; any other cut change (a logical message of another
// prefix, an update) is not the relay's and is skipped.
func (d *decoder) decodeCutAt(at pglogrepl.LSN, walData []byte, size, limit int) item {
	d.position(at, walData)
	if len(walData) == 0 {
		return item{kind: itemIgnored}
	}
	reason := fmt.Sprintf("change of %d bytes is larger than the relay's limit of %d bytes (MaxChangeBytes)", size, limit)
	switch walData[0] {
	case 'I':
		if len(walData) < 5 {
			return item{kind: itemIgnored}
		}
		rel, ok := d.relations[binary.BigEndian.Uint32(walData[1:])]
		if !ok || rel.kind == "" {
			return item{kind: itemIgnored}
		}
		kind := wire.DeadLetterTurn
		if rel.kind == tableMessages {
			kind = wire.DeadLetterOutcome
		}
		return d.deadLetterSized(kind, rel.msg.Namespace+"."+rel.msg.RelationName, reason, walData, size)
	case 'M':
		// Flags (1: transactional), the message's LSN, then its NUL-terminated prefix.
		const head = 1 + 1 + 8
		if len(walData) < head || walData[1]&1 == 0 {
			return item{}
		}
		prefix, _, found := bytes.Cut(walData[head:], []byte{0})
		if !found || string(prefix) != wire.AnswersPrefix {
			return item{}
		}
		return d.deadLetterSized(wire.DeadLetterAnswers, "", reason, walData, size)
	}
	return item{kind: itemIgnored}
}
