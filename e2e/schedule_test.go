package e2e

import (
	"fmt"
	"math/rand/v2"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// The kinds of fault the chaos run injects.
const (
	faultKill      = "kill"      // SIGKILL a relay or a worker, restart it after For
	faultTerm      = "term"      // SIGTERM (must exit 0), restart after For
	faultStop      = "stop"      // SIGSTOP for For, then SIGCONT
	faultNATS      = "nats"      // stop the NATS server for For, start it on the same store
	faultPGFast    = "pg-fast"   // fast shutdown of Postgres, start after For
	faultPGCrash   = "pg-crash"  // immediate shutdown (no checkpoint), start after For
	faultWalsender = "walsender" // pg_terminate_backend of the slot's walsender
	faultLatency   = "latency"   // a process's proxy delays every chunk by Latency for For
	faultReset     = "reset"     // a process's proxy resets every connection
	faultFreeze    = "freeze"    // a process's proxy forwards nothing (half-open) for For
	// Faults that outlast the streams' duplicate window (chaosDuplicates): only the stream
	// fence keeps what a relay sent before them from being stored again after them.
	faultFreezeLong = "freeze-long" // the streaming relay's path to NATS or Postgres frozen for For
	faultStopLong   = "stop-long"   // SIGSTOP of the streaming relay (or a worker) for For
	faultSlowLink   = "slow-link"   // a process's proxy forwards what Postgres sends at Rate bytes/s for For
	faultTurnsFull  = "turns-full"  // the turns stream's MaxMsgs lowered to what it holds plus Slack, for For
)

// chaosDuplicates is the streams' duplicate window in the chaos run (the relays'
// BATON_STREAM_DUPLICATES): short, so that the long faults outlast it. The relay's stream
// fence, not the window, keeps every stream's events once (DESIGN, the stream fence).
const chaosDuplicates = 10 * time.Second

// fault is one entry of the schedule.
type fault struct {
	At   time.Duration // from the start of the load
	Kind string
	// Target names what the fault hits: "relay:active" or "relay:standby" (resolved when the
	// fault runs), "worker-N", or for proxy faults "<process>/pg" or "<process>/nats"; empty
	// for the servers' faults.
	Target  string
	For     time.Duration // down, stopped, frozen or slowed for this long
	Latency time.Duration // faultLatency only
	Rate    int64         // faultSlowLink only: bytes a second
	Slack   int64         // faultTurnsFull only: room left in the turns stream, in messages
}

func (f fault) String() string {
	s := fmt.Sprintf("+%5.1fs %-9s", f.At.Seconds(), f.Kind)
	if f.Target != "" {
		s += " " + f.Target
	}
	if f.For > 0 {
		s += fmt.Sprintf(" for %v", f.For)
	}
	if f.Latency > 0 {
		s += fmt.Sprintf(" latency %v", f.Latency)
	}
	if f.Rate > 0 {
		s += fmt.Sprintf(" rate %d KiB/s", f.Rate>>10)
	}
	if f.Slack > 0 {
		s += fmt.Sprintf(" room %d", f.Slack)
	}
	return s
}

// faultWeights are how often each kind is drawn, relative to the others.
var faultWeights = []struct {
	kind   string
	weight int
}{
	{faultKill, 4}, {faultTerm, 2}, {faultStop, 3}, {faultNATS, 2}, {faultPGFast, 1}, {faultPGCrash, 1},
	{faultWalsender, 2}, {faultLatency, 2}, {faultReset, 3}, {faultFreeze, 3},
	{faultFreezeLong, 2}, {faultStopLong, 1}, {faultSlowLink, 2}, {faultTurnsFull, 2},
}

// scheduleWarmup is how long the load runs before the first fault.
const scheduleWarmup = 5 * time.Second

// proxied are the processes that talk through proxies; the subscriber has no Postgres proxy.
var proxied = []string{"relay-0", "relay-1", "worker-0", "worker-1", "worker-2", "subscriber"}

// schedule draws the faults of a run of length from seed: the same seed gives the same
// schedule. Faults follow each other (each one healed before the next, a gap of 1-3s
// between), and the last ends by length.
func schedule(seed uint64, length time.Duration) []fault {
	r := rand.New(rand.NewPCG(seed, 0x6261746f6e))
	total := 0
	for _, w := range faultWeights {
		total += w.weight
	}
	between := func(lo, hi time.Duration) time.Duration {
		return lo + time.Duration(r.Int64N(int64(hi-lo)/int64(100*time.Millisecond)+1))*100*time.Millisecond
	}
	var out []fault
	at := scheduleWarmup
	for {
		n := r.IntN(total)
		var kind string
		for _, w := range faultWeights {
			if n < w.weight {
				kind = w.kind
				break
			}
			n -= w.weight
		}
		f := fault{At: at, Kind: kind}
		// A relay fault hits the streaming relay three times in four.
		relay := "relay:active"
		if r.IntN(4) == 0 {
			relay = "relay:standby"
		}
		worker := fmt.Sprintf("worker-%d", r.IntN(3))
		pick := relay
		if r.IntN(2) == 0 {
			pick = worker
		}
		proc := proxied[r.IntN(len(proxied))]
		path := proc + "/nats"
		if proc != "subscriber" && r.IntN(2) == 0 {
			path = proc + "/pg"
		}
		// cost is how long the fault takes beyond For (restarts, recovery).
		cost := time.Second
		switch kind {
		case faultKill:
			f.Target, f.For, cost = pick, between(0, 3*time.Second), 2*time.Second
		case faultTerm:
			f.Target, f.For, cost = pick, between(0, 2*time.Second), 4*time.Second
		case faultStop:
			// A worker stopped past its lease (3s) loses its turns to another.
			f.Target, f.For = pick, between(time.Second, 6*time.Second)
		case faultNATS:
			f.For, cost = between(time.Second, 4*time.Second), 2*time.Second
		case faultPGFast, faultPGCrash:
			f.For, cost = between(0, 2*time.Second), 4*time.Second
		case faultWalsender:
		case faultLatency:
			f.Target, f.For, f.Latency = path, between(3*time.Second, 10*time.Second), between(20*time.Millisecond, 200*time.Millisecond)
		case faultReset:
			f.Target = path
		case faultFreeze:
			// Up to past the relay's liveness timeout (10s), after which it reconnects.
			f.Target, f.For = path, between(time.Second, 15*time.Second)
		case faultFreezeLong:
			f.Target, f.For, cost = "relay:active/nats", chaosDuplicates+between(2*time.Second, 10*time.Second), 3*time.Second
			if r.IntN(3) == 0 {
				f.Target = "relay:active/pg"
			}
		case faultStopLong:
			f.Target, f.For, cost = "relay:active", chaosDuplicates+between(2*time.Second, 10*time.Second), 3*time.Second
			if r.IntN(4) == 0 {
				f.Target = worker
			}
		case faultSlowLink:
			// Mostly the replication stream; a worker's queries otherwise.
			f.Target, f.For = "relay:active/pg", between(5*time.Second, 15*time.Second)
			if r.IntN(3) == 0 {
				f.Target = worker + "/pg"
			}
			f.Rate = (16 + r.Int64N(241)) << 10 // 16-256 KiB/s
		case faultTurnsFull:
			f.For, f.Slack = between(5*time.Second, 15*time.Second), 1+r.Int64N(20)
		}
		end := at + f.For + cost
		if end > length {
			return out
		}
		out = append(out, f)
		at = end + between(time.Second, 3*time.Second)
	}
}

// backgroundSchedule draws, from the same seed, the faults that overlap the main schedule's:
// stretches of latency on one process's path to Postgres or NATS, and connection resets,
// one at a time, whatever the main schedule does meanwhile (a main-schedule latency fault on
// the same path ends the overlapping one early).
func backgroundSchedule(seed uint64, length time.Duration) []fault {
	r := rand.New(rand.NewPCG(seed, 0x6f7665726c6170))
	between := func(lo, hi time.Duration) time.Duration {
		return lo + time.Duration(r.Int64N(int64(hi-lo)/int64(100*time.Millisecond)+1))*100*time.Millisecond
	}
	var out []fault
	at := scheduleWarmup + between(0, 10*time.Second)
	for {
		proc := proxied[r.IntN(len(proxied))]
		path := proc + "/nats"
		if proc != "subscriber" && r.IntN(2) == 0 {
			path = proc + "/pg"
		}
		f := fault{At: at, Kind: faultReset, Target: path}
		if r.IntN(3) > 0 {
			f.Kind, f.For, f.Latency = faultLatency, between(5*time.Second, 20*time.Second), between(10*time.Millisecond, 80*time.Millisecond)
		}
		if at+f.For > length {
			return out
		}
		out = append(out, f)
		at += f.For + between(5*time.Second, 15*time.Second)
	}
}

func TestScheduleReplaysFromItsSeed(t *testing.T) {
	t.Parallel()
	a := schedule(42, 3*time.Minute)
	require.Equal(t, a, schedule(42, 3*time.Minute), "the same seed gives the same schedule")
	require.NotEqual(t, a, schedule(43, 3*time.Minute))
	require.Greater(t, len(a), 10)
	kinds := map[string]bool{}
	for _, s := range []uint64{1, 2, 3, 4, 5} {
		prev := time.Duration(0)
		for _, f := range schedule(s, 3*time.Minute) {
			kinds[f.Kind] = true
			require.GreaterOrEqual(t, f.At, prev, "faults follow each other: %v", f)
			require.LessOrEqual(t, f.At+f.For, 3*time.Minute)
			prev = f.At + f.For
		}
	}
	require.Len(t, kinds, len(faultWeights), "every kind is drawn")

	bg := backgroundSchedule(42, 3*time.Minute)
	require.Equal(t, bg, backgroundSchedule(42, 3*time.Minute))
	require.NotEqual(t, bg, backgroundSchedule(43, 3*time.Minute))
	require.Greater(t, len(bg), 3)
	for i, f := range bg {
		require.Contains(t, []string{faultLatency, faultReset}, f.Kind)
		require.LessOrEqual(t, f.At+f.For, 3*time.Minute)
		if i > 0 {
			require.GreaterOrEqual(t, f.At, bg[i-1].At+bg[i-1].For, "one at a time")
		}
	}
}
