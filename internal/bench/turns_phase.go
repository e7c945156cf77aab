package bench

import (
	"context"
	"errors"
	"fmt"
	"math"
	"os"
	"os/exec"
	"path/filepath"
	"runtime/pprof"
	"slices"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go"
	"github.com/prometheus/client_golang/prometheus"
	"golang.org/x/sync/errgroup"

	"github.com/batonhq/baton/internal/config"
	"github.com/batonhq/baton/producer"
)

// turnsResult is one phase's measurement in one round.
type turnsResult struct {
	sent, done, failed int

	// Throughput and tools phases.
	seconds     float64 // first producer commit → last reply commit, by the database's clock
	perSecond   float64 // sent / seconds
	claimBatch  float64 // conversations per claim statement, mean
	commitBatch float64 // conversations per final-commit statement, mean
	conflicts   float64 // claims that found the conversation held by another run
	nacked      float64 // JetStream events nacked (redelivered later)
	cpuCores    float64 // CPU time of this process (workers, producers, embedded NATS) / seconds

	// Latency phases.
	conversations int
	achievedRate  float64       // messages per second the producers committed
	clockOffset   time.Duration // database clock − this process's clock, estimated
	p50, p99      time.Duration // producer commit → reply commit
	waitP50       time.Duration // outbox row written → run claimed, by the database's clock
	waitP99       time.Duration
	turnP50       time.Duration // run claimed → reply committed, by the database's clock
	turnP99       time.Duration
}

// summary is the progress line of a finished phase.
func (r turnsResult) summary(ph turnsPhase) string {
	if ph.kind == TurnsKindLatency {
		return fmt.Sprintf("%d of %d replied (%d failed) at %.0f/s: p50 %sms, p99 %sms",
			r.done, r.sent, r.failed, r.achievedRate, turnsMS(r.p50), turnsMS(r.p99))
	}
	return fmt.Sprintf("%d of %d replied (%d failed) in %.2fs: %.0f turns/s", r.done, r.sent, r.failed, r.seconds, r.perSecond)
}

// conversations is how many conversations ph's messages go to.
func (b *Turns) conversations(ph turnsPhase) int {
	if ph.kind == TurnsKindLatency {
		return max(turnsMinLatencyConversations, ph.rate/4)
	}
	return b.cfg.Turns // one per message: every message is one turn
}

func turnsConvID(ph turnsPhase, i int) string {
	if ph.kind == TurnsKindLatency {
		return fmt.Sprintf("l%05d", i)
	}
	return fmt.Sprintf("t%07d", i)
}

func turnsWarmupConvID(i int) string { return fmt.Sprintf("w%03d", i) }

// runPhase runs ph on a database, streams, relay and workers of its own, removed before it
// returns. profileDir, when set, receives a CPU profile of the measured part.
func (b *Turns) runPhase(ctx context.Context, env *turnsEnv, ph turnsPhase, profileDir string) (res turnsResult, err error) {
	setupCtx, cancelSetup := context.WithTimeout(ctx, turnsStartTimeout)
	defer cancelSetup()
	db, err := env.newDatabase(setupCtx)
	if err != nil {
		return res, err
	}
	defer func() {
		if derr := env.dropDatabase(context.WithoutCancel(ctx), db); derr != nil {
			err = errors.Join(err, derr)
		}
	}()
	convs := make([]string, 0, turnsWarmupBatch+b.conversations(ph))
	for i := range turnsWarmupBatch {
		convs = append(convs, turnsWarmupConvID(i))
	}
	for i := range b.conversations(ph) {
		convs = append(convs, turnsConvID(ph, i))
	}
	if _, err := db.pool.Exec(setupCtx, `INSERT INTO conversations (id) SELECT unnest($1::text[])`, convs); err != nil {
		return res, fmt.Errorf("create conversations: %w", err)
	}
	ws, err := b.newWorkers(setupCtx, env, db, ph)
	defer ws.close() // after g.Wait below: the workers have stopped
	if err != nil {
		return res, err
	}
	cancelSetup()

	// The driver ends runCtx when it is done, which stops the relay (SIGTERM) and the workers.
	runCtx, stop := context.WithCancel(ctx)
	defer stop()
	g, gctx := errgroup.WithContext(runCtx)
	if ph.source == TurnsSourceJetStream {
		relay, err := env.startRelay(gctx, db)
		if err != nil {
			return res, err
		}
		g.Go(func() error { return b.waitRelay(gctx, relay) })
	}
	for i, w := range ws.runners {
		g.Go(func() error {
			if err := w.Run(gctx); err != nil {
				return fmt.Errorf("%s: %w", ws.names[i], err)
			}
			return nil
		})
	}
	g.Go(func() error {
		defer stop()
		var err error
		res, err = b.drive(gctx, db, ws, ph, profileDir)
		return err
	})
	if err := g.Wait(); err != nil {
		return res, err
	}
	return res, nil
}

