package relay_test

import (
	"math"
	"strings"
	"testing"

	"github.com/batonhq/baton/internal/bench"
	"github.com/batonhq/baton/internal/testsvc"
	"github.com/batonhq/baton/natsconn"
)

// BenchmarkRelay runs `baton bench relay` with its defaults (package internal/bench says what
// it measures): `baton relay` as a process of its own against baselines measured in the same
// run, on a database and streams of its own on the test servers.
//
//	go test -run '^$' -bench Relay -benchtime=1x -timeout 20m ./relay/
//
// One iteration is the whole run (about 4 minutes on 2 cores), whatever b.N is. The figures
// that matter are reported with b.ReportMetric, and the table is logged; `go run ./cmd/baton
// bench relay` gives the same without the test harness, with --rounds, --json and --plot.
func BenchmarkRelay(b *testing.B) {
	db := testsvc.NewDatabase(b)
	ns := testsvc.StartNATS(b)
	bin := batonBinary(b)
	rep, err := bench.Run(b.Context(), bench.Config{
		DatabaseURL:       db.RoleURL(testsvc.RoleRelay),
		NATS:              natsconn.Settings{URL: ns.URL()},
		NATSInProcess:     !ns.External(),
		RelayCommand:      []string{bin, "relay"},
		PlainRelayCommand: []string{bin, "bench", "plain-relay"},
	})
	if err != nil {
		b.Fatal(err)
	}
	var table strings.Builder
	if err := rep.WriteTable(&table); err != nil {
		b.Fatal(err)
	}
	b.Log("\n" + table.String())
	for key, unit := range map[string]string{
		"tx1_conv1000.relay.rows_per_s":              "rows/s",
		"tx1_conv1000.ratio.relay_vs_plain":          "x-plain-relay",
		"tx1_conv1000.ratio.relay_vs_decode_ceiling": "x-decode-ceiling",
		"tx1_conv1000.relay.cpu_us_per_row":          "relay-cpu-us/row",
		"tx1_conv1000.relay.peak_rss_mib":            "peak-RSS-MiB",
		"tx1_conv1.ratio.relay_vs_tx1_conv1000":      "x-hot-1conv",
		"latency_1000.relay.p99_ms":                  "p99-ms-1000/s",
		"latency_1000.ratio.relay_p99_vs_plain_p99":  "x-plain-p99-1000/s",
	} {
		if f, ok := rep.Figures[key]; ok && !math.IsNaN(float64(f.Median)) {
			b.ReportMetric(float64(f.Median), unit)
		}
	}
}
