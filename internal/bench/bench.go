package bench

import (
	"context"
	"errors"
	"fmt"
	"runtime"
	"time"

	"github.com/jackc/pgx/v5/pgconn"
)

// runner is one run: its configuration, environment, report and progress.
type runner struct {
	cfg  *Config
	e    *env
	rep  *Report
	prog *progress
}

// Run runs the benchmark cfg describes and returns what it measured. It creates a database
// of its own on cfg.DatabaseURL's server and streams of its own on cfg.NATS's, and removes
// them before it returns, also when ctx ends.
func Run(ctx context.Context, cfg Config) (*Report, error) {
	cfg, err := cfg.withDefaults()
	if err != nil {
		return nil, err
	}
	began := time.Now()
	prog := newProgress(cfg.Progress, cfg.ProgressTTY)
	defer prog.done()
	prog.phase("creating the bench database")
	e, err := openEnv(ctx, &cfg)
	if err != nil {
		return nil, err
	}
	defer e.close(ctx)
	r := &runner{cfg: &cfg, e: e, rep: newReport(&cfg), prog: prog}
	r.rep.Environment = Environment{CPUs: runtime.NumCPU(), GoVersion: runtime.Version(), PostgresVersion: e.pgServer,
		NATSVersion: e.nc.ConnectedServerVersion(), NATSInProcess: cfg.NATSInProcess, WalsenderMeasured: e.localPG}
	if err := r.run(ctx); err != nil {
		return nil, err
	}
	r.rep.WallSeconds = time.Since(began).Seconds()
	return r.rep, nil
}

// run runs the selected parts in order.
func (r *runner) run(ctx context.Context) error {
	cfg := r.cfg
	if cfg.has(PartCatchUp) || cfg.has(PartBackfill) {
		b := backlog{key: backlogKey(1, conversations), rowsPerTx: 1, convs: conversations,
			profile: cfg.ProfileDir != "", backfill: cfg.has(PartBackfill)}
		if cfg.has(PartCatchUp) {
			b.contenders = append(cfg.catchUpContenders(), cPublish)
		}
		if err := r.runBacklog(ctx, b); err != nil {
			return err
		}
	}
	if cfg.has(PartCatchUp) {
		b := backlog{key: backlogKey(100, conversations), rowsPerTx: 100, convs: conversations, contenders: cfg.catchUpContenders()}
		if err := r.runBacklog(ctx, b); err != nil {
			return err
		}
	}
	if cfg.has(PartHot) {
		for _, convs := range []int{10, 1} {
			b := backlog{key: backlogKey(1, convs), rowsPerTx: 1, convs: convs, contenders: hotReaders}
			if err := r.runBacklog(ctx, b); err != nil {
				return err
			}
		}
	}
	if cfg.has(PartLatency) {
		if err := r.runLatency(ctx); err != nil {
			return err
		}
	}
	return nil
}

// sleepCtx sleeps for d, or until ctx ends (then it returns ctx's error).
func sleepCtx(ctx context.Context, d time.Duration) error {
	if d <= 0 {
		return ctx.Err()
	}
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}

// isSQLState reports whether err is a PostgreSQL error with SQLSTATE code.
func isSQLState(err error, code string) bool {
	var pgErr *pgconn.PgError
	return errors.As(err, &pgErr) && pgErr.Code == code
}

// thousands formats v rounded to an integer with commas: 200,000.
func thousands(v float64) string {
	s := fmt.Sprintf("%.0f", v)
	neg := len(s) > 0 && s[0] == '-'
	if neg {
		s = s[1:]
	}
	out := make([]byte, 0, len(s)+len(s)/3)
	for i := range len(s) {
		if i > 0 && (len(s)-i)%3 == 0 {
			out = append(out, ',')
		}
		out = append(out, s[i])
	}
	if neg {
		return "-" + string(out)
	}
	return string(out)
}