// waitRelay waits for the relay process to exit: an exit before ctx ended fails the phase.
func (b *Turns) waitRelay(ctx context.Context, relay *exec.Cmd) error {
	err := relay.Wait()
	if ctx.Err() == nil {
		if err == nil {
			err = errors.New("exit status 0")
		}
		return fmt.Errorf("the relay exited before the phase ended (its log is above): %w", err)
	}
	// Wait reports a relay that exited 0 after SIGTERM as ctx's error.
	if err != nil && !errors.Is(err, context.Canceled) {
		b.cfg.Logger.Warn("the relay did not stop cleanly", "error", err)
	}
	return nil
}

// turnsWorkers are one phase's workers, each with its own pool, NATS connection and metrics.
type turnsWorkers struct {
	names   []string
	runners []TurnsWorker
	regs    []*prometheus.Registry
	pools   []*pgxpool.Pool
	conns   []*nats.Conn
}

// newWorkers builds ph.workers workers on db. close releases what it made, also after an error.
func (b *Turns) newWorkers(ctx context.Context, env *turnsEnv, db *turnsDB, ph turnsPhase) (*turnsWorkers, error) {
	ws := &turnsWorkers{}
	pcfg, err := env.poolConfig(db.url, turnsWorkerConns)
	if err != nil {
		return ws, err
	}
	for i := range ph.workers {
		name := fmt.Sprintf("bench-worker-%d", i+1)
		pool, err := pgxpool.NewWithConfig(ctx, pcfg.Copy())
		if err != nil {
			return ws, fmt.Errorf("connect %s to PostgreSQL: %w", name, err)
		}
		ws.pools = append(ws.pools, pool)
		var nc *nats.Conn
		if ph.source == TurnsSourceJetStream {
			if nc, err = env.natsCfg.Connect(nats.Name("baton-"+name), nats.MaxReconnects(-1)); err != nil {
				return ws, fmt.Errorf("connect %s: %w", name, err)
			}
			ws.conns = append(ws.conns, nc)
		}
		reg := prometheus.NewRegistry()
		w, err := b.cfg.NewWorker(TurnsWorkerSpec{
			Name:               name,
			Pool:               pool,
			NATS:               nc,
			SubjectPrefix:      db.prefix,
			Tools:              ph.kind == TurnsKindTools,
			Debounce:           config.DefaultWorkerDebounce,
			PollInterval:       config.DefaultWorkerPollInterval,
			MaxConcurrentTurns: config.DefaultWorkerMaxConcurrentTurns,
			Registerer:         reg,
			Logger:             b.cfg.Logger.With("worker", name),
		})
		if err != nil {
			return ws, fmt.Errorf("%s: %w", name, err)
		}
		ws.names = append(ws.names, name)
		ws.runners = append(ws.runners, w)
		ws.regs = append(ws.regs, reg)
	}
	return ws, nil
}

