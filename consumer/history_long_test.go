//go:build long

package consumer

import "testing"

// TestLongHistoryReadsItsMessages is TestHistoryReadsItsMessages with conversations of 200,000
// answered turns each: a history read still reads only the turns it returns.
func TestLongHistoryReadsItsMessages(t *testing.T) { requireHistoryNarrow(t, 200_000) }
