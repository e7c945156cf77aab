package consumer

import (
	"context"
	"errors"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
)

// batcher shares round trips between concurrent calls: one runner executes batches one at a
// time, and takes every call queued while the previous batch ran (up to max) into the next.
// At low load each batch is one call and nothing waits; under load, claims and final commits
// of many conversations share a statement, its executor start-up, its commit and its network
// round trip, which is most of what a turn costs Postgres (measured with pgbench on this
// schema: claim and finish of 8 turns in one statement each cost a third of 8 apart). One
// runner, not several: calls that would have found a second runner free join a batch instead,
// which under load is what saves the CPU (measured: 2 runners halved the batch size and cost
// 10-25% of the throughput).
type batcher[Req, Res any] struct {
	calls chan *batchCall[Req, Res]
	max   int
	// run executes one batch and returns one result per request, in order; an error fails
	// every call of the batch.
	run func(ctx context.Context, reqs []Req) ([]Res, error)
	// size observes each batch's size.
	size prometheus.Observer
	// linger is how long a runner waits for more calls when the last batch had several.
	linger time.Duration
	last   int // size of the last batch (the runner's)

	stop context.CancelFunc
	wg   sync.WaitGroup
	done <-chan struct{}
}

type batchCall[Req, Res any] struct {
	req  Req
	res  Res
	err  error
	done chan struct{}
}

// errBatcherStopped is returned by calls made after the batcher stopped.
var errBatcherStopped = errors.New("worker stopped")

// newBatcher starts the runner, which executes batches of at most maxCalls calls, each bounded by
// timeout, one at a time. It stops when close is called; a batch in flight completes first.
func newBatcher[Req, Res any](maxCalls int, linger, timeout time.Duration, size prometheus.Observer,
	run func(ctx context.Context, reqs []Req) ([]Res, error)) *batcher[Req, Res] {
	ctx, stop := context.WithCancel(context.Background()) //nolint:gosec // G118: stop is kept in the batcher and called by close
	b := &batcher[Req, Res]{calls: make(chan *batchCall[Req, Res]), max: maxCalls, linger: linger, run: run,
		size: size, stop: stop, done: ctx.Done()}
	b.wg.Go(func() {
		for {
			select {
			case <-ctx.Done():
				return
			case c := <-b.calls:
				b.execute(c, timeout)
			}
		}
	})
	return b
}

// execute runs first and every call queued behind it, up to max, as one batch.
func (b *batcher[Req, Res]) execute(first *batchCall[Req, Res], timeout time.Duration) {
	batch := []*batchCall[Req, Res]{first}
	for len(batch) < b.max {
		select {
		case c := <-b.calls:
			batch = append(batch, c)
			continue
		default:
		}
		break
	}
	// Under load (the last batch was shared), linger a moment for more, as Postgres's
	// commit_delay does for commits when other transactions are active; at low load a call
	// never waits.
	if b.linger > 0 && b.last > 1 && len(batch) < b.max {
		t := time.NewTimer(b.linger)
	collect:
		for len(batch) < b.max {
			select {
			case c := <-b.calls:
				batch = append(batch, c)
			case <-t.C:
				break collect
			}
		}
		t.Stop()
	}
	b.last = len(batch)
	b.size.Observe(float64(len(batch)))
	reqs := make([]Req, len(batch))
	for i, c := range batch {
		reqs[i] = c.req
	}
	// A batch runs to completion even while the worker stops: it holds other turns' commits.
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	res, err := b.run(ctx, reqs)
	cancel()
	for i, c := range batch {
		if err != nil {
			c.err = err
		} else {
			c.res = res[i]
		}
		close(c.done)
	}
}

// do queues req for the next batch and returns its result. ctx bounds only the wait for a
// runner: once taken, a call completes.
func (b *batcher[Req, Res]) do(ctx context.Context, req Req) (Res, error) {
	c := &batchCall[Req, Res]{req: req, done: make(chan struct{})}
	select {
	case b.calls <- c:
	case <-ctx.Done():
		var zero Res
		return zero, ctx.Err()
	case <-b.done:
		var zero Res
		return zero, errBatcherStopped
	}
	<-c.done
	return c.res, c.err
}

// close stops the runner once its batch in flight completes.
func (b *batcher[Req, Res]) close() {
	b.stop()
	b.wg.Wait()
}
