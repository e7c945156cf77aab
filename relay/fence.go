package relay

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/batonhq/baton/wire"
)

// The stream fence: a session's late publishes are refused by the server, not by a check the
// relay makes before sending (a pause can fall between check and send).
//
// Each stream holds, per slot, one fence message on wire.FenceSubject. A session writes its own
// before it publishes anything to the stream: a compare-and-set
// (Nats-Expected-Last-Subject-Sequence naming the sequence it read there before it took the
// slot, so that a session paused at its start cannot fence out one that took over meanwhile),
// after which it deletes the previous session's (or, on a stream whose operator allows
// rollups, a Nats-Rollup removes it). Every event the session publishes to that stream then carries
// Nats-Expected-Last-Subject-Sequence and -Subject naming its fence: JetStream stores it only
// while that fence is the last message on the fence subject. Once a newer session wrote its
// own, whatever an older session still sends — held in a frozen TCP path, a paused process or
// nats.go's reconnect buffer, for any length of time — is refused (10071, wrong last
// sequence): never stored after the newer session's events, however long the duplicate window.
// A stream stores events in the order they came, so this also keeps per-conversation order
// across takeovers: no event of an older session lands after a newer session's.
//
// The pipeline's sender raises the fence (sessionFence.raise) before its first send, and it is
// the sender that stamps each event with it as it sends it: a stalled server holds the sender
// only, while the reader keeps reporting to Postgres and a stop is not delayed (see pipeline).
//
// A stream that drops its oldest messages (outcomes, dead letters) would drop the fence message
// too, after max_msgs newer messages, max_bytes or max_age: the session then refreshes its
// fence (a new compare-and-set from its own) when half of any such limit is used up since the
// fence; the events sent after the refresh carry the new one, those before it are checked
// against the old one, which is still the last when the server reaches them (one connection's
// publishes are processed in order). A fence dropped anyway (limits smaller than what passes
// between two refreshes) ends the session like a takeover would, and the next one raises a
// fence again.
//
// Where the fence is not raised (fenceStream says why, at WARN): a stream with replicas, where
// JetStream refuses a check on a subject that another check in flight names (10164), so
// pipelined publishes cannot each carry it; and a server older than 2.11, which does not read
// the -Subject header and would apply the check to the conversation's subject. There, as
// before, only the duplicate window removes a late copy.

// fenceState is what ensureStreams found out about one stream: whether it takes the fence
// (on), whether it allows the Nats-Rollup that replaces the previous fence message (without
// it, the session deletes that one), and the limits by which it drops its oldest messages (zero: none).
type fenceState struct {
	on, rollup bool
	// replicated says the stream has replicas; atomic, that it takes atomic batches.
	replicated, atomic bool
	maxMsgs            int64
	maxBytes           int64
	maxAge             time.Duration
}

// laneFence is a session's fence in one stream.
type laneFence struct {
	subject string    // wire.FenceSubject
	seq     uint64    // the fence message's stream sequence
	header  []string  // seq, as the header carries it
	subj    []string  // subject, as the header carries it
	at      time.Time // when it was written
	// sentMsgs and sentBytes count what the session sent to the stream since, for the
	// estimate of the bytes stored after the fence.
	sentMsgs, sentBytes int64
}

// sessionFence holds one session's fences. The sender of the session's pipelines (the
// backfill's, then the stream's: never two at once) raises and refreshes them and stamps
// events; replies record the stream sequences they report (acked).
type sessionFence struct {
	nc      *nats.Conn
	m       *metrics
	log     *slog.Logger
	slot    string
	streams [laneCount]string
	state   [laneCount]fenceState
	// subjects are the lanes' fence subjects.
	subjects [laneCount]string
	started  time.Time

	// mu is held while the fence is raised: the sender of a pipeline that ended (a first
	// start's backfill) may still be raising it when the next pipeline's sender starts.
	mu     sync.Mutex
	raised bool
	// unknown says a fence write ended without an answer (it may be stored): the session
	// cannot raise its fence any more, and ends; the next one reads the fences again.
	unknown atomic.Bool
	prev    chan prevFences // what read found (cap 1; put back when taken)
	read1   chan struct{}   // closed when read found it
	// taken is set once the session takes the slot: a read that ends after that is refused.
	taken atomic.Bool
	lanes [laneCount]laneFence
	// acked is, by lane, the highest stream sequence a PubAck reported this session.
	acked [laneCount]atomic.Uint64
}

