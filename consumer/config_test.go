package consumer

import (
	"context"
	"testing"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/batonhq/baton/internal/config"
	"github.com/batonhq/baton/wire"
)

// A zero Config takes exactly the exported defaults, which are Baton configuration's worker
// defaults: what a command configures and what the library does alone cannot drift apart.
func TestZeroConfigTakesTheDefaults(t *testing.T) {
	w, err := New(Config{Pool: new(pgxpool.Pool), Handler: func(context.Context, *Turn) (Reply, error) { return Reply{}, nil }})
	require.NoError(t, err)
	c := w.cfg
	require.Equal(t, wire.DefaultSubjectPrefix, c.SubjectPrefix)
	require.Equal(t, wire.StreamName(wire.DefaultSubjectPrefix, wire.KindTurns), c.Stream)
	for _, f := range []struct {
		name           string
		got, want, cfg any
	}{
		{"Durable", c.Durable, DefaultDurable, config.DefaultWorkerDurable},
		{"Debounce", c.Debounce, DefaultDebounce, config.DefaultWorkerDebounce},
		{"Lease", c.Lease, DefaultLease, config.DefaultWorkerLease},
		{"MaxAttempts", c.MaxAttempts, DefaultMaxAttempts, config.DefaultWorkerMaxAttempts},
		{"BackoffBase", c.BackoffBase, DefaultBackoffBase, config.DefaultWorkerBackoffBase},
		{"BackoffMax", c.BackoffMax, DefaultBackoffMax, config.DefaultWorkerBackoffMax},
		{"MaxConcurrentTurns", c.MaxConcurrentTurns, DefaultMaxConcurrentTurns, config.DefaultWorkerMaxConcurrentTurns},
		{"PollInterval", c.PollInterval, DefaultPollInterval, config.DefaultWorkerPollInterval},
		{"SweepInterval", c.SweepInterval, DefaultSweepInterval, config.DefaultWorkerSweepInterval},
		{"RecoveryInterval", c.RecoveryInterval, DefaultRecoveryInterval, config.DefaultWorkerRecoveryInterval},
		{"AckWait", c.AckWait, DefaultAckWait, config.DefaultWorkerAckWait},
		{"MaxAckPending", c.MaxAckPending, DefaultMaxAckPending, config.DefaultWorkerMaxAckPending},
		{"ShutdownGrace", c.ShutdownGrace, DefaultShutdownGrace, config.DefaultWorkerShutdownGrace},
		{"MaxTurnMessages", c.MaxTurnMessages, DefaultMaxTurnMessages, config.DefaultWorkerMaxTurnMessages},
		{"MaxTurnBytes", c.MaxTurnBytes, DefaultMaxTurnBytes, config.DefaultWorkerMaxTurnBytes},
	} {
		require.EqualValues(t, f.want, f.got, f.name)
		require.EqualValues(t, f.cfg, f.want, f.name)
	}
	require.Equal(t, DefaultFailureMessage(nil), c.FailureMessage(nil))
	require.NotEmpty(t, c.Name)
	require.NotNil(t, c.Logger)
}
