package main

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"regexp"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/stretchr/testify/require"

	"github.com/batonhq/baton/consumer"
	"github.com/batonhq/baton/internal/statusreport"
	"github.com/batonhq/baton/internal/testsvc"
	"github.com/batonhq/baton/migrations"
	"github.com/batonhq/baton/producer"
	"github.com/batonhq/baton/relay"
)

// statusBundle is a live Baton for status tests: a database of its own, a NATS server and a
// relay on a slot of the test's own.
type statusBundle struct {
	t    *testing.T
	db   *testsvc.Database
	ns   *testsvc.NATS
	nc   *nats.Conn
	prod *producer.Producer
}

func statusSetup(t *testing.T) *statusBundle {
	t.Helper()
	b := &statusBundle{t: t, db: testsvc.NewDatabase(t), ns: testsvc.StartNATS(t)}
	nc, err := nats.Connect(b.ns.URL(), nats.MaxReconnects(-1))
	require.NoError(t, err)
	t.Cleanup(nc.Close)
	b.nc = nc
	b.prod, err = producer.New(producer.Config{})
	require.NoError(t, err)
	return b
}

func discardLogger() *slog.Logger { return slog.New(slog.NewTextHandler(io.Discard, nil)) }

// startRelay runs a relay until the test ends or stop is called, and waits until it streams.
func (b *statusBundle) startRelay() (stop func()) {
	t := b.t
	t.Helper()
	r, err := relay.New(relay.Config{DatabaseURL: b.db.RoleURL(testsvc.RoleRelay), NATS: b.nc, Slot: b.db.Name,
		StatusInterval: 100 * time.Millisecond, Logger: discardLogger()})
	require.NoError(t, err)
	return b.runUntilStopped("relay", r.Run, func() bool { return r.Active() })
}

// startWorker runs an echo worker on the JetStream source with the default durable.
func (b *statusBundle) startWorker() (stop func()) {
	t := b.t
	t.Helper()
	w, err := consumer.New(consumer.Config{Pool: b.db.RolePool(t, testsvc.RoleWorker), NATS: b.nc, Logger: discardLogger(),
		Handler: func(_ context.Context, turn *consumer.Turn) (consumer.Reply, error) {
			return consumer.Reply{Content: "echo: " + turn.Messages[0].Content}, nil
		}})
	require.NoError(t, err)
	return b.runUntilStopped("worker", w.Run, nil)
}

func (b *statusBundle) runUntilStopped(what string, run func(context.Context) error, ready func() bool) (stop func()) {
	t := b.t
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- run(ctx) }()
	var once sync.Once
	stop = func() {
		once.Do(func() {
			cancel()
			select {
			case err := <-done:
				require.NoError(t, err, what)
			case <-time.After(30 * time.Second):
				t.Errorf("%s did not stop within 30s", what)
			}
		})
	}
	t.Cleanup(stop)
	if ready != nil {
		require.Eventually(t, ready, time.Minute, 5*time.Millisecond, "%s never became ready", what)
	}
	return stop
}

func (b *statusBundle) conversations(ids ...string) {
	for _, id := range ids {
		_, err := b.prod.CreateConversation(context.Background(), b.db.Pool, id)
		require.NoError(b.t, err)
	}
}

func (b *statusBundle) send(conv, id string) {
	_, err := b.prod.Send(context.Background(), b.db.Pool, producer.Message{ConversationID: conv, ID: id, Content: "hello " + id})
	require.NoError(b.t, err)
}

func (b *statusBundle) exec(sql string, args ...any) {
	_, err := b.db.Pool.Exec(context.Background(), sql, args...)
	require.NoError(b.t, err)
}

func (b *statusBundle) count(sql string, args ...any) int {
	var n int
	require.NoError(b.t, b.db.Pool.QueryRow(context.Background(), sql, args...).Scan(&n))
	return n
}

// status runs `baton status` on the bundle's database and slot with extra args.
func (b *statusBundle) status(withNATS bool, args ...string) result {
	b.t.Helper()
	base := []string{"status", "--database-url", b.db.URL, "--slot", b.db.Name}
	if withNATS {
		base = append(base, "--nats-url", b.ns.URL())
	}
	return runBaton(b.t, append(base, args...)...)
}

func parseReport(t *testing.T, r result) statusreport.Report {
	t.Helper()
	var rep statusreport.Report
	require.NoError(t, json.Unmarshal([]byte(r.stdout), &rep), "stdout: %s\nstderr: %s", r.stdout, r.stderr)
	return rep
}

// parseTextActive reports whether the text report shows the slot active.
func parseTextActive(stdout string) bool {
	return regexp.MustCompile(`(?m)^  active {2,}yes`).MatchString(stdout)
}

