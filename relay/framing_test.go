package relay

import (
	"bytes"
	"encoding/binary"
	"errors"
	"io"
	"os"
	"sync/atomic"
	"testing"
	"testing/iotest"
	"time"

	"github.com/jackc/pglogrepl"
	"github.com/jackc/pgx/v5/pgproto3"
	"github.com/stretchr/testify/require"

	"github.com/batonhq/baton/wire"
)

// frame returns a backend message of type t with body.
func frame(t byte, body []byte) []byte {
	b := []byte{t, 0, 0, 0, 0}
	binary.BigEndian.PutUint32(b[1:], uint32(4+len(body)))
	return append(b, body...)
}

// xlog returns the body of an XLogData CopyData at WALStart at carrying walData.
func xlog(at uint64, walData []byte) []byte {
	b := make([]byte, 25, 25+len(walData))
	b[0] = pglogrepl.XLogDataByteID
	binary.BigEndian.PutUint64(b[1:], at)
	binary.BigEndian.PutUint64(b[9:], at+1)
	return append(b, walData...)
}

func TestCutFramesPassesSmallMessagesAndCutsLargeOnes(t *testing.T) {
	const limit = cutKeep + 100
	big := bytes.Repeat([]byte("x"), limit+1) // one byte over
	huge := bytes.Repeat([]byte("y"), 3*limit)
	exact := bytes.Repeat([]byte("z"), limit-25)
	var in bytes.Buffer
	in.Write(frame('d', xlog(10, []byte("small"))))
	in.Write(frame('S', append(append([]byte("x\x00"), bytes.Repeat([]byte("r"), 2*limit)...), 0))) // not CopyData: never cut
	in.Write(frame('d', xlog(20, big[25:])))
	in.Write(frame('d', xlog(30, exact))) // body exactly limit: passed
	in.Write(frame('d', xlog(40, huge)))
	in.Write(frame('Z', []byte("I")))

	readers := map[string]func(io.Reader) io.Reader{
		"bulk":     func(r io.Reader) io.Reader { return r },
		"one byte": iotest.OneByteReader,
		"half":     iotest.HalfReader,
	}
	for name, wrap := range readers {
		t.Run(name, func(t *testing.T) {
			f := newCutFrames(wrap(bytes.NewReader(in.Bytes())), limit)
			fe := pgproto3.NewFrontend(f, io.Discard)
			var got []string
			var seq uint64
			for {
				msg, err := fe.Receive()
				if errors.Is(err, io.ErrUnexpectedEOF) || errors.Is(err, io.EOF) {
					break
				}
				require.NoError(t, err)
				switch m := msg.(type) {
				case *pgproto3.CopyData:
					seq++
					size, cut := f.takeCut(seq, m.Data)
					at := binary.BigEndian.Uint64(m.Data[1:])
					if cut {
						require.Len(t, m.Data, cutKeep)
						got = append(got, "cut", string(rune('0'+at/10)), string(rune('0'+size/limit)))
						require.Equal(t, map[uint64]byte{20: 'x', 40: 'y'}[at], m.Data[25], "the kept bytes are the change's first (at %d)", at)
					} else {
						got = append(got, "whole", string(rune('0'+at/10)))
					}
				case *pgproto3.ParameterStatus:
					require.Len(t, m.Value, 2*limit)
					got = append(got, "row")
				case *pgproto3.ReadyForQuery:
					got = append(got, "ready")
				}
			}
			require.Equal(t, []string{"whole", "1", "row", "cut", "2", "1", "whole", "3", "cut", "4", "3", "ready"}, got)
		})
	}
}

func TestCutFramesReturnsTheReadersError(t *testing.T) {
	f := newCutFrames(iotest.ErrReader(io.ErrClosedPipe), cutKeep)
	_, err := f.Read(make([]byte, 10))
	require.ErrorIs(t, err, io.ErrClosedPipe)
	// A message cut short by the error: what arrived is passed, then the error.
	f = newCutFrames(io.MultiReader(bytes.NewReader(frame('d', []byte("abc"))[:6]), iotest.ErrReader(io.ErrClosedPipe)), cutKeep)
	b, err := io.ReadAll(f)
	require.ErrorIs(t, err, io.ErrClosedPipe)
	require.Equal(t, frame('d', []byte("abc"))[:6], b)
}

func TestDecodeCutAt(t *testing.T) {
	d := newDecoder("public", "agent", 1<<20)
	d.relations[7] = &relation{msg: &pglogrepl.RelationMessage{Namespace: "public", RelationName: "messages"}, kind: tableMessages}
	d.relations[8] = &relation{msg: &pglogrepl.RelationMessage{Namespace: "public", RelationName: "other"}}
	insert := func(rel uint32) []byte {
		b := []byte{'I', 0, 0, 0, 0, 'N', 0, 5}
		binary.BigEndian.PutUint32(b[1:], rel)
		return b
	}
	message := func(flags byte, prefix string) []byte {
		b := append([]byte{'M', flags}, make([]byte, 8)...)
		return append(append(b, prefix...), 0, 'x')
	}
	cases := []struct {
		name    string
		walData []byte
		kind    string // dead-letter kind, "" for none
	}{
		{"insert into messages", insert(7), wire.DeadLetterOutcome},
		{"insert elsewhere", insert(8), ""},
		{"insert into an unknown relation", insert(9), ""},
		{"answers message", message(1, wire.AnswersPrefix), wire.DeadLetterAnswers},
		{"non-transactional answers message", message(0, wire.AnswersPrefix), ""},
		{"another prefix", message(1, "not.baton"), ""},
		{"prefix cut before its end", []byte{'M', 1, 0, 0, 0, 0, 0, 0, 0, 0, 'b', 'a'}, ""},
		{"update", []byte{'U', 0, 0, 0, 7}, ""},
		{"empty", nil, ""},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			it := d.decodeCutAt(0x100, c.walData, 99<<20, 64<<20)
			require.Equal(t, c.kind, it.deadLetter)
			if c.kind == "" {
				require.NotEqual(t, itemEvent, it.kind)
				return
			}
			require.Equal(t, itemEvent, it.kind)
			require.Contains(t, it.reason, "103809024 bytes") // the real size
			require.Contains(t, string(it.msg.Data), `"raw_bytes":103809024`)
		})
	}
}