// close closes the workers' connections; call it after they stopped.
func (ws *turnsWorkers) close() {
	for _, nc := range ws.conns {
		nc.Close()
	}
	for _, p := range ws.pools {
		p.Close()
	}
}

// drive warms the phase up, then measures it.
func (b *Turns) drive(ctx context.Context, db *turnsDB, ws *turnsWorkers, ph turnsPhase, profileDir string) (turnsResult, error) {
	prod, err := producer.New(producer.Config{})
	if err != nil {
		return turnsResult{}, err
	}
	mark, err := b.warmUp(ctx, db, prod, ws)
	if err != nil {
		return turnsResult{}, fmt.Errorf("warm-up: %w", err)
	}
	if ph.kind == TurnsKindLatency {
		return b.measureLatency(ctx, db, prod, ph, mark)
	}
	return b.measureThroughput(ctx, db, prod, ws, ph, mark, profileDir)
}

// warmUp sends batches of turnsWarmupBatch messages until every worker has answered one (its
// pool is connected and its source delivers: for JetStream, the relay streams) or
// turnsWarmupLimit passed, and returns the highest outbox id it wrote: measured rows come after.
func (b *Turns) warmUp(ctx context.Context, db *turnsDB, prod *producer.Producer, ws *turnsWorkers) (int64, error) {
	deadline := time.Now().Add(turnsWarmupLimit)
	for batch := 0; ; batch++ {
		msgs := make([]producer.Message, turnsWarmupBatch)
		for i := range msgs {
			msgs[i] = producer.Message{ConversationID: turnsWarmupConvID(i), ID: fmt.Sprintf("w%d-%d", batch, i), Content: "hi"}
		}
		if err := turnsSendAll(ctx, db.pool, prod, msgs); err != nil {
			return 0, err
		}
		if err := turnsWaitSettled(ctx, db, 0, 10*time.Millisecond); err != nil {
			return 0, err
		}
		m, err := ws.metrics()
		if err != nil {
			return 0, err
		}
		idle := slices.Index(m.turns, 0)
		if idle < 0 {
			break
		}
		if time.Now().After(deadline) {
			b.cfg.Logger.Warn("a worker answered no turn during the warm-up; measuring anyway", "worker", ws.names[idle])
			break
		}
	}
	var mark int64
	if err := db.pool.QueryRow(ctx, `SELECT coalesce(max(id), 0) FROM agent_outbox`).Scan(&mark); err != nil {
		return 0, fmt.Errorf("last warm-up row: %w", err)
	}
	return mark, nil
}

// measureThroughput sends b.cfg.Turns messages, each to a conversation of its own, from
// turnsProducers producers as fast as they go, and measures from the first producer commit to
// the last reply commit.
func (b *Turns) measureThroughput(ctx context.Context, db *turnsDB, prod *producer.Producer, ws *turnsWorkers,
	ph turnsPhase, mark int64, profileDir string) (res turnsResult, err error) {
	msgs := make([]producer.Message, b.cfg.Turns)
	for i := range msgs {
		msgs[i] = producer.Message{ConversationID: turnsConvID(ph, i), ID: fmt.Sprintf("t%d", i), Content: "hi"}
	}
	before, err := ws.metrics()
	if err != nil {
		return res, err
	}
	stopProfile := func() error { return nil }
	if profileDir != "" {
		if stopProfile, err = turnsStartProfile(profileDir); err != nil {
			return res, err
		}
	}
	defer func() { err = errors.Join(err, stopProfile()) }()
	cpuBefore, err := turnsCPU()
	if err != nil {
		return res, err
	}
	if err := turnsSendAll(ctx, db.pool, prod, msgs); err != nil {
		return res, err
	}
	if err := turnsWaitSettled(ctx, db, mark, 100*time.Millisecond); err != nil {
		return res, err
	}
	cpuAfter, err := turnsCPU()
	if err != nil {
		return res, err
	}
	if err := stopProfile(); err != nil {
		return res, err
	}
	stopProfile = func() error { return nil }
	after, err := ws.metrics()
	if err != nil {
		return res, err
	}
	var first, last time.Time
	if err := db.pool.QueryRow(ctx, `
		SELECT count(*), count(*) FILTER (WHERE o.status = 'done'), count(*) FILTER (WHERE o.status = 'error'),
		       min(o.created_at), max(r.finished_at)
		FROM agent_outbox o LEFT JOIN agent_runs r ON r.run_id = o.run_id
		WHERE o.id > $1`, mark).Scan(&res.sent, &res.done, &res.failed, &first, &last); err != nil {
		return res, fmt.Errorf("read the phase's rows: %w", err)
	}
	res.seconds = last.Sub(first).Seconds()
	if res.seconds <= 0 {
		return res, fmt.Errorf("the last reply committed (%v) no later than the first message (%v)", last, first)
	}
	res.perSecond = float64(b.cfg.Turns) / res.seconds
	res.cpuCores = (cpuAfter - cpuBefore).Seconds() / res.seconds
	res.claimBatch = (after.claimSum - before.claimSum) / math.Max(after.claimN-before.claimN, 1)
	res.commitBatch = (after.commitSum - before.commitSum) / math.Max(after.commitN-before.commitN, 1)
	res.conflicts = after.conflicts - before.conflicts
	res.nacked = after.nacked - before.nacked
	return res, nil
}