func TestStatusOfLiveSystem(t *testing.T) {
	t.Parallel()
	b := statusSetup(t)
	b.startRelay()
	b.conversations("c1", "c2", "c3")

	// Three requests answered by a worker: three done rows, three outcomes.
	stopWorker := b.startWorker()
	for _, c := range []string{"c1", "c2", "c3"} {
		b.send(c, c+"-m1")
	}
	require.Eventually(t, func() bool {
		return b.count(`SELECT count(*) FROM agent_outbox WHERE status = 'done'`) == 3
	}, time.Minute, 10*time.Millisecond)
	stopWorker()

	// With no worker: two stay pending, one is marked done and one error by SQL.
	b.send("c1", "c1-m2")
	b.send("c2", "c2-m2")
	b.send("c3", "c3-m2")
	b.send("c3", "c3-m3")
	b.exec(`UPDATE agent_outbox SET status = 'done', processed_at = now() WHERE message_id = 'c3-m2'`)
	b.exec(`UPDATE agent_outbox SET status = 'error', processed_at = now(), last_error = 'by hand' WHERE message_id = 'c3-m3'`)

	// The relay and the acks are asynchronous: wait until the streams and the consumer settled.
	// The turns stream is a work queue: the three acknowledged events are gone from it, the
	// four pending ones stay (7 stored in all, after the relay's fence message: sequence 8;
	// the report counts events, not the fence).
	var r result
	var rep statusreport.Report
	require.Eventually(t, func() bool {
		r = b.status(true, "--json")
		var got statusreport.Report
		if json.Unmarshal([]byte(r.stdout), &got) != nil || got.Streams.Turns == nil || got.Streams.Consumer == nil {
			return false
		}
		rep = got
		return got.Streams.Turns.Messages == 4 && got.Streams.Turns.LastSeq == 8 && got.Streams.Outcomes.Messages == 3 &&
			got.Streams.Consumer.NumPending == 4 && got.Streams.Consumer.NumAckPending == 0
	}, time.Minute, 50*time.Millisecond, "streams never settled; last report:\n%s\n%s", r.stdout, r.stderr)
	require.Equal(t, 0, r.code, r.stderr)
	require.Empty(t, r.stderr)

	require.True(t, rep.OK)
	require.Empty(t, rep.Attention)
	require.Empty(t, rep.Warnings)
	require.Equal(t, b.db.Name, rep.Database)
	require.Equal(t, 300.0, rep.StaleAfterSeconds)

	require.Equal(t, b.db.Name, rep.Slot.Name)
	require.True(t, rep.Slot.Exists)
	require.True(t, rep.Slot.Active)
	require.NotNil(t, rep.Slot.ActivePID)
	require.Positive(t, *rep.Slot.ActivePID)
	require.Equal(t, "reserved", rep.Slot.WALStatus)
	require.Equal(t, "pgoutput", rep.Slot.Plugin)
	require.NotEmpty(t, rep.Slot.ConfirmedLSN)
	require.NotEmpty(t, rep.Slot.CurrentLSN)
	require.NotNil(t, rep.Slot.RetainedWALBytes)
	require.GreaterOrEqual(t, *rep.Slot.RetainedWALBytes, int64(0))
	require.NotNil(t, rep.Slot.LagBytes)
	require.GreaterOrEqual(t, *rep.Slot.LagBytes, int64(0))

	require.Equal(t, statusreport.StatusCounts{Pending: 2, Processing: 0, Done: 4, Error: 1}, rep.Outbox.ByStatus)
	require.NotNil(t, rep.Outbox.OldestPendingAgeSeconds)
	require.Less(t, *rep.Outbox.OldestPendingAgeSeconds, 300.0)
	require.NotNil(t, rep.Outbox.OldestPendingAt)
	require.Nil(t, rep.Outbox.OldestProcessingAgeSeconds)
	require.Zero(t, rep.Outbox.ExpiredLeases)

	require.True(t, rep.Streams.Checked)
	require.Equal(t, b.ns.URL(), rep.Streams.URL)
	require.Equal(t, "AGENT_TURNS", rep.Streams.Turns.Name)
	require.True(t, rep.Streams.Turns.Exists)
	require.Equal(t, "AGENT_OUTCOMES", rep.Streams.Outcomes.Name)
	require.Equal(t, uint64(4), rep.Streams.Outcomes.LastSeq, "the relay's fence, then three outcomes")
	require.Equal(t, "baton-workers", rep.Streams.Consumer.Name)
	require.True(t, rep.Streams.Consumer.Exists)
	require.Zero(t, rep.Streams.Consumer.NumRedelivered)

	require.Equal(t, migrations.Latest(), rep.Schema.Version)
	require.Equal(t, migrations.Latest(), rep.Schema.BinaryVersion)

	// The JSON field names are a contract: spot-check the raw document.
	var raw map[string]any
	require.NoError(t, json.Unmarshal([]byte(r.stdout), &raw))
	slot := raw["slot"].(map[string]any)
	for _, k := range []string{"name", "active", "active_pid", "wal_status", "retained_wal_bytes", "confirmed_lsn", "lag_bytes"} {
		require.Contains(t, slot, k)
	}
	byStatus := raw["outbox"].(map[string]any)["by_status"].(map[string]any)
	require.Equal(t, map[string]any{"pending": 2.0, "processing": 0.0, "done": 4.0, "error": 1.0}, byStatus)
	require.Equal(t, 4.0, raw["streams"].(map[string]any)["turns"].(map[string]any)["messages"])

	// The table shows the same, aligned.
	r = b.status(true)
	require.Equal(t, 0, r.code, r.stderr)
	for _, want := range []string{
		`(?m)^Replication slot$`,
		`(?m)^  slot {2,}` + regexp.QuoteMeta(b.db.Name) + `$`,
		`(?m)^  active {2,}yes \(pid \d+\)$`,
		`(?m)^  wal_status {2,}reserved$`,
		`(?m)^  retained WAL {2,}\d+(\.\d)? [KMG]?i?B \(restart_lsn [0-9A-F]+/[0-9A-F]+\)$`,
		`(?m)^  confirmed LSN {2,}[0-9A-F]+/[0-9A-F]+$`,
		`(?m)^  lag {2,}\d+(\.\d)? [KMG]?i?B \(current [0-9A-F]+/[0-9A-F]+\)$`,
		`(?m)^  pending {2,}2 \(oldest [0-9.]+m?s\)$`,
		`(?m)^  processing {2,}0$`,
		`(?m)^  done {2,}4$`,
		`(?m)^  error {2,}1$`,
		// A work queue: the acknowledged events are gone; the relay's fence stays first (1).
		`(?m)^  AGENT_TURNS {2,}4 {2,}\S+ \S+ {2,}1 {2,}8 {2,}`,
		`(?m)^  AGENT_OUTCOMES {2,}3 {2,}`,
		`(?m)^  baton-workers {2,}AGENT_TURNS {2,}4 {2,}0 {2,}0 {2,}\d+$`,
		fmt.Sprintf(`(?m)^  version {2,}%d \(this binary: %d\)$`, migrations.Latest(), migrations.Latest()),
		`(?m)^ok: nothing needs attention$`,
	} {
		require.Regexp(t, want, r.stdout)
	}
	require.NotContains(t, r.stdout, "attention:")
}