// newSessionFence returns the fences of a new session of r, or nil when no stream takes one.
func (r *Relay) newSessionFence() *sessionFence {
	f := &sessionFence{nc: r.cfg.NATS, m: r.m, log: r.cfg.Logger, slot: r.cfg.Slot, state: r.fenced, started: time.Now().UTC(),
		streams: r.laneStreams()}
	fenced := false
	for lane, kind := range laneKinds {
		f.subjects[lane] = wire.FenceSubject(r.cfg.SubjectPrefix, kind, r.cfg.Slot)
		fenced = fenced || f.state[lane].on
	}
	if !fenced {
		return nil
	}
	return f
}

// laterHeaders is what the headers added after an event is built take at most: its commit LSN
// (the reader), the fence (the sender) and an atomic batch's headers, with their names.
const laterHeaders = 512

// eventPayload is the size events are built to fit: the server's max payload, less the headers
// the relay adds to an event after building it (laterHeaders). An event built to the full
// max payload would be refused once they are added (nats.go's ErrMaxPayload), on every replay.
func (r *Relay) eventPayload() int {
	return int(max(r.maxPayload-laterHeaders, r.maxPayload/2))
}

// laneKinds are the wire kinds of the lanes' streams.
var laneKinds = [laneCount]string{laneTurns: wire.KindTurns, laneOutcomes: wire.KindOutcomes, laneDeadLetter: wire.KindDeadLetter}

// errFenceUnknown is the error of a session whose fence write got no answer: it may be stored,
// and this session's compare-and-set would then fail; the next session reads the fence again.
var errFenceUnknown = errors.New("a fence write of this session got no answer; the next session raises the fence again")

// errFencedOut marks a publish the server refused because a newer session of this slot wrote
// its fence (or the stream dropped the fence message by its limits before a refresh): the
// session ends, and the next one takes the relay lock again, or stands by.
var errFencedOut = errors.New("fenced out: a newer relay session took this slot's streams over, or the stream dropped the fence")

// wrongLastSequence is the JetStream error code of a publish whose expected last sequence did
// not hold.
const wrongLastSequence jetstream.ErrorCode = 10071

// checkInProcess is the JetStream error code of a publish whose expected-sequence check a
// replicated stream cannot make now: another check of the same subject is in process.
const checkInProcess jetstream.ErrorCode = 10164

// fenceRetries bounds the retries of a fence write answered with checkInProcess.
const fenceRetries = 10

// isAPIError reports whether err is the JetStream API error of code.
func isAPIError(err error, code jetstream.ErrorCode) bool {
	var api *jetstream.APIError
	return errors.As(err, &api) && api.ErrorCode == code
}

// asFencedOut wraps err with errFencedOut when it is the server's refusal of a fenced publish.
func asFencedOut(err error) error {
	if isAPIError(err, wrongLastSequence) {
		return fmt.Errorf("%w: %w", errFencedOut, err)
	}
	return err
}

// fenceFromVersion is the first nats-server version that reads
// Nats-Expected-Last-Subject-Sequence-Subject.
var fenceFromVersion = [3]int{2, 11, 0}

// serverFences reports whether a nats-server of version v ("2.15.2") applies the fence's header.
func serverFences(v string) bool {
	v, _, _ = strings.Cut(strings.TrimPrefix(v, "v"), "-")
	parts := strings.Split(v, ".")
	for i, want := range fenceFromVersion {
		if i >= len(parts) {
			return false
		}
		n, err := strconv.Atoi(parts[i])
		if err != nil {
			return false
		}
		if n != want {
			return n > want
		}
	}
	return true
}