// turnsProfileFile is the CPU profile's name in TurnsConfig.ProfileDir.
const turnsProfileFile = "worker.pprof"

// turnsCPU is the CPU time this process used so far, user and system.
func turnsCPU() (time.Duration, error) {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		return 0, fmt.Errorf("getrusage: %w", err)
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano()), nil
}

// turnsStartProfile starts a CPU profile of this process into dir/worker.pprof; stop ends it.
func turnsStartProfile(dir string) (stop func() error, err error) {
	if err := os.MkdirAll(dir, 0o750); err != nil {
		return nil, fmt.Errorf("profile dir: %w", err)
	}
	path := filepath.Join(dir, turnsProfileFile)
	f, err := os.Create(path) //nolint:gosec // G304: the file the user asked for
	if err != nil {
		return nil, fmt.Errorf("profile: %w", err)
	}
	if err := pprof.StartCPUProfile(f); err != nil {
		_ = f.Close()
		return nil, fmt.Errorf("profile: %w", err)
	}
	return func() error {
		pprof.StopCPUProfile()
		if err := f.Close(); err != nil {
			return fmt.Errorf("write %s: %w", path, err)
		}
		return nil
	}, nil
}

// turnsSent is a message the producer committed, and when its Send returned.
type turnsSent struct {
	outboxID int64
	at       time.Time
}

