package main

import (
	"bytes"
	"context"
	"encoding/json"
	"math"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/batonhq/baton/internal/bench"
	"github.com/batonhq/baton/internal/testsvc"
)

// `baton bench relay --shards 2` at a tiny size: two shard relay processes at once on each
// 1,000-conversation backlog, their aggregate rate next to one relay's and the ratio, in the
// same run. (The bench fails when the stream does not end with exactly every event, or a
// shard's slot never confirms the end.) Not parallel: see TestBenchRelayEndToEnd.
func TestBenchRelayShards(t *testing.T) {
	db := testsvc.NewDatabase(t)
	ns := testsvc.StartNATS(t)
	bin := testsvc.Binary(t, "github.com/batonhq/baton/cmd/baton")
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	var stdout, stderr bytes.Buffer
	code := run(ctx, []string{"bench", "relay", "--database-url", db.URL, "--nats-url", ns.URL(), "--baton-binary", bin,
		"--rows", "400", "--only", "catchup", "--shards", "2", "--json"}, &stdout, &stderr)
	require.Equal(t, 0, code, "stderr: %s", stderr.String())
	var rep bench.Report
	require.NoError(t, json.Unmarshal(stdout.Bytes(), &rep), stdout.String())
	require.Equal(t, 2, rep.Config.Shards)
	for _, b := range []string{"tx1_conv1000", "tx100_conv1000"} {
		for _, key := range []string{".relay.rows_per_s", ".relay_shards2.rows_per_s", ".relay_shards2.confirm_s",
			".ratio.relay_shards2_vs_relay"} {
			f, ok := rep.Figures[b+key]
			require.True(t, ok, "figure %s missing", b+key)
			require.False(t, math.IsNaN(float64(f.Median)), "%s not measured", b+key)
			require.Positive(t, float64(f.Median), b+key)
		}
	}
	require.Contains(t, stderr.String(), "2 shard relays at once", "progress names the shard contender")

	var slots int
	require.NoError(t, db.Pool.QueryRow(ctx, `SELECT count(*) FROM pg_replication_slots WHERE slot_name LIKE 'baton_bench_%'`).Scan(&slots))
	require.Zero(t, slots, "bench slots left")

}