// fenceBody is the body of a fence message: for operators who look at one.
type fenceBody struct {
	Slot    string    `json:"slot"`
	Started time.Time `json:"session_started"`
}

// read starts reading, on a goroutine of its own, the sequence of every fenced stream's last
// fence message: the session calls it before it takes the slot, so that a fence another
// session writes after that makes this session's compare-and-set fail (a session paused
// between taking the slot and writing its fence must not fence out the one that took over
// meanwhile). It does not wait: a stalled NATS holds the goroutine, not the session, which
// streams and reports to Postgres meanwhile. The goroutine ends within timeout (or when
// nats.go gives up the write it waits behind); raise waits for it.
func (f *sessionFence) read(timeout time.Duration) {
	f.prev, f.read1 = make(chan prevFences, 1), make(chan struct{})
	go func() {
		ctx, cancel := context.WithTimeout(context.Background(), timeout)
		defer cancel()
		var res prevFences
		var mu sync.Mutex
		var wg sync.WaitGroup
		for lane := range laneCount {
			if !f.state[lane].on {
				continue
			}
			wg.Go(func() {
				seq, err := lastSeq(ctx, f.nc, f.streams[lane], f.subjects[lane])
				mu.Lock()
				defer mu.Unlock()
				res.seq[lane] = seq
				if err != nil && res.err == nil {
					res.err = fmt.Errorf("read the fence %s of stream %s: %w", f.subjects[lane], f.streams[lane], err)
				}
			})
		}
		wg.Wait()
		if f.taken.Load() && res.err == nil {
			res.err = errFencesLate
		}
		f.prev <- res
		close(f.read1)
	}()
}

// errFencesLate is the error of a session whose read of the fences ended after it took the
// slot: what it read may be a newer session's fence, which it must not replace.
var errFencesLate = errors.New("the stream fences were read only after the slot was taken; the next session reads them again")

// fenceReadWait bounds how long a session waits for read before it takes the slot: a stalled
// NATS server must not keep the session from streaming (and reporting to Postgres).
const fenceReadWait = 2 * time.Second

// takeSlot waits up to fenceReadWait for read, then marks the slot taken: the session takes it
// next. Safe to call again.
func (f *sessionFence) takeSlot(ctx context.Context) {
	if f == nil || f.taken.Load() {
		return
	}
	t := time.NewTimer(fenceReadWait)
	defer t.Stop()
	select {
	case <-f.read1:
	case <-t.C:
	case <-ctx.Done():
	}
	f.taken.Store(true)
}

// prevFences is what read found: by lane, the sequence of the last fence message (0: none).
type prevFences struct {
	seq [laneCount]uint64
	err error
}

// lastSeq returns the stream sequence of stream's last message on subject, 0 when it has
// none, with one request ($JS.API.STREAM.MSG.GET). A missing stream is errNoResponders.
func lastSeq(ctx context.Context, nc *nats.Conn, stream, subject string) (uint64, error) {
	req, err := json.Marshal(struct {
		LastBySubject string `json:"last_by_subj"`
	}{subject})
	if err != nil {
		return 0, err
	}
	m, err := nc.RequestWithContext(ctx, "$JS.API.STREAM.MSG.GET."+stream, req)
	if err != nil {
		return 0, goneAsNoResponders(err)
	}
	var resp struct {
		Message *struct {
			Seq uint64 `json:"seq"`
		} `json:"message"`
		Error *jetstream.APIError `json:"error"`
	}
	if err := json.Unmarshal(m.Data, &resp); err != nil {
		return 0, fmt.Errorf("%w: %q", errInvalidPubAck, m.Data)
	}
	switch {
	case resp.Error != nil && resp.Error.ErrorCode == jetstream.JSErrCodeMessageNotFound:
		return 0, nil
	case resp.Error != nil && resp.Error.ErrorCode == jetstream.JSErrCodeStreamNotFound:
		return 0, fmt.Errorf("%w: %w", errNoResponders, resp.Error)
	case resp.Error != nil:
		return 0, resp.Error
	case resp.Message == nil:
		return 0, fmt.Errorf("%w: no message in %q", errInvalidPubAck, m.Data)
	}
	return resp.Message.Seq, nil
}