// A read deadline passing (pgconn's way to wake the reader) is an error of one read, not the
// end of the stream.
func TestCutFramesReadsOnAfterATimeout(t *testing.T) {
	r := &timeoutOnce{data: frame('d', xlog(10, []byte("after")))}
	f := newCutFrames(r, cutKeep)
	_, err := f.Read(make([]byte, 64))
	require.ErrorIs(t, err, os.ErrDeadlineExceeded)
	b, err := io.ReadAll(f)
	require.NoError(t, err)
	require.Equal(t, r.data, b)
}

// timeoutOnce fails its first read with a deadline error, then reads data.
type timeoutOnce struct {
	data []byte
	read bool
	err  bool
}

func (r *timeoutOnce) Read(p []byte) (int, error) {
	if !r.err {
		r.err = true
		return 0, os.ErrDeadlineExceeded
	}
	if r.read {
		return 0, io.EOF
	}
	r.read = true
	return copy(p, r.data), nil
}

// BenchmarkCutFrames measures what cutFrames adds to receiving a replication stream: pgx's
// frontend reading 200-byte CopyData messages (an insert's size) through it, against reading
// them directly (sub-benchmark "direct").
func BenchmarkCutFrames(b *testing.B) {
	var stream bytes.Buffer
	for i := range 4096 {
		stream.Write(frame('d', xlog(uint64(i), bytes.Repeat([]byte("i"), 175))))
	}
	data := stream.Bytes()
	for _, bc := range []struct {
		name string
		wrap func(io.Reader) io.Reader
	}{
		{"direct", func(r io.Reader) io.Reader { return r }},
		{"cut", func(r io.Reader) io.Reader { return newCutFrames(r, DefaultMaxChangeBytes) }},
	} {
		b.Run(bc.name, func(b *testing.B) {
			b.SetBytes(int64(len(data)))
			for b.Loop() {
				fe := pgproto3.NewFrontend(bc.wrap(bytes.NewReader(data)), io.Discard)
				for range 4096 {
					if _, err := fe.Receive(); err != nil {
						b.Fatal(err)
					}
				}
			}
		})
	}
}

// While the relay is behind, a read that brought little is followed by a pause before the
// next read (what was spent in between counts against it), so the walsender can send in bulk;
// a large read, or a relay that keeps up, reads on at once.
func TestCutFramesPausesBetweenSmallReadsOnlyWhileBehind(t *testing.T) {
	var in bytes.Buffer
	for i := range 3 {
		in.Write(frame('d', xlog(uint64(10+i), []byte("small"))))
	}
	in.Write(frame('d', xlog(20, bytes.Repeat([]byte("b"), bulkLittle))))
	for i := range 2 {
		in.Write(frame('d', xlog(uint64(30+i), []byte("small"))))
	}
	// One message per read, as a walsender sending message by message gives them.
	var reads []int
	src := readFunc(func(p []byte) (int, error) {
		if in.Len() == 0 {
			return 0, io.EOF
		}
		n := 5 + int(binary.BigEndian.Uint32(in.Bytes()[1:])) - 4
		n, err := in.Read(p[:n])
		reads = append(reads, n)
		return n, err
	})
	f := newCutFrames(src, 1<<20)
	var paused []int                         // the read (1-based) each pause came before
	f.committed = time.Now().Add(-time.Hour) // catching up: the longest wait
	f.longest = bulkPauseLongest             // as on a TCP socket (see waitOn)
	f.wait = func(d time.Duration) {
		require.Positive(t, d)
		require.LessOrEqual(t, d, bulkPauseLongest)
		require.Greater(t, d, bulkPauseLongest/2) // nothing else to do in between
		paused = append(paused, len(reads)+1)
	}
	var behind atomic.Bool
	f.readInBulk(&behind, func() {})
	buf := make([]byte, 1<<20)
	read := func() {
		_, err := f.Read(buf)
		require.NoError(t, err)
	}
	read() // keeping up: no pause
	read()
	require.Empty(t, paused)
	behind.Store(true)
	read() // after a small read: paused
	read() // the large one, after a small read: paused
	read() // after a large read: at once
	read() // after a small read: paused
	require.Equal(t, []int{3, 4, 6}, paused)
	require.Equal(t, []int{35, 35, 35, 5 + 25 + bulkLittle, 35, 35}, reads)
}

type readFunc func([]byte) (int, error)

func (f readFunc) Read(p []byte) (int, error) { return f(p) }

// The wait for a bulk read is a 32nd of how far behind the relay is, within its bounds: long
// while catching up a backlog, short when the relay fell only a little behind.
func TestBulkPauseFollowsTheLag(t *testing.T) {
	for _, c := range []struct{ lag, want time.Duration }{
		{-time.Second, bulkPauseShortest}, // a database clock ahead of the relay's
		{0, bulkPauseShortest},
		{10 * time.Millisecond, bulkPauseShortest},
		{64 * time.Millisecond, 2 * time.Millisecond},
		{time.Hour, bulkPauseLongest},
	} {
		require.Equal(t, c.want, bulkPause(c.lag), "lag %v", c.lag)
	}
}
