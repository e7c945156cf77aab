package bench

import (
	"context"
	"errors"
	"fmt"
	"math"
	"strconv"
	"time"

	"github.com/jackc/pglogrepl"

	"github.com/batonhq/baton/migrations"
	"github.com/batonhq/baton/wire"
)

// MaxBenchShards bounds Config.Shards: each shard is a relay process and a walsender, and a
// bench machine has a few cores.
const MaxBenchShards = 16

// cShards names the contender of Config.Shards shard relays at once: relay_shards2.
func cShards(n int) string { return "relay_shards" + strconv.Itoa(n) }

// isShards reports whether contender c is the shard relays', and their count.
func isShards(c string) (int, bool) {
	var n int
	if !scan(c, "relay_shards%d", &n) || n < 2 {
		return 0, false
	}
	return n, true
}

// catchUpContenders are the contenders reading slots on the 1,000-conversation backlogs: the
// catch-up readers, and the shard relays when Config.Shards asks for them.
func (cfg *Config) catchUpContenders() []string {
	cs := append([]string(nil), catchUpReaders...)
	if cfg.Shards > 1 {
		cs = append(cs, cShards(cfg.Shards))
	}
	return cs
}

// checkShards returns what is wrong with cfg.Shards.
func (cfg *Config) checkShards() []error {
	switch {
	case cfg.Shards == 0:
		return nil
	case cfg.Shards < 2 || cfg.Shards > MaxBenchShards:
		return []error{fmt.Errorf("shards must be 2…%d, not %d", MaxBenchShards, cfg.Shards)}
	case !cfg.has(PartCatchUp):
		return []error{fmt.Errorf("the shard relays run in the %s part, which is not selected", PartCatchUp)}
	}
	return nil
}

// shardSlot is the slot of shard k of the shard relays whose slots are named after base.
func shardSlot(base string, k int) string { return migrations.ShardName(base, k) }

// startShard starts `baton relay --shard k/n` on slot base_k and prefix.
func (e *env) startShard(ctx context.Context, base, prefix string, k, n int) (*process, error) {
	argv := append(append([]string(nil), e.cfg.RelayCommand...), "--shard", fmt.Sprintf("%d/%d", k, n))
	return startProcess(ctx, fmt.Sprintf("baton relay --shard %d/%d", k, n), argv, e.childEnvFor(base, prefix))
}

// prepareShardSlots runs the n shard relays on base and prefix until each streams, then stops
// them: their slots exist with their (empty) first-start backfills, like prepareRelaySlot's.
func (e *env) prepareShardSlots(ctx context.Context, base, prefix string, n int) error {
	ps := make([]*process, 0, n)
	defer func() {
		for _, p := range ps {
			p.stop(stopGrace)
		}
	}()
	for k := range n {
		p, err := e.startShard(ctx, base, prefix, k, n)
		if err != nil {
			return err
		}
		ps = append(ps, p)
	}
	for _, p := range ps {
		if err := p.waitStreaming(ctx, startTimeout); err != nil {
			return err
		}
	}
	for _, p := range ps {
		p.stop(stopGrace)
	}
	return waitSlotsIdle(ctx, e.pool)
}

// runShards runs the n shard relays at once on the backlog, every one a process of its own,
// and records their aggregate figures under key: rows/s from the first one streaming until
// the stream holds every event, and until every shard's slot confirmed end.
func (r *runner) runShards(ctx context.Context, round int, key, label string, n int, s slotFor, end pglogrepl.LSN) error {
	e, rows := r.e, r.cfg.Rows
	limit := runTimeout(rows)
	ctx, cancel := context.WithTimeout(ctx, limit)
	defer cancel()
	ps := make([]*process, 0, n)
	defer func() {
		for _, p := range ps {
			p.stop(stopGrace)
		}
	}()
	for k := range n {
		p, err := e.startShard(ctx, s.slot, s.prefix, k, n)
		if err != nil {
			return err
		}
		ps = append(ps, p)
	}
	var first time.Time
	for _, p := range ps {
		if err := p.waitStreaming(ctx, limit); err != nil {
			return err
		}
		if first.IsZero() || p.streamingAt.Before(first) {
			first = p.streamingAt
		}
	}
	stream := wire.StreamName(s.prefix, wire.KindTurns)
	var stored time.Time
	for {
		got, err := e.streamMsgs(ctx, stream)
		if err != nil && ctx.Err() == nil {
			return err
		}
		if got >= rows {
			stored = time.Now()
			break
		}
		r.prog.count(got, rows)
		for _, p := range ps {
			if err := p.alive(); err != nil {
				return err
			}
		}
		if ctx.Err() != nil {
			return fmt.Errorf("%d shard relays stored %d of %d events within %v", n, got, rows, limit)
		}
		_ = sleepCtx(ctx, 5*time.Millisecond)
	}
	cpu := 0.0
	for _, p := range ps {
		cpu += cpuSeconds(p.pid())
	}
	var confirmed time.Time
	for k := range n {
		for {
			lsn, err := slotConfirmed(ctx, e.pool, shardSlot(s.slot, k))
			if err != nil && ctx.Err() == nil {
				return err
			}
			if lsn >= end {
				break
			}
			if ctx.Err() != nil {
				return fmt.Errorf("shard %d: slot confirmed %s, never reached %s", k, lsn, end)
			}
			_ = sleepCtx(ctx, 5*time.Millisecond)
		}
	}
	confirmed = time.Now()
	got, err := e.streamMsgs(ctx, stream)
	if err != nil {
		return err
	}
	if got != rows {
		return fmt.Errorf("%s holds %d events, want %d", stream, got, rows)
	}
	set := func(name, what, unit string, v float64) { r.rep.set(round, key+name, label+what, unit, v) }
	set("rows_per_s", ": together", "rows/s", float64(rows)/stored.Sub(first).Seconds())
	set("confirm_s", ": first streaming → every shard's slot confirmed the end", "s", confirmed.Sub(first).Seconds())
	if !math.IsNaN(cpu) {
		set("cpu_us_per_row", ": their CPU together", "us/row", cpu/float64(rows)*1e6)
	}
	for _, p := range ps {
		p.stop(stopGrace)
	}
	var errs []error
	for k := range n {
		if err := dropSlot(ctx, e.pool, shardSlot(s.slot, k)); err != nil {
			errs = append(errs, err)
		}
	}
	return errors.Join(append(errs, e.deleteStreams(ctx, s.prefix))...)
}
