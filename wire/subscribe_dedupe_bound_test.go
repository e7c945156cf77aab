package wire_test

import (
	"math"
	"strconv"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/batonhq/baton/wire"
)

// DedupeWindow is bounded by MaxSubscriberDedupeWindow: Run allocates the whole window when it
// starts, so a larger one would cost gigabytes there (or panic, for math.MaxInt) instead of
// failing where the configuration is checked.
func TestOutcomeSubscriberDedupeWindowIsBounded(t *testing.T) {
	t.Parallel()
	b := setupSub(t, false)
	cfg := b.config("bounded", newRecorder(nil))
	for _, n := range []int{wire.MaxSubscriberDedupeWindow + 1, math.MaxInt} {
		cfg.DedupeWindow = n
		_, err := wire.NewOutcomeSubscriber(cfg)
		require.ErrorContains(t, err, "DedupeWindow "+strconv.Itoa(n)+" is above the maximum 1000000", "DedupeWindow %d", n)
	}
	cfg.DedupeWindow = wire.MaxSubscriberDedupeWindow
	_, err := wire.NewOutcomeSubscriber(cfg)
	require.NoError(t, err)
}