// measureLatency sends ph.rate messages per second for LatencyDuration, round robin over the
// phase's conversations, and measures each from its producer commit (Send returned) to its
// reply commit (the run's finished_at, stamped in the final transaction), the database's
// clock brought to this process's by turnsClockOffset.
func (b *Turns) measureLatency(ctx context.Context, db *turnsDB, prod *producer.Producer, ph turnsPhase, mark int64) (turnsResult, error) {
	res := turnsResult{conversations: b.conversations(ph)}
	var err error
	if res.clockOffset, err = turnsClockOffset(ctx, db.pool); err != nil {
		return res, err
	}
	n := max(1, int(float64(ph.rate)*b.cfg.LatencyDuration.Seconds()))
	sent := make([]turnsSent, n) // each index written by one sender
	jobs := make(chan int)
	g, gctx := errgroup.WithContext(ctx)
	g.Go(func() error {
		defer close(jobs)
		start := time.Now()
		timer := time.NewTimer(time.Hour)
		defer timer.Stop()
		for i := range n {
			due := start.Add(time.Duration(float64(i) / float64(ph.rate) * float64(time.Second)))
			if wait := time.Until(due); wait > 0 {
				timer.Reset(wait)
				select {
				case <-timer.C:
				case <-gctx.Done():
					return gctx.Err()
				}
			}
			select {
			case jobs <- i: // late when every sender is busy: the achieved rate shows it
			case <-gctx.Done():
				return gctx.Err()
			}
		}
		return nil
	})
	for range turnsProducers {
		g.Go(func() error {
			for i := range jobs {
				msg := producer.Message{ConversationID: turnsConvID(ph, i%res.conversations), ID: fmt.Sprintf("l%d", i), Content: "hi"}
				r, err := prod.Send(gctx, db.pool, msg)
				if err != nil {
					return fmt.Errorf("send %s: %w", msg.ID, err)
				}
				sent[i] = turnsSent{outboxID: r.OutboxID, at: time.Now()}
			}
			return nil
		})
	}
	if err := g.Wait(); err != nil {
		return res, err
	}
	if err := turnsWaitSettled(ctx, db, mark, 100*time.Millisecond); err != nil {
		return res, err
	}
	type row struct {
		status           string
		created, claimed time.Time
		finished         time.Time
		hasRun           bool
	}
	rows := map[int64]row{}
	q, err := db.pool.Query(ctx, `
		SELECT o.id, o.status, o.created_at, r.started_at, r.finished_at
		FROM agent_outbox o LEFT JOIN agent_runs r ON r.run_id = o.run_id
		WHERE o.id > $1`, mark)
	if err != nil {
		return res, fmt.Errorf("read the phase's rows: %w", err)
	}
	for q.Next() {
		var id int64
		var r row
		var claimed, finished *time.Time
		if err := q.Scan(&id, &r.status, &r.created, &claimed, &finished); err != nil {
			q.Close()
			return res, fmt.Errorf("read the phase's rows: %w", err)
		}
		if claimed != nil && finished != nil {
			r.claimed, r.finished, r.hasRun = *claimed, *finished, true
		}
		rows[id] = r
	}
	if err := q.Err(); err != nil {
		return res, fmt.Errorf("read the phase's rows: %w", err)
	}
	var lat, wait, turn []time.Duration
	first, last := sent[0].at, sent[0].at
	for _, s := range sent {
		first, last = turnsMinTime(first, s.at), turnsMaxTime(last, s.at)
		r := rows[s.outboxID]
		res.sent++
		switch r.status {
		case "done":
			res.done++
		case "error":
			res.failed++
		}
		if r.status != "done" || !r.hasRun {
			continue
		}
		lat = append(lat, max(r.finished.Add(-res.clockOffset).Sub(s.at), 0))
		wait = append(wait, r.claimed.Sub(r.created))
		turn = append(turn, r.finished.Sub(r.claimed))
	}
	if n > 1 && last.After(first) {
		res.achievedRate = float64(n-1) / last.Sub(first).Seconds()
	}
	for _, ds := range [][]time.Duration{lat, wait, turn} {
		slices.Sort(ds)
	}
	res.p50, res.p99 = percentile(lat, .5), percentile(lat, .99)
	res.waitP50, res.waitP99 = percentile(wait, .5), percentile(wait, .99)
	res.turnP50, res.turnP99 = percentile(turn, .5), percentile(turn, .99)
	return res, nil
}

func turnsMinTime(a, b time.Time) time.Time {
	if b.Before(a) {
		return b
	}
	return a
}

func turnsMaxTime(a, b time.Time) time.Time {
	if b.After(a) {
		return b
	}
	return a
}

// turnsClockOffset estimates the database's clock minus this process's: of five round trips,
// the shortest, taking the server's clock_timestamp() as read halfway. The error is at most
// half that round trip (well under a millisecond on one machine).
func turnsClockOffset(ctx context.Context, pool *pgxpool.Pool) (time.Duration, error) {
	best, offset := time.Duration(math.MaxInt64), time.Duration(0)
	for range 5 {
		var server time.Time
		t0 := time.Now()
		if err := pool.QueryRow(ctx, `SELECT clock_timestamp()`).Scan(&server); err != nil {
			return 0, fmt.Errorf("read the database's clock: %w", err)
		}
		rtt := time.Since(t0)
		if rtt < best {
			best, offset = rtt, server.Sub(t0.Add(rtt/2))
		}
	}
	return offset, nil
}