// raise writes the session's fence in every stream that takes one, at once, unless it did
// already: a compare-and-set from what read found. An error ends the session: errFencedOut
// when another session wrote its fence meanwhile, errNoResponders when a stream is gone (the
// streams are then checked again), and a full turns stream's refusal as a streamFullError.
func (f *sessionFence) raise(ctx context.Context) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.raised {
		return nil
	}
	if f.unknown.Load() {
		return errFenceUnknown
	}
	var prev prevFences
	select {
	case prev = <-f.prev:
		f.prev <- prev // for a later pipeline of the session, should this one fail first
	case <-ctx.Done():
		return fmt.Errorf("read the stream fences: %w", ctx.Err())
	}
	if prev.err != nil {
		return prev.err
	}
	js, err := jetstream.New(f.nc)
	if err != nil {
		return fmt.Errorf("jetstream: %w", err)
	}
	var errs [laneCount]error
	var wg sync.WaitGroup
	for lane := range laneCount {
		if f.state[lane].on {
			wg.Go(func() { errs[lane] = f.write(ctx, js, lane, prev.seq[lane]) })
		}
	}
	wg.Wait()
	if err := errors.Join(errs[:]...); err != nil {
		return err
	}
	f.raised = true
	return nil
}

// write writes the fence of lane as a compare-and-set from prev, the sequence of the fence
// message it replaces (0: none).
func (f *sessionFence) write(ctx context.Context, js jetstream.JetStream, lane int, prev uint64) error {
	msg := nats.NewMsg(f.subjects[lane])
	body, err := json.Marshal(fenceBody{Slot: f.slot, Started: f.started})
	if err != nil {
		return fmt.Errorf("fence body: %w", err)
	}
	msg.Data = body
	msg.Header[jetstream.ExpectedLastSubjSeqHeader] = []string{strconv.FormatUint(prev, 10)}
	if f.state[lane].rollup {
		msg.Header[jetstream.MsgRollup] = []string{jetstream.MsgRollupSubject}
	}
	ack, err := js.PublishMsg(ctx, msg)
	// A replicated stream answers 10164 while an earlier check of the subject is in process
	// (just after the stream was created or a leader change, too): that passes.
	for try := 1; try <= fenceRetries && isAPIError(err, checkInProcess); try++ {
		if retryIn(ctx, time.Duration(try)*10*time.Millisecond) != nil {
			break
		}
		ack, err = js.PublishMsg(ctx, msg)
	}
	if err != nil {
		var api *jetstream.APIError
		if !errors.As(err, &api) {
			f.unknown.Store(true)
		}
		err = asFencedOut(asStreamFull(goneAsNoResponders(err), lane, f.streams[lane], msg))
		return fmt.Errorf("write the fence %s of stream %s: %w", f.subjects[lane], f.streams[lane], err)
	}
	// A stream that refused the fence for lack of room (a full turns stream) took it now.
	f.m.roomAgain(f.log, lane, f.streams[lane])
	if !f.state[lane].rollup && prev > 0 {
		// One fence message per slot: the previous one goes (the relay does not turn on
		// allow_rollup_hdrs, which would let any publisher purge a stream). Best effort: one
		// left behind is a message more, and is removed by the next session's write.
		f.deletePrev(ctx, lane, prev)
	}
	f.lanes[lane] = laneFence{subject: f.subjects[lane], seq: ack.Sequence, header: []string{strconv.FormatUint(ack.Sequence, 10)},
		subj: []string{f.subjects[lane]}, at: time.Now()}
	return nil
}

