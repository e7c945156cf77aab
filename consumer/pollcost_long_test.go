//go:build long

package consumer

import "testing"

// TestLongPollCost is TestPollCostDoesNotGrowWithTheBacklog at the size issue 28 names: at
// 10,000 conversations, a polling pass over 1,000,000 pending rows touches at most twice the
// buffers of a pass over 1,000. Also at that size: a busy backlog (10 conversations, each held
// by a run), and rows laid out conversation after conversation, where the window of oldest rows
// cannot fill the page and every conversation is visited: that pass costs the conversations, so
// 1,000,000 rows cost at most twice what 100,000 do over the same 10,000 conversations.
func TestLongPollCost(t *testing.T) {
	t.Run("interleaved", func(t *testing.T) {
		requirePollCostFlat(t, 10_000, 1_000, 1_000_000, 0, interleaved)
	})
	t.Run("busy", func(t *testing.T) {
		requirePollCostFlat(t, 10, 10_000, 1_000_000, 10, interleaved)
	})
	t.Run("contiguous", func(t *testing.T) {
		requirePollCostFlat(t, 10_000, 100_000, 1_000_000, 0, contiguous)
	})
}
