// Package bench measures Baton's relay on this machine against baselines measured in the same
// run: what `baton bench relay` prints.
//
// # What runs
//
// Run creates a database of its own (baton_bench_<id>, migrated, 1,000 conversations
// c0000…c0999) on the given PostgreSQL server and streams of its own (BENCH_<id>_…) on the
// given NATS server, and removes both at the end. Baton's relay runs as a process of its own,
// the way users run it (Config.RelayCommand, `baton relay`), configured through BATON_*
// variables and measured from the outside: its log's "streaming" line, the stream's message
// count, the slot's confirmed_flush_lsn, and /proc for CPU time and peak RSS. Its contenders,
// each on the same backlog, one at a time:
//
//   - decode ceiling: a bare pgoutput client that parses every message and does nothing else,
//     in this process. The eager client reads messages as they come; the bulk-reading client
//     reads the socket in 1 MiB chunks and pauses (nanosleep: time.Sleep would take a
//     millisecond) after a read that brought less than 16 KiB, so that the walsender, which
//     sends each message on its own to a client that keeps up, sends in bulk; one client per
//     pause of 100, 200 and 400 µs, since the best pause depends on the walsender's pace (see
//     decode.go). The ceiling is the highest of them all.
//   - publish ceiling: bare JetStream async publishing (PublishMsgAsync, 4,096 in flight) of
//     as many turn-shaped events (same subjects, headers with Nats-Msg-Id, body size) into a
//     file stream, in this process.
//   - plain relay: the simplest correct pipelined relay (RunPlainRelay), run as a process of
//     its own (Config.PlainRelayCommand, `baton bench plain-relay`) so that its CPU time and
//     memory are measured exactly as the relay's are: CPU time of goroutines inside a process
//     that also hosts the NATS server cannot be told apart.
//
// Every reader's slot exists before its backlog is written (the relay's created by starting
// the relay once, so its first-start backfill is empty), so each reads the same WAL. Within
// a round the contenders run one after the other; round n starts with the n-th contender
// (rotation), so that a burst of other load does not always hit the same one. Each figure is
// the median over the rounds; ratios are taken within a round, then their median. Other
// people's load only slows a run down, and only same-run ratios over several rounds mean
// much on a shared machine.
//
// # Parts and figures
//
// Figures are keyed <section>.<contender>.<measure>. Sections:
//
//   - tx1_conv1000, tx100_conv1000 (part catchup): Config.Rows rows in 1-row and in 100-row
//     transactions over 1,000 conversations, already in the slot when the contender starts.
//   - tx1_conv10, tx1_conv1 (part hot): 1-row transactions, every row in 10 conversations, or
//     in one; the relay and the plain relay only.
//   - backfill (part backfill): the relay's first start (no slot yet) on the Config.Rows
//     pending rows of tx1_conv1000.
//   - latency_<rate> (part latency): `producers` (8) connections commit one message and its
//     outbox row per transaction through package producer at <rate> per second for the warm-up
//     (1 s, not counted) and Config.LatencyDuration, while the relay (or the plain relay) runs.
//
// Contenders: relay, plain, decode_eager, decode_bulk_<pause>us (100us, 200us, 400us),
// decode_ceiling (the highest decode_*), publish, relay_shards<N> (with Config.Shards: N
// `baton relay --shard K/N` processes at once on the backlog, each on a slot of its own, on
// the bench database's shard publications; the catch-up sections only), and ratio for the
// ratios. Measures:
//
//   - rows_per_s (relay, plain): rows ÷ (the "streaming" line → the stream holds every event);
//     for backfill, rows ÷ (process start → every event stored). decode_*: rows ÷
//     (START_REPLICATION's answer → the last insert parsed). publish msgs_per_s: events ÷
//     (first publish → last PubAck).
//   - start_to_stored_s: process start → the stream holds every event (includes connecting,
//     setup and, for backfill, the first-start backfill).
//   - confirm_s: the "streaming" line → the slot's confirmed_flush_lsn reaches the WAL insert
//     position read after the backlog was written (includes up to a 1 s status interval).
//   - cpu_us_per_row: the process's user+system CPU time (process start to every event stored)
//     ÷ rows, in µs. walsender_cpu_us_per_row: its walsender's, from "streaming" on (only when
//     PostgreSQL runs on this machine). nats_cpu_us_per_row: this process's over the same
//     span, which is the NATS server's when it runs in this process (Config.NATSInProcess; the
//     bench only polls the stream's count meanwhile). /proc counts in 10 ms ticks.
//   - peak_rss_mib: the process's VmHWM after catch-up, MiB.
//   - latency: p50_ms, p99_ms, max_ms of commit → stored: from the producer's Send returning
//     (its COMMIT done) to the JetStream timestamp of the event (the server's clock: only
//     meaningful when NATS runs on this machine; a sample can be slightly negative, when the
//     event is stored before the producer hears its COMMIT's answer); commits_per_s achieved; relay
//     self_share_le_1ms: the share of the relay's own baton_relay_commit_to_ack_seconds
//     observations (commit record timestamp → PubAck) at or below 1 ms over the measured span.
//   - relay_shards<N>: rows_per_s is rows ÷ (the first shard relay's "streaming" line → the
//     stream holds every event), their aggregate rate; confirm_s runs to every shard's slot
//     confirming the end; cpu_us_per_row is their CPU time together.
//   - ratio: relay_shards<N>_vs_relay (the shard relays' aggregate rows/s ÷ one relay's, same
//     round), relay_vs_plain, relay_vs_decode_ceiling, relay_vs_publish (rows/s ÷ rows/s),
//     relay_cpu_vs_plain_cpu (µs/row ÷ µs/row), relay_vs_tx1_conv1000 and
//     plain_vs_tx1_conv1000 (a hot backlog's rate ÷ the same contender's 1,000-conversation
//     rate in the same round), relay_p99_vs_plain_p99.
//
// With Config.ProfileDir, one more catch-up of tx1_conv1000 by the relay (not counted in the
// figures) runs with BATON_PPROF_ADDR set, and a CPU profile covering it is written to
// ProfileDir/relay-catchup.pprof (go tool pprof -top <file>).
//
// # JSON
//
// Report.WriteJSON writes one document; fields are only added, and Version (ReportVersion)
// changes if one is renamed or removed:
//
//	{
//	  "version": 1,
//	  "started_at": "2026-12-01T06:00:00Z",
//	  "wall_seconds": 231.4,
//	  "config": {"rows": 200000, "rounds": 1, "rates": [1000, 5000],
//	             "latency_duration_seconds": 5, "warmup_seconds": 1,
//	             "parts": ["catchup", "hot", "backfill", "latency"]},
//	  "environment": {"cpus": 2, "go_version": "go1.26.8", "postgres_version": "15.20",
//	                  "nats_version": "2.15.2", "nats_in_process": true, "walsender_measured": true},
//	  "figures": {
//	    "tx1_conv1000.relay.rows_per_s": {"label": "baton relay (process)", "unit": "rows/s",
//	                                      "median": 41000, "rounds": [41000]},
//	    ...
//	  },
//	  "profile": "prof/relay-catchup.pprof"
//	}
//
// A figure's unit is rows/s, msgs/s, commits/s, s, ms, us/row, MiB, x (a ratio) or share
// (0…1); median and rounds entries are null where nothing was measured.
package bench
