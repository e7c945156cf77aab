package bench

import (
	"context"
	"fmt"
	"math"
	"slices"
	"time"

	"github.com/jackc/pglogrepl"

	"github.com/batonhq/baton/wire"
)

// Contenders of a catch-up.
const (
	cRelay       = "relay"        // `baton relay`, a process of its own
	cPlain       = "plain"        // RunPlainRelay, a process of its own
	cDecodeEager = "decode_eager" // the bare pgoutput client, reading as messages come
	cPublish     = "publish"      // bare async publishing of as many turn-shaped events
)

// cDecodeBulk names the bare pgoutput client reading the socket in bulk with pause p between
// small reads: decode_bulk_200us.
func cDecodeBulk(p time.Duration) string { return fmt.Sprintf("decode_bulk_%dus", p.Microseconds()) }

// decoders are the decode-ceiling contenders with their pauses (0: the eager client).
func decoders() map[string]time.Duration {
	m := map[string]time.Duration{cDecodeEager: 0}
	for _, p := range bulkPauses {
		m[cDecodeBulk(p)] = p
	}
	return m
}

// catchUpReaders and hotReaders are the contenders that read a slot of their own on the
// 1,000-conversation backlogs and on the hot ones.
var (
	catchUpReaders = slices.Concat([]string{cRelay, cDecodeEager}, bulkContenders(), []string{cPlain})
	hotReaders     = []string{cRelay, cPlain}
)

// backlog is a backlog to catch up with and who runs on it.
type backlog struct {
	key        string // figure key prefix
	rowsPerTx  int
	convs      int
	contenders []string // in the first round's order
	profile    bool     // run a profiled relay after the rounds
	backfill   bool     // run a relay's first start on the pending rows after the rounds
}

// title says what the backlog is, for the table.
func backlogTitle(rows, rowsPerTx, convs int) string {
	tx := "1-row transactions"
	if rowsPerTx > 1 {
		tx = fmt.Sprintf("%d-row transactions", rowsPerTx)
	}
	conv := fmt.Sprintf("%s conversations", thousands(float64(convs)))
	switch convs {
	case 1:
		conv = "1 conversation (hot)"
	case 10:
		conv = "10 conversations (hot)"
	}
	return fmt.Sprintf("catch-up of %s rows: %s over %s", thousands(float64(rows)), tx, conv)
}

// backlogKey is the figure key prefix of a backlog: tx<rows per tx>_conv<conversations>.
func backlogKey(rowsPerTx, convs int) string { return fmt.Sprintf("tx%d_conv%d", rowsPerTx, convs) }

// slotFor is the slot and subject prefix of one contender in one round.
type slotFor struct{ slot, prefix string }

// runBacklog writes b's backlog once, after every contender's slot exists, and runs the
// contenders on it one at a time, round after round, each round in another order.
func (r *runner) runBacklog(ctx context.Context, b backlog) error {
	e, cfg := r.e, r.cfg
	if err := clearOutbox(ctx, e.pool); err != nil {
		return err
	}
	r.prog.phase("%s: creating the slots", b.key)
	slots := make([]map[string]slotFor, cfg.Rounds)
	for round := range cfg.Rounds {
		slots[round] = map[string]slotFor{}
		for _, c := range b.contenders {
			slot, prefix := e.names()
			slots[round][c] = slotFor{slot, prefix}
			if n, ok := isShards(c); ok {
				if err := e.prepareShardSlots(ctx, slot, prefix, n); err != nil {
					return fmt.Errorf("%s: create the shard relays' slots: %w", b.key, err)
				}
				continue
			}
			switch c {
			case cRelay:
				if err := e.prepareRelaySlot(ctx, slot, prefix); err != nil {
					return fmt.Errorf("%s: create the relay's slot: %w", b.key, err)
				}
			case cPublish:
			default:
				if err := createBareSlot(ctx, e.pool, slot); err != nil {
					return err
				}
			}
		}
	}
	var prof slotFor
	if b.profile {
		prof.slot, prof.prefix = e.names()
		if err := e.prepareRelaySlot(ctx, prof.slot, prof.prefix); err != nil {
			return fmt.Errorf("%s: create the profiled relay's slot: %w", b.key, err)
		}
	}

	r.prog.phase("%s: writing %s rows", b.key, thousands(float64(cfg.Rows)))
	began := time.Now()
	if err := writeBacklog(ctx, e.pool, cfg.Rows, b.rowsPerTx, min(2, b.convs), b.convs); err != nil {
		return err
	}
	end, err := walInsertLSN(ctx, e.pool)
	if err != nil {
		return err
	}
	cfg.Logger.Debug("backlog written", "backlog", b.key, "took", time.Since(began), "wal_end", end)

	for round := range cfg.Rounds {
		for _, c := range rotate(b.contenders, round) {
			r.prog.phase("%s, round %d/%d: %s", b.key, round+1, cfg.Rounds, contenderLabel(c))
			if err := r.runContender(ctx, b, round, c, slots[round][c], end); err != nil {
				return fmt.Errorf("%s, round %d, %s: %w", b.key, round+1, c, err)
			}
		}
		r.catchUpRatios(b, round)
	}
	if b.profile {
		r.prog.phase("%s: profiling the relay", b.key)
		if err := r.profileRelay(ctx, b, prof, end); err != nil {
			return fmt.Errorf("%s, profile: %w", b.key, err)
		}
	}
	if b.backfill {
		if err := r.runBackfill(ctx); err != nil {
			return fmt.Errorf("backfill: %w", err)
		}
	}
	return nil
}

