package main

import (
	"context"
	"fmt"
	"log/slog"
	"strconv"
	"sync"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go"
	"github.com/prometheus/client_golang/prometheus"
	"golang.org/x/sync/errgroup"

	"github.com/batonhq/baton/consumer"
	"github.com/batonhq/baton/internal/config"
)

// Demo workers: a short retry path, so --fail-every ends in visible failures within the demo.
const (
	// demoWorkerCount is how many workers the demo runs, each as a process would: a pool and a
	// NATS connection of its own.
	demoWorkerCount = 2
	// demoMaxAttempts caps claims of a request before it fails visibly.
	demoMaxAttempts = 2
	// demoBackoff is the wait before a failed request is claimable again.
	demoBackoff = 50 * time.Millisecond
	// demoShutdownGrace is how long running turns may finish once the workers are told to stop;
	// then their rows are released.
	demoShutdownGrace = 2 * time.Second
	// demoWorkerConns and demoWorkerTurns size each worker.
	demoWorkerConns = 10
	demoWorkerTurns = 16
)

// demoWorkerNames names the demo's workers, in order.
func demoWorkerNames() []string {
	names := make([]string, demoWorkerCount)
	for i := range names {
		names[i] = "demo-worker-" + strconv.Itoa(i+1)
	}
	return names
}

// demoWorkers are the demo's in-process workers.
type demoWorkers struct {
	names   []string
	workers []*consumer.Worker
	pools   []*pgxpool.Pool
	conns   []*nats.Conn

	cancel context.CancelFunc
	wg     sync.WaitGroup
}

// newDemoWorkers connects the demo's workers (demoWorkerNames) running handler, each with a pool and a
// NATS connection of its own. close releases what it made, also after an error.
func newDemoWorkers(ctx context.Context, cfg *config.Config, pcfg *pgxpool.Config, handler consumer.Handler,
	log *slog.Logger, reg prometheus.Registerer) (*demoWorkers, error) {
	ws := &demoWorkers{}
	for _, name := range demoWorkerNames() {
		wpcfg := pcfg.Copy()
		wpcfg.MaxConns = demoWorkerConns
		pool, err := pgxpool.NewWithConfig(ctx, wpcfg)
		if err != nil {
			return ws, fmt.Errorf("connect %s to PostgreSQL: %w", name, err)
		}
		ws.pools = append(ws.pools, pool)
		nc, err := connectNATS(cfg, "baton-"+name)
		if err != nil {
			return ws, err
		}
		ws.conns = append(ws.conns, nc)
		w, err := consumer.New(consumer.Config{
			Schema:             cfg.Schema,
			Pool:               pool,
			NATS:               nc,
			Handler:            handler,
			Name:               name,
			SubjectPrefix:      cfg.SubjectPrefix,
			MaxAttempts:        demoMaxAttempts,
			BackoffBase:        demoBackoff,
			BackoffMax:         demoBackoff,
			MaxConcurrentTurns: demoWorkerTurns,
			ShutdownGrace:      demoShutdownGrace,
			Logger:             log.With("worker", name),
			Registerer:         prometheus.WrapRegistererWith(prometheus.Labels{"worker": name}, reg),
		})
		if err != nil {
			return ws, err
		}
		ws.names = append(ws.names, name)
		ws.workers = append(ws.workers, w)
	}
	return ws, nil
}

// start runs the workers in g until stop is called or gctx ends.
func (ws *demoWorkers) start(gctx context.Context, g *errgroup.Group) {
	wctx, cancel := context.WithCancel(gctx)
	ws.cancel = cancel
	for i, w := range ws.workers {
		ws.wg.Add(1)
		g.Go(func() error {
			defer ws.wg.Done()
			if err := w.Run(wctx); err != nil {
				return fmt.Errorf("%s: %w", ws.names[i], err)
			}
			return nil
		})
	}
}

// stop tells the workers to stop and waits until they did: running turns get
// demoShutdownGrace to finish, then their rows are released. It is the run's
// demo.Services.StopWorkers.
func (ws *demoWorkers) stop() {
	if ws.cancel != nil {
		ws.cancel()
	}
	ws.wg.Wait()
}

// close closes the workers' connections; call it after stop.
func (ws *demoWorkers) close() {
	for _, nc := range ws.conns {
		nc.Close()
	}
	for _, p := range ws.pools {
		p.Close()
	}
}
