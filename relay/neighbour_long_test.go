//go:build long

package relay_test

import "testing"

// The long tier (make test-long): a neighbour's 10-million-row transaction beside a relay at
// its default bound (10s), as reviewers reproduced the defect.
func TestLongNeighboursTenMillionRowTransactionDoesNotStopTheRelay(t *testing.T) {
	t.Parallel()
	bulkBesideTheRelay(t, 10_000_000)
}