func TestStatusSlotInactiveThenMissing(t *testing.T) {
	t.Parallel()
	b := statusSetup(t)
	stopRelay := b.startRelay()
	b.conversations("c1")
	b.send("c1", "c1-m1")
	require.Eventually(t, func() bool {
		rep := parseReport(t, b.status(true, "--json"))
		return rep.Streams.Turns != nil && rep.Streams.Turns.Messages == 1
	}, time.Minute, 50*time.Millisecond)
	stopRelay()

	// No relay streaming is a warning, not an alarm: the slot still holds everything. (A stopped
	// relay's walsender releases the slot asynchronously.)
	var r result
	require.Eventually(t, func() bool {
		r = b.status(true)
		return !parseTextActive(r.stdout)
	}, 30*time.Second, 20*time.Millisecond, "slot still active:\n%s", r.stdout)
	require.Equal(t, 0, r.code, r.stdout+r.stderr)
	require.Regexp(t, `(?m)^  active {2,}no \(no relay is streaming\)$`, r.stdout)
	require.Contains(t, r.stdout, "warnings:\n  - no relay is streaming: slot \""+b.db.Name+"\" is inactive")
	require.Contains(t, r.stdout, "does not exist") // the worker's consumer: none ran
	require.Contains(t, r.stdout, "ok: nothing needs attention")

	// The slot dropped: attention, exit 1, report printed first.
	require.Eventually(t, func() bool {
		_, err := b.db.Pool.Exec(context.Background(), `SELECT pg_drop_replication_slot($1)`, b.db.Name)
		return err == nil // a stopped walsender releases its slot asynchronously
	}, 30*time.Second, 20*time.Millisecond)

	r = b.status(true)
	require.Equal(t, 1, r.code, r.stdout+r.stderr)
	require.Regexp(t, `(?m)^  exists {2,}no$`, r.stdout)
	require.Regexp(t, `(?m)^attention:\n  - replication slot "`+regexp.QuoteMeta(b.db.Name)+`" does not exist`, r.stdout)
	require.Contains(t, r.stdout, "AGENT_TURNS", "the rest of the report is still there")
	require.Equal(t, "baton status: 1 thing needs attention (see the list above)\n", r.stderr)

	r = b.status(true, "--json")
	require.Equal(t, 1, r.code)
	rep := parseReport(t, r)
	require.False(t, rep.OK)
	require.False(t, rep.Slot.Exists)
	require.Nil(t, rep.Slot.ActivePID)
	require.Len(t, rep.Attention, 1)
	require.Contains(t, rep.Attention[0], "does not exist")
	require.Equal(t, statusreport.StatusCounts{Pending: 1}, rep.Outbox.ByStatus)
}

