package consumer

import (
	"context"
	"errors"
	"fmt"

	"github.com/nats-io/nats.go"
)

// ErrNotReady wraps the reasons Ready gives.
var ErrNotReady = errors.New("worker not ready")

// Ready reports whether the worker can do its work now: Postgres answers a ping through its
// pool and, with the JetStream source, the NATS connection is connected. It is meant for a
// readiness probe (a load balancer or an orchestrator stops counting on a worker that is not
// ready); ctx bounds the ping. The error says which is unreachable, without connection
// secrets.
func (w *Worker) Ready(ctx context.Context) error {
	if err := w.cfg.Pool.Ping(ctx); err != nil {
		return fmt.Errorf("%w: postgres: %w", ErrNotReady, err)
	}
	if nc := w.cfg.NATS; nc != nil && nc.Status() != nats.CONNECTED {
		return fmt.Errorf("%w: nats: %s", ErrNotReady, nc.Status())
	}
	return nil
}