// turnsSendAll sends msgs from turnsProducers producers at once, as fast as they go.
func turnsSendAll(ctx context.Context, pool *pgxpool.Pool, prod *producer.Producer, msgs []producer.Message) error {
	g, gctx := errgroup.WithContext(ctx)
	for p := range turnsProducers {
		g.Go(func() error {
			for i := p; i < len(msgs); i += turnsProducers {
				if _, err := prod.Send(gctx, pool, msgs[i]); err != nil {
					return fmt.Errorf("send %s: %w", msgs[i].ID, err)
				}
			}
			return nil
		})
	}
	return g.Wait()
}

// turnsWaitSettled polls, every `every`, until no outbox row past after is pending or processing.
// It fails when their number stopped decreasing for turnsStallLimit.
func turnsWaitSettled(ctx context.Context, db *turnsDB, after int64, every time.Duration) error {
	tick := time.NewTicker(every)
	defer tick.Stop()
	last, changed := -1, time.Now()
	for {
		var left int
		// Counted through the partial indexes of pending and of processing rows, which hold
		// only what is left: a count of every row past after grew with the phase and took
		// Postgres CPU from what the bench measures (6 ms a count at 30,000 rows).
		if err := db.pool.QueryRow(ctx, `SELECT
			(SELECT count(*) FROM agent_outbox WHERE status = 'pending' AND id > $1) +
			(SELECT count(*) FROM agent_outbox WHERE status = 'processing' AND id > $1)`, after).Scan(&left); err != nil {
			return fmt.Errorf("count unfinished rows: %w", err)
		}
		switch {
		case left == 0:
			return nil
		case left != last:
			last, changed = left, time.Now()
		case time.Since(changed) > turnsStallLimit:
			return fmt.Errorf("%d rows still pending or processing, and none finished in %v", left, turnsStallLimit)
		}
		select {
		case <-tick.C:
		case <-ctx.Done():
			return ctx.Err()
		}
	}
}

// turnsMetrics is what the bench reads from the workers' registries.
type turnsMetrics struct {
	turns              []float64 // per worker: turns ended, any outcome
	claimSum, claimN   float64   // baton_worker_batch_size{statement="claim"}
	commitSum, commitN float64   // ... {statement="finish"}
	conflicts, nacked  float64
}

// metrics gathers the workers' registries.
func (ws *turnsWorkers) metrics() (turnsMetrics, error) {
	m := turnsMetrics{turns: make([]float64, len(ws.regs))}
	for i, reg := range ws.regs {
		mfs, err := reg.Gather()
		if err != nil {
			return m, fmt.Errorf("worker metrics: %w", err)
		}
		for _, mf := range mfs {
			for _, x := range mf.GetMetric() {
				label := ""
				if len(x.GetLabel()) > 0 {
					label = x.GetLabel()[0].GetValue()
				}
				switch mf.GetName() {
				case "baton_worker_turns_total":
					m.turns[i] += x.GetCounter().GetValue()
				case "baton_worker_batch_size":
					switch label {
					case "claim":
						m.claimSum += x.GetHistogram().GetSampleSum()
						m.claimN += float64(x.GetHistogram().GetSampleCount())
					case "finish":
						m.commitSum += x.GetHistogram().GetSampleSum()
						m.commitN += float64(x.GetHistogram().GetSampleCount())
					}
				case "baton_worker_claim_conflicts_total":
					m.conflicts += x.GetCounter().GetValue()
				case "baton_worker_events_total":
					if label == "nacked" {
						m.nacked += x.GetCounter().GetValue()
					}
				}
			}
		}
	}
	return m, nil
}