// rotate returns s rotated left by n: round n starts with another contender.
func rotate(s []string, n int) []string {
	if len(s) == 0 {
		return nil
	}
	n %= len(s)
	return append(append([]string(nil), s[n:]...), s[:n]...)
}

func contenderLabel(c string) string {
	switch c {
	case cRelay:
		return "baton relay (process)"
	case cPlain:
		return "plain relay (process)"
	case cDecodeEager:
		return "decode ceiling, eager client"
	case cPublish:
		return "publish ceiling"
	}
	if p, ok := decoders()[c]; ok {
		return fmt.Sprintf("decode ceiling, bulk-reading client (%v pauses)", p)
	}
	if n, ok := isShards(c); ok {
		return fmt.Sprintf("%d shard relays at once (baton relay --shard K/%d, processes)", n, n)
	}
	return c
}

// bulkContenders are the names of the bulk-reading decode clients, one per pause.
func bulkContenders() []string {
	var cs []string
	for _, p := range bulkPauses {
		cs = append(cs, cDecodeBulk(p))
	}
	return cs
}

// runContender runs contender c of round on its slot and records its figures.
func (r *runner) runContender(ctx context.Context, b backlog, round int, c string, s slotFor, end pglogrepl.LSN) error {
	e, rows := r.e, r.cfg.Rows
	key := b.key + "." + c + "."
	if pause, ok := decoders()[c]; ok {
		x, err := decode(ctx, e, s.slot, rows, pause)
		if err != nil {
			return err
		}
		r.rep.set(round, key+"rows_per_s", contenderLabel(c), "rows/s", float64(rows)/x.took.Seconds())
		r.rep.set(round, key+"walsender_cpu_us_per_row", contenderLabel(c)+": walsender CPU", "us/row", x.walCPU/float64(rows)*1e6)
		ceiling := math.NaN()
		for d := range decoders() {
			if v := r.rep.get(round, b.key+"."+d+".rows_per_s"); !math.IsNaN(v) && (math.IsNaN(ceiling) || v > ceiling) {
				ceiling = v
			}
		}
		if !math.IsNaN(ceiling) {
			r.rep.set(round, b.key+".decode_ceiling.rows_per_s", "decode ceiling (the highest)", "rows/s", ceiling)
		}
		return dropSlot(ctx, e.pool, s.slot)
	}
	if n, ok := isShards(c); ok {
		return r.runShards(ctx, round, key, contenderLabel(c), n, s, end)
	}
	switch c {
	case cPublish:
		took, err := publishCeiling(ctx, e, s.prefix, rows, b.convs)
		if err != nil {
			return err
		}
		r.rep.set(round, key+"msgs_per_s", "publish ceiling (async, 4096 in flight)", "msgs/s", float64(rows)/took.Seconds())
		return e.deleteStreams(ctx, s.prefix)
	case cRelay, cPlain:
		var p *process
		var err error
		if c == cRelay {
			p, err = e.startRelay(ctx, s.slot, s.prefix)
		} else {
			p, err = e.startPlain(ctx, s.slot, s.prefix)
		}
		if err != nil {
			return err
		}
		x, err := r.follow(ctx, p, s.slot, wire.StreamName(s.prefix, wire.KindTurns), rows, end)
		p.stop(stopGrace)
		if err != nil {
			return err
		}
		r.setProcessFigures(round, key, contenderLabel(c), x)
		if err := dropSlot(ctx, e.pool, s.slot); err != nil {
			return err
		}
		return e.deleteStreams(ctx, s.prefix)
	}
	return fmt.Errorf("unknown contender %q", c)
}