func TestStatusStaleWorkWithoutNATS(t *testing.T) {
	t.Parallel()
	b := statusSetup(t)
	// A slot no relay reads: inactive, which alone is only a warning.
	b.exec(`SELECT pg_create_logical_replication_slot($1, 'pgoutput')`, b.db.Name)
	b.conversations("c1")
	b.send("c1", "c1-m1")

	r := b.status(false)
	require.Equal(t, 0, r.code, r.stdout+r.stderr)
	require.Regexp(t, `(?m)^JetStream {2,}not checked: BATON_NATS_URL is not set`, r.stdout)
	require.Regexp(t, `(?m)^  pending {2,}1 \(oldest `, r.stdout)

	require.Eventually(t, func() bool { // created_at to now() by the database's clock
		return b.count(`SELECT count(*) FROM agent_outbox WHERE created_at < now() - interval '5 milliseconds'`) == 1
	}, 10*time.Second, 5*time.Millisecond)
	r = b.status(false, "--stale-after", "1ms")
	require.Equal(t, 1, r.code, r.stdout+r.stderr)
	require.Regexp(t, `(?m)^attention:\n  - the oldest pending request is .+ old \(over --stale-after 1ms\): 1 pending`, r.stdout)
	require.Equal(t, "baton status: 1 thing needs attention (see the list above)\n", r.stderr)

	r = b.status(false, "--stale-after", "1ms", "--json")
	require.Equal(t, 1, r.code)
	rep := parseReport(t, r)
	require.False(t, rep.OK)
	require.False(t, rep.Streams.Checked)
	require.Contains(t, rep.Streams.Note, "BATON_NATS_URL is not set")
	require.Nil(t, rep.Streams.Turns)
	require.True(t, rep.Slot.Exists)
	require.False(t, rep.Slot.Active)
	require.Len(t, rep.Attention, 1)
	require.Contains(t, rep.Attention[0], "oldest pending request")
	require.Len(t, rep.Warnings, 1)
	require.Contains(t, rep.Warnings[0], "no relay is streaming")
}

func TestStatusUnreachableNATSAndEmptyDatabase(t *testing.T) {
	t.Parallel()
	dbURL := emptyDatabase(t)
	r := runBaton(t, "status", "--database-url", dbURL, "--slot", "status_no_such_slot", "--nats-url", "nats://127.0.0.1:1", "--json")
	require.Equal(t, 1, r.code, r.stderr)
	rep := parseReport(t, r)
	require.True(t, rep.Streams.Checked)
	require.NotEmpty(t, rep.Streams.Error)
	require.Equal(t, 0, rep.Schema.Version)
	require.NotEmpty(t, rep.Outbox.Error)
	var joined string
	for _, a := range rep.Attention {
		joined += a + "\n"
	}
	require.Contains(t, joined, "NATS: connect to NATS at nats://127.0.0.1:1")
	require.Contains(t, joined, "run `baton migrate`")
	require.Contains(t, joined, "does not exist")
}

func TestStatusUsage(t *testing.T) {
	t.Parallel()
	r := runBaton(t, "status")
	require.Equal(t, 1, r.code)
	require.Equal(t, "baton status: BATON_DATABASE_URL is not set: set it or pass --database-url\n", r.stderr)

	r = runBaton(t, "status", "--database-url", "postgres:///x", "--stale-after", "0s")
	require.Equal(t, 2, r.code)
	require.Contains(t, r.stderr, "--stale-after must be positive")

	r = runBaton(t, "help", "status")
	require.Equal(t, 0, r.code)
	for _, flag := range []string{"-json", "-stale-after", "-durable", "-slot", "-nats-url", "-subject-prefix"} {
		require.Contains(t, r.stdout, flag)
	}
}
