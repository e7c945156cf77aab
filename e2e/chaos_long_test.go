//go:build long

package e2e

import (
	"flag"
	"testing"
	"time"
)

var chaosLongDuration = flag.Duration("chaos.long", 5*time.Minute,
	"how long TestLongChaos sends and injects faults (make test-long)")

// TestLongChaos is the chaos run of make test-long: longer than CI's, and with the neighbour's
// bulk transactions at 10 million rows (the size reviewers reproduced the walsender's long
// silences with), where the relays' --min-silence and their patience with a walsender busy
// decoding are tested for real.
func TestLongChaos(t *testing.T) {
	neighbourBulkRows = 10_000_000
	t.Cleanup(func() { neighbourBulkRows = 1_000_000 })
	runChaos(t, *chaosLongDuration, false)
}

// TestLongChaosCluster is the cluster chaos run of make test-long, as long as TestLongChaos.
func TestLongChaosCluster(t *testing.T) {
	runChaos(t, *chaosLongDuration, true)
}