// setProcessFigures records a relay process's catch-up figures under key.
func (r *runner) setProcessFigures(round int, key, label string, x childRun) {
	rows := float64(r.cfg.Rows)
	set := func(name, what, unit string, v float64) { r.rep.set(round, key+name, label+what, unit, v) }
	set("rows_per_s", "", "rows/s", rows/x.streamingToStored.Seconds())
	set("start_to_stored_s", ": process start → every event stored", "s", x.startToStored.Seconds())
	set("confirm_s", ": streaming → slot confirmed the end", "s", x.confirm.Seconds())
	set("cpu_us_per_row", ": its CPU", "us/row", x.cpu/rows*1e6)
	set("walsender_cpu_us_per_row", ": its walsender's CPU", "us/row", x.walCPU/rows*1e6)
	if r.cfg.NATSInProcess {
		set("nats_cpu_us_per_row", ": NATS server's CPU", "us/row", x.natsCPU/rows*1e6)
	}
	set("peak_rss_mib", ": peak RSS", "MiB", float64(x.rss)/(1<<20))
}

// catchUpRatios records round's ratios of b.
func (r *runner) catchUpRatios(b backlog, round int) {
	get := func(c, name string) float64 { return r.rep.get(round, b.key+"."+c+"."+name) }
	set := func(name, label string, v float64) {
		if !math.IsNaN(v) {
			r.rep.set(round, b.key+".ratio."+name, label, "x", v)
		}
	}
	relay := get(cRelay, "rows_per_s")
	set("relay_vs_plain", "baton relay ÷ plain relay (rows/s)", ratio(relay, get(cPlain, "rows_per_s")))
	if n := r.cfg.Shards; n > 1 {
		set(cShards(n)+"_vs_relay", fmt.Sprintf("%d shard relays together ÷ one relay (rows/s)", n), ratio(get(cShards(n), "rows_per_s"), relay))
	}
	set("relay_vs_decode_ceiling", "baton relay ÷ decode ceiling (rows/s)", ratio(relay, get("decode_ceiling", "rows_per_s")))
	if b.convs == conversations {
		set("relay_vs_publish", "baton relay ÷ publish ceiling", ratio(relay, r.rep.get(round, backlogKey(1, conversations)+".publish.msgs_per_s")))
	}
	set("relay_cpu_vs_plain_cpu", "baton relay CPU ÷ plain relay CPU (per row)", ratio(get(cRelay, "cpu_us_per_row"), get(cPlain, "cpu_us_per_row")))
	if b.convs < conversations {
		base := backlogKey(1, conversations)
		set("relay_vs_"+base, "baton relay: hot ÷ 1,000-conversation rate", ratio(relay, r.rep.get(round, base+".relay.rows_per_s")))
		set("plain_vs_"+base, "plain relay: hot ÷ 1,000-conversation rate",
			ratio(get(cPlain, "rows_per_s"), r.rep.get(round, base+".plain.rows_per_s")))
	}
}

// childRun is what follow measured of a relay process.
type childRun struct {
	startToStored     time.Duration // process start → the stream holds every event
	streamingToStored time.Duration // its "streaming" line → the stream holds every event
	confirm           time.Duration // its "streaming" line → the slot confirmed end (0: not waited for)
	cpu               float64       // its CPU seconds until every event was stored
	walCPU            float64       // its walsender's, from streaming until then (NaN: not measurable)
	natsCPU           float64       // this process's, from streaming until then
	rss               int64         // its peak RSS
}