// deletePrev deletes the fence message at seq of lane's stream ($JS.API.STREAM.MSG.DELETE),
// logging a failure at DEBUG.
func (f *sessionFence) deletePrev(ctx context.Context, lane int, seq uint64) {
	req, err := json.Marshal(struct {
		Seq     uint64 `json:"seq"`
		NoErase bool   `json:"no_erase"`
	}{seq, true})
	if err == nil {
		_, err = f.nc.RequestWithContext(ctx, "$JS.API.STREAM.MSG.DELETE."+f.streams[lane], req)
	}
	if err != nil {
		f.log.Debug("could not delete the previous fence message", "stream", f.streams[lane], "stream_seq", seq, "error", err)
	}
}

// goneAsNoResponders returns errNoResponders, wrapping err, when err says a stream is gone
// (deleted while the relay ran): Run then checks the streams again before the next session.
func goneAsNoResponders(err error) error {
	if errors.Is(err, jetstream.ErrStreamNotFound) || errors.Is(err, jetstream.ErrNoStreamResponse) || errors.Is(err, nats.ErrNoResponders) {
		return fmt.Errorf("%w: %w", errNoResponders, err)
	}
	return err
}

// refreshDue reports whether the fence of lane should be written again before the next send to
// its stream: half of a limit by which the stream drops its oldest messages is used up since
// it was written.
func (f *sessionFence) refreshDue(lane int, now time.Time) bool {
	f.mu.Lock() // a pipeline that ended may still be raising the fence (see mu)
	defer f.mu.Unlock()
	st, lf := &f.state[lane], &f.lanes[lane]
	if !st.on || !f.raised {
		return false
	}
	if st.maxAge > 0 && now.Sub(lf.at) >= st.maxAge/2 {
		return true
	}
	acked := f.acked[lane].Load()
	if acked <= lf.seq {
		return false
	}
	after := int64(min(acked-lf.seq, 1<<62))
	if st.maxMsgs > 0 && after >= max(1, st.maxMsgs/2) {
		return true
	}
	// Other relays (shards) write to the stream too: its bytes since the fence are estimated
	// from the sequences, at this session's own average size.
	return st.maxBytes > 0 && lf.sentMsgs > 0 && after*(lf.sentBytes/lf.sentMsgs) >= st.maxBytes/2
}

// refresh writes the fence of lane again, from the session's own.
func (f *sessionFence) refresh(ctx context.Context, lane int) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.unknown.Load() {
		return errFenceUnknown
	}
	js, err := jetstream.New(f.nc)
	if err != nil {
		return fmt.Errorf("jetstream: %w", err)
	}
	return f.write(ctx, js, lane, f.lanes[lane].seq)
}

// stamp makes msg, about to be sent to the stream of lane, carry the session's fence there.
// It sets the header map's entries directly: nats.go sends header names as they are in the
// map.
func (f *sessionFence) stamp(msg *nats.Msg, lane int) {
	if f == nil || !f.state[lane].on {
		return
	}
	lf := &f.lanes[lane]
	if msg.Header == nil {
		msg.Header = nats.Header{}
	}
	msg.Header[jetstream.ExpectedLastSubjSeqHeader] = lf.header
	msg.Header[jetstream.ExpectedLastSubjSeqSubjHeader] = lf.subj
	lf.sentMsgs++
	lf.sentBytes += int64(eventSize(msg)) // the body and an allowance for subject and headers
}

// ackedAt records a PubAck's stream sequence for lane (on nats.go's goroutine).
func (f *sessionFence) ackedAt(lane int, seq uint64) {
	if f == nil {
		return
	}
	for {
		cur := f.acked[lane].Load()
		if seq <= cur || f.acked[lane].CompareAndSwap(cur, seq) {
			return
		}
	}
}
