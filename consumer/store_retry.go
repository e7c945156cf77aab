package consumer

import (
	"context"
	"errors"
	"io"
	"net"
	"strings"
	"time"

	"github.com/jackc/pgx/v5/pgconn"
)

// failure, a deadlock, a shutdown or too many connections. Context errors are not transient:
// the caller gave up.
func transient(err error) bool {
	if err == nil || errors.Is(err, context.Canceled) || errors.Is(err, context.DeadlineExceeded) {
		return false
	}
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) {
		switch pgErr.Code {
		case "40001", "40P01", // serialization_failure, deadlock_detected
			"57P01", "57P02", "57P03", // admin_shutdown, crash_shutdown, cannot_connect_now
			"53300": // too_many_connections
			return true
		}
		return strings.HasPrefix(pgErr.Code, "08") // connection_exception
	}
	var connectErr *pgconn.ConnectError
	var netErr net.Error
	return pgconn.SafeToRetry(err) || errors.As(err, &connectErr) || errors.As(err, &netErr) ||
		errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF) ||
		errors.Is(err, pgconn.ErrConnClosed) || errors.Is(err, net.ErrClosed)
}

// retryUncertain runs do until it succeeds, fails for good, or ctx ends, backing off between
// tries. After a transient failure the outcome of do is unknown (a connection lost at COMMIT
// may have lost only the answer), so before trying again it asks done whether the effect is
// already there; done's own transient failures are retried the same way.
func retryUncertain(ctx context.Context, do func() error, done func() (bool, error)) error {
	wait := 20 * time.Millisecond
	var err error
	uncertain := false
	for {
		if uncertain {
			ok, cerr := done()
			switch {
			case cerr == nil && ok:
				return nil
			case cerr == nil:
				uncertain = false
			case !transient(cerr):
				return cerr
			}
		}
		if !uncertain {
			if err = do(); !transient(err) {
				return err
			}
			uncertain = true
		}
		if !sleep(ctx, realClock{}, wait) {
			return err
		}
		wait = min(2*wait, time.Second)
	}
}
