package consumer

import (
	"context"
	"errors"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"
)

// Calls that arrive while every runner is busy go into one batch, each gets its own result,
// and a failed batch fails each of its calls.
func TestBatcherSharesBusyRunners(t *testing.T) {
	release := make(chan struct{})
	started := make(chan []int, 10)
	b := newBatcher(8, 0, time.Minute, prometheus.NewHistogram(prometheus.HistogramOpts{Name: "x"}), func(_ context.Context, reqs []int) ([]int, error) {
		started <- reqs
		<-release
		if reqs[0] < 0 {
			return nil, errors.New("batch failed")
		}
		out := make([]int, len(reqs))
		for i, r := range reqs {
			out[i] = r * 10
		}
		return out, nil
	})
	defer b.close()

	ctx := context.Background()
	var wg sync.WaitGroup
	results := make([]int, 5)
	wg.Go(func() { results[0], _ = b.do(ctx, 0) })
	require.Equal(t, []int{0}, <-started) // the runner is busy with the first call
	queued := make(chan struct{})
	for i := 1; i < 5; i++ {
		wg.Go(func() {
			queued <- struct{}{}
			results[i], _ = b.do(ctx, i)
		})
	}
	for range 4 {
		<-queued
	}
	// The four calls are waiting on the runner (or about to): let it finish and take them.
	release <- struct{}{}
	var batched []int
	for len(batched) < 4 {
		batch := <-started
		batched = append(batched, batch...)
		release <- struct{}{}
	}
	wg.Wait()
	require.ElementsMatch(t, []int{1, 2, 3, 4}, batched)
	require.Equal(t, []int{0, 10, 20, 30, 40}, results)

	go func() { <-started; release <- struct{}{} }()
	_, err := b.do(ctx, -1)
	require.EqualError(t, err, "batch failed")

	b.close()
	_, err = b.do(ctx, 1)
	require.ErrorIs(t, err, errBatcherStopped)
}
