package consumer

import (
	"context"
	"errors"
	"sync"
	"time"
)

// batcher shares round trips between concurrent calls without delaying any of them: a call
// waits only for a free runner, and a runner takes every call queued at that moment (up to
// max) into one statement. At low load each batch is one call; under load, claims and final
// commits of many conversations share a statement, its executor start-up, its commit and its
// network round trip, which is most of what a turn costs Postgres (measured with pgbench on
// this schema: claim and finish of 8 turns in one statement each cost a third of 8 apart).
type batcher[Req, Res any] struct {
	calls chan *batchCall[Req, Res]
	max   int
	// run executes one batch and returns one result per request, in order; an error fails
	// every call of the batch.
	run func(ctx context.Context, reqs []Req) ([]Res, error)

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

// newBatcher starts runners goroutines that execute batches of at most max calls, each batch
// bounded by timeout. They stop when close is called; calls in flight complete first.
func newBatcher[Req, Res any](runners, max int, timeout time.Duration,
	run func(ctx context.Context, reqs []Req) ([]Res, error)) *batcher[Req, Res] {
	ctx, stop := context.WithCancel(context.Background())
	b := &batcher[Req, Res]{calls: make(chan *batchCall[Req, Res]), max: max, run: run, stop: stop, done: ctx.Done()}
	for range runners {
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
	}
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

// close stops the runners once their batches complete.
func (b *batcher[Req, Res]) close() {
	b.stop()
	b.wg.Wait()
}
