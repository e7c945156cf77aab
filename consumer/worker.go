package consumer

import (
	"context"
	"crypto/rand"
	"errors"
	"fmt"
	"sync"
	"time"

	"go.opentelemetry.io/otel/trace"
	"golang.org/x/sync/errgroup"
)

// maxBatch is how many conversations one claim or final-commit statement takes at most, and
// batchLinger how long a statement waits for more when the one before it was shared.
const (
	maxBatch    = 32
	batchLinger = 500 * time.Microsecond
)

// Worker runs turns. Create it with New and call Run.
type Worker struct {
	cfg   Config
	store *store
	m     *metrics
	src   source
	clock clock
	// tracer makes the turns' spans (see TracerName).
	tracer trace.Tracer

	// claims, finishes, records (of tool calls) and history reads share round trips between
	// conversations (see batcher); they run while Run does.
	claims    *batcher[claimReq, claim]
	finishes  *batcher[finishReq, error]
	records   *batcher[recordReq, recorded]
	histories *batcher[historyReq, histories]

	// sem bounds the turns running at once (Config.MaxConcurrentTurns).
	sem chan struct{}
	// mu guards convs, the state of every conversation this worker holds events of or runs a
	// loop for (see schedule).
	mu    sync.Mutex
	convs map[string]*convState
	loops sync.WaitGroup
}

// New validates cfg, fills its defaults and returns a Worker.
func New(cfg Config) (*Worker, error) {
	if err := cfg.fill(); err != nil {
		return nil, err
	}
	w := &Worker{
		cfg:    cfg,
		m:      newMetrics(cfg.Registerer),
		clock:  realClock{},
		sem:    make(chan struct{}, cfg.MaxConcurrentTurns),
		convs:  map[string]*convState{},
		tracer: newTracer(cfg.TracerProvider),
	}
	w.store = &store{pool: cfg.Pool, lease: cfg.Lease, maxAttempts: cfg.MaxAttempts, backoff: cfg.backoff, worker: cfg.Name,
		maxRows: cfg.MaxTurnMessages, maxBytes: cfg.MaxTurnBytes, failureMessage: cfg.FailureMessage,
		log: cfg.Logger, lostClaims: w.m.lostClaims}
	w.src = newSource(w)
	return w, nil
}

// Run consumes turns until ctx ends. It recovers expired leases at start and every
// RecoveryInterval. When ctx ends it stops taking work, gives running turns ShutdownGrace to
// finish (then cancels them and releases their rows), and returns nil.
func (w *Worker) Run(ctx context.Context) error {
	if err := w.checkSchema(ctx); err != nil {
		if ctx.Err() != nil && errors.Is(err, ctx.Err()) {
			return nil // stopped while starting: nothing ran, nothing to drain
		}
		return err
	}
	w.claims = newBatcher(maxBatch, batchLinger, 30*time.Second, w.m.batchSize.WithLabelValues("claim"), w.store.claimMany)
	defer w.claims.close()
	w.finishes = newBatcher(maxBatch, batchLinger, 30*time.Second, w.m.batchSize.WithLabelValues("finish"), w.store.finishMany)
	defer w.finishes.close()
	w.records = newBatcher(maxBatch, batchLinger, 30*time.Second, w.m.batchSize.WithLabelValues("tool"), w.store.recordMany)
	defer w.records.close()
	w.histories = newBatcher(maxBatch, batchLinger, 30*time.Second, w.m.batchSize.WithLabelValues("history"), w.store.historyMany)
	defer w.histories.close()
	w.recoverOnce(ctx)
	g, gctx := errgroup.WithContext(ctx)
	g.Go(func() error { return w.every(gctx, w.cfg.RecoveryInterval, w.recoverOnce) })
	g.Go(func() error { return w.src.run(gctx) })
	err := g.Wait()
	w.loops.Wait()
	if ctx.Err() != nil {
		return nil
	}
	return err
}

// checkSchema checks that the pool's search_path finds Baton's tables in Config.Schema: its
// statements name them without a schema.
func (w *Worker) checkSchema(ctx context.Context) error {
	var found string
	if err := w.cfg.Pool.QueryRow(ctx, tablesSchemaSQL).Scan(&found); err != nil {
		return fmt.Errorf("find Baton's tables: %w", err)
	}
	if found != w.cfg.Schema {
		where := "finds no agent_outbox"
		if found != "" {
			where = fmt.Sprintf("finds agent_outbox in schema %q", found)
		}
		return fmt.Errorf("%w: the pool's search_path %s, want schema %q (Config.Schema): set search_path in the pool config's ConnConfig.RuntimeParams, and run baton migrate with BATON_SCHEMA=%s",
			ErrConfig, where, w.cfg.Schema, w.cfg.Schema)
	}
	return nil
}

// recoverOnce recovers every run whose lease expired.
func (w *Worker) recoverOnce(ctx context.Context) {
	runs, err := w.store.expiredRuns(ctx, 1000)
	if err != nil {
		if ctx.Err() == nil {
			w.cfg.Logger.Error("recovery", "error", err)
		}
		return
	}
	for _, run := range runs {
		r, err := w.store.recoverRun(ctx, run)
		if err != nil {
			w.cfg.Logger.Error("recovery", "run_id", run.runID, "conversation_id", run.conversationID, "error", err)
			continue
		}
		if len(r.ids) == 0 {
			continue
		}
		if len(r.failed) > 0 {
			w.m.recoveries.WithLabelValues("failed").Inc()
		}
		if len(r.retried) > 0 {
			w.m.recoveries.WithLabelValues("pending").Inc()
		}
		w.cfg.Logger.Warn("recovered an expired run", "run_id", run.runID, "conversation_id", r.conversationID,
			"failed", r.failed, "pending", r.retried, "reason", r.reason)
		if len(r.retried) > 0 {
			w.schedule(ctx, r.conversationID, nil, time.Time{})
		}
	}
}

// newRunID returns a random (version 4) UUID.
func newRunID() string {
	var b [16]byte
	_, _ = rand.Read(b[:])
	b[6] = b[6]&0x0f | 0x40
	b[8] = b[8]&0x3f | 0x80
	return fmt.Sprintf("%x-%x-%x-%x-%x", b[0:4], b[4:6], b[6:8], b[8:10], b[10:16])
}