// follow waits until p streams and stream holds want events, then, when end is set, until the
// slot confirmed end; and measures p meanwhile. The stream must end with exactly want events:
// one more is a duplicate JetStream did not drop.
func (r *runner) follow(ctx context.Context, p *process, slot, stream string, want int, end pglogrepl.LSN) (childRun, error) {
	e := r.e
	limit := runTimeout(want)
	ctx, cancel := context.WithTimeout(ctx, limit)
	defer cancel()
	if err := p.waitStreaming(ctx, limit); err != nil {
		return childRun{}, err
	}
	walPID, err := e.walsender(ctx, slot)
	if err != nil {
		return childRun{}, err
	}
	wal0, nats0 := cpuSeconds(walPID), selfCPU()
	var x childRun
	for {
		n, err := e.streamMsgs(ctx, stream)
		if err != nil && ctx.Err() == nil {
			return childRun{}, err
		}
		if n >= want {
			now := time.Now()
			x.startToStored, x.streamingToStored = now.Sub(p.startedAt), now.Sub(p.streamingAt)
			break
		}
		r.prog.count(n, want)
		if err := p.alive(); err != nil {
			return childRun{}, err
		}
		if ctx.Err() != nil {
			return childRun{}, fmt.Errorf("%s stored %d of %d events within %v", p.name, n, want, limit)
		}
		_ = sleepCtx(ctx, 5*time.Millisecond)
	}
	x.cpu, x.walCPU, x.natsCPU = cpuSeconds(p.pid()), cpuSeconds(walPID)-wal0, selfCPU()-nats0
	for end > 0 {
		lsn, err := slotConfirmed(ctx, e.pool, slot)
		if err != nil && ctx.Err() == nil {
			return childRun{}, err
		}
		if lsn >= end {
			x.confirm = time.Since(p.streamingAt)
			break
		}
		if ctx.Err() != nil {
			return childRun{}, fmt.Errorf("%s: slot confirmed %s, never reached %s", p.name, lsn, end)
		}
		_ = sleepCtx(ctx, 5*time.Millisecond)
	}
	if x.rss, err = peakRSS(p.pid()); err != nil {
		return childRun{}, err
	}
	n, err := e.streamMsgs(ctx, stream)
	if err != nil {
		return childRun{}, err
	}
	if n != want {
		return childRun{}, fmt.Errorf("%s holds %d events, want %d", stream, n, want)
	}
	return x, nil
}

// runTimeout bounds one contender's handling of n rows: generous, so that a loaded machine
// only slows a run down.
func runTimeout(n int) time.Duration {
	return 2*time.Minute + time.Duration(n)*time.Millisecond
}

// runBackfill measures a relay's first start on the pending rows of the backlog: it has no
// slot yet, creates one and publishes every pending row from a query.
func (r *runner) runBackfill(ctx context.Context) error {
	e, rows := r.e, r.cfg.Rows
	slot, prefix := e.names()
	for round := range r.cfg.Rounds {
		r.prog.phase("backfill, round %d/%d: baton relay's first start on %s pending rows", round+1, r.cfg.Rounds, thousands(float64(rows)))
		p, err := e.startRelay(ctx, slot, prefix)
		if err != nil {
			return err
		}
		x, err := r.follow(ctx, p, slot, wire.StreamName(prefix, wire.KindTurns), rows, 0)
		p.stop(stopGrace)
		if err != nil {
			return err
		}
		const key = "backfill.relay."
		r.rep.set(round, key+"rows_per_s", "baton relay's first start: rows published per second", "rows/s", float64(rows)/x.startToStored.Seconds())
		r.rep.set(round, key+"start_to_stored_s", "baton relay's first start: process start → every event stored", "s", x.startToStored.Seconds())
		r.rep.set(round, key+"cpu_us_per_row", "baton relay's first start: its CPU", "us/row", x.cpu/float64(rows)*1e6)
		r.rep.set(round, key+"peak_rss_mib", "baton relay's first start: peak RSS", "MiB", float64(x.rss)/(1<<20))
		if err := dropSlot(ctx, e.pool, slot); err != nil {
			return err
		}
		if err := e.deleteStreams(ctx, prefix); err != nil {
			return err
		}
		slot, prefix = e.names()
	}
	return nil
}
