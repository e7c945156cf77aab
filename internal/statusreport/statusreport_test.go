package statusreport

import (
	"bytes"
	"encoding/json"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

func ptr[T any](v T) *T { return &v }

// healthy is a report of a system where nothing needs attention.
func healthy() *Report {
	return &Report{
		GeneratedAt:       time.Date(2026, 11, 30, 3, 0, 0, 0, time.UTC),
		Database:          "baton",
		StaleAfterSeconds: 300,
		Slot: Slot{Name: "baton", Exists: true, Database: "baton", Plugin: "pgoutput", Active: true,
			ActivePID: ptr(4242), WALStatus: "reserved", RestartLSN: "0/10", ConfirmedLSN: "0/20",
			CurrentLSN: "0/30", RetainedWALBytes: ptr(int64(32)), LagBytes: ptr(int64(16))},
		Outbox: Outbox{ByStatus: StatusCounts{Pending: 2, Done: 10, Error: 1},
			OldestPendingAgeSeconds: ptr(12.0)},
		Streams: Streams{Checked: true, URL: "nats://localhost:4222",
			Turns:    &Stream{Name: "AGENT_TURNS", Exists: true, Messages: 13, LastSeq: 13},
			Outcomes: &Stream{Name: "AGENT_OUTCOMES", Exists: true, Messages: 11, LastSeq: 11},
			Consumer: &Consumer{Name: "baton-workers", Stream: "AGENT_TURNS", Exists: true}},
		Schema: Schema{Version: 3, BinaryVersion: 3},
	}
}

func TestStatusEvaluate(t *testing.T) {
	for _, tt := range []struct {
		name      string
		change    func(r *Report)
		attention []string // substrings, one per expected entry
		warnings  []string
	}{
		{name: "healthy", change: func(*Report) {}},
		{name: "slot missing", change: func(r *Report) { r.Slot = Slot{Name: "baton"} },
			attention: []string{`replication slot "baton" does not exist`}},
		{name: "slot lost", change: func(r *Report) { r.Slot.WALStatus, r.Slot.Active = "lost", false },
			attention: []string{"pg_drop_replication_slot('baton')"}},
		{name: "slot unreserved", change: func(r *Report) { r.Slot.WALStatus = "unreserved" },
			attention: []string{"about to be lost"}},
		{name: "slot extended", change: func(r *Report) { r.Slot.WALStatus = "extended" },
			warnings: []string{"more WAL than max_wal_size"}},
		{name: "slot inactive is a warning", change: func(r *Report) { r.Slot.Active, r.Slot.ActivePID = false, nil },
			warnings: []string{`no relay is streaming: slot "baton" is inactive and retains 32 B`}},
		{name: "slot of another database", change: func(r *Report) { r.Slot.Database = "other" },
			attention: []string{`belongs to database "other"`}},
		{name: "slot of another plugin", change: func(r *Report) { r.Slot.Plugin = "wal2json" },
			attention: []string{`plugin "wal2json"`}},
		{name: "slot unreadable", change: func(r *Report) { r.Slot.Error = "read slot baton: boom" },
			attention: []string{"slot: read slot baton: boom"}},
		{name: "pending stale", change: func(r *Report) { r.Outbox.OldestPendingAgeSeconds = ptr(301.0) },
			attention: []string{"the oldest pending request is 5m1s old (over --stale-after 5m0s): 2 pending"}},
		{name: "pending just fresh", change: func(r *Report) { r.Outbox.OldestPendingAgeSeconds = ptr(299.9) }},
		{name: "expired lease recovered soon", change: func(r *Report) {
			r.Outbox.ExpiredLeases, r.Outbox.ExpiredLeaseAgeSeconds = 1, ptr(3.0)
		}},
		{name: "expired lease nobody recovers", change: func(r *Report) {
			r.Outbox.ExpiredLeases, r.Outbox.ExpiredLeaseAgeSeconds = 2, ptr(600.0)
		}, attention: []string{"2 processing rows hold leases that expired up to 10m0s ago"}},
		{name: "outbox unreadable", change: func(r *Report) { r.Outbox.Error = "read agent_outbox: boom" },
			attention: []string{"outbox: read agent_outbox: boom"}},
		{name: "streams not checked", change: func(r *Report) { r.Streams = StreamsSkipped("BATON_NATS_URL is not set") }},
		{name: "NATS unreachable", change: func(r *Report) { r.Streams = StreamsUnreachable("nats://x", errors.New("no servers")) },
			attention: []string{"NATS: no servers"}},
		{name: "stream missing", change: func(r *Report) {
			r.Streams.Outcomes.Exists = false
		}, attention: []string{"stream AGENT_OUTCOMES does not exist"}},
		{name: "consumer missing", change: func(r *Report) { r.Streams.Consumer.Exists = false },
			warnings: []string{"consumer baton-workers does not exist on stream AGENT_TURNS"}},
		{name: "turns stream missing hides the consumer", change: func(r *Report) {
			r.Streams.Turns.Exists, r.Streams.Consumer.Exists = false, false
		}, attention: []string{"stream AGENT_TURNS does not exist"}},
		{name: "no schema", change: func(r *Report) { r.Schema.Version = 0 },
			attention: []string{"no Baton schema in database \"baton\": run `baton migrate`"}},
		{name: "schema behind", change: func(r *Report) { r.Schema.Version = 2 },
			warnings: []string{"schema at version 2, this binary expects 3"}},
		{name: "schema ahead", change: func(r *Report) { r.Schema.Version = 4 },
			warnings: []string{"newer than this binary"}},
	} {
		t.Run(tt.name, func(t *testing.T) {
			r := healthy()
			tt.change(r)
			r.Evaluate()
			requireEach(t, "attention", r.Attention, tt.attention)
			requireEach(t, "warnings", r.Warnings, tt.warnings)
			require.Equal(t, len(tt.attention) == 0, r.OK)

			var text bytes.Buffer
			require.NoError(t, WriteText(&text, r))
			if r.OK {
				require.Contains(t, text.String(), "\nok: nothing needs attention\n")
				require.NotContains(t, text.String(), "attention:")
			} else {
				require.Contains(t, text.String(), "\nattention:\n  - "+r.Attention[0]+"\n")
			}
		})
	}
}

func TestStatusWriteText(t *testing.T) {
	r := healthy()
	r.Outbox.ByStatus.Processing = 1
	r.Outbox.OldestProcessingAgeSeconds = ptr(4.2)
	r.Streams.Turns.LastTime = ptr(r.GeneratedAt.Add(-1500 * time.Millisecond))
	r.Streams.Consumer.NumPending, r.Streams.Consumer.NumAckPending = 3, 1
	r.Evaluate()
	var b bytes.Buffer
	require.NoError(t, WriteText(&b, r))
	require.Equal(t, `Baton status of database baton at 2026-11-30T03:00:00Z

Replication slot
  slot           baton
  active         yes (pid 4242)
  wal_status     reserved
  retained WAL   32 B (restart_lsn 0/10)
  confirmed LSN  0/20
  lag            16 B (current 0/30)

Outbox
  pending     2 (oldest 12s)
  processing  1 (oldest claim 4s)
  done        10
  error       1

JetStream         nats://localhost:4222
  STREAM          MESSAGES  BYTES  FIRST SEQ  LAST SEQ  LAST MESSAGE
  AGENT_TURNS     13        0 B    0          13        2s ago
  AGENT_OUTCOMES  11        0 B    0          11        -

  CONSUMER       STREAM       PENDING  ACK PENDING  REDELIVERED  WAITING
  baton-workers  AGENT_TURNS  3        1            0            0

Schema
  version  3 (this binary: 3)

ok: nothing needs attention
`, b.String())

	r.Streams = StreamsSkipped("BATON_NATS_URL is not set")
	r.Slot.Active, r.Slot.ActivePID = false, nil
	r.Evaluate()
	b.Reset()
	require.NoError(t, WriteText(&b, r))
	require.Contains(t, b.String(), "\nJetStream  not checked: BATON_NATS_URL is not set\n")
	require.Contains(t, b.String(), "  active         no (no relay is streaming)\n")
	require.True(t, strings.HasSuffix(b.String(), "warnings:\n  - no relay is streaming: slot \"baton\" is inactive and retains 32 B of WAL; start `baton relay`\nok: nothing needs attention\n"), b.String())
}

func TestStatusWriteJSON(t *testing.T) {
	r := healthy()
	r.Streams = StreamsSkipped("BATON_NATS_URL is not set")
	r.Evaluate()
	var b bytes.Buffer
	require.NoError(t, WriteJSON(&b, r))
	var raw map[string]any
	require.NoError(t, json.Unmarshal(b.Bytes(), &raw))
	require.Equal(t, true, raw["ok"])
	require.Equal(t, []any{}, raw["attention"], "empty lists are [], not null")
	require.Equal(t, map[string]any{"checked": false, "note": "BATON_NATS_URL is not set",
		"turns": nil, "outcomes": nil, "consumer": nil}, raw["streams"])
	outbox := raw["outbox"].(map[string]any)
	require.Nil(t, outbox["oldest_processing_age_seconds"])
	require.Equal(t, 12.0, outbox["oldest_pending_age_seconds"])

	var back Report
	require.NoError(t, json.Unmarshal(b.Bytes(), &back))
	require.Equal(t, *r, back)
}

func TestStatusFormatting(t *testing.T) {
	for n, want := range map[int64]string{0: "0 B", 1023: "1023 B", 1024: "1.0 KiB", 1536: "1.5 KiB",
		5 << 20: "5.0 MiB", 3 << 30: "3.0 GiB", -2048: "-2.0 KiB"} {
		require.Equal(t, want, fmtBytes(n), "%d", n)
	}
	for d, want := range map[time.Duration]string{-time.Second: "0s", 1500 * time.Microsecond: "2ms",
		1499 * time.Millisecond: "1s", 61 * time.Second: "1m1s", 2*time.Hour + 31*time.Second: "2h1m0s"} {
		require.Equal(t, want, fmtAge(d), "%v", d)
	}
}

// requireEach requires got to hold as many findings as want, the i-th containing want[i].
func requireEach(t *testing.T, what string, got, want []string) {
	t.Helper()
	require.Len(t, got, len(want), "%s: %q", what, got)
	for i, w := range want {
		require.Contains(t, got[i], w)
	}
}
