package relay_test

// Benchmarks of the relay against baselines measured in the same run.
//
//	go test -run '^$' -bench 'Relay' -benchtime=1x -timeout 20m ./relay/
//
// One benchmark iteration is one whole experiment (a 200k-row catch-up, or a 10 s steady run):
// run them with -benchtime=1x. b.N is not used to repeat anything, and the experiment runs
// once whatever b.N is. The timer covers only the relay's part (ns/op is the relay process's
// start to its 200,000th stored event, or the 10 s paced run); the figures that matter are
// reported with b.ReportMetric. Baselines run inside the same benchmark, on the same Postgres
// cluster, backlog and NATS server, so their ratios compare like with like on a machine other
// people's tests also load: read the ratios, not the absolute rates.

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"maps"
	"math"
	"net"
	"net/http"
	"os"
	"os/exec"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pglogrepl"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgproto3"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/batonhq/baton/internal/testsvc"
	"github.com/batonhq/baton/relay"
	"github.com/batonhq/baton/wire"
)

const (
	benchRows  = 200_000 // backlog size
	benchConvs = 1000    // conversations the backlog and the load spread over
)

// benchEnv is a database of its own, a NATS server of its own and a connection to it.
type benchEnv struct {
	db   *testsvc.Database
	ns   *testsvc.NATS
	nc   *nats.Conn
	js   jetstream.JetStream
	slot string
}

func newBenchEnv(tb testing.TB) *benchEnv {
	tb.Helper()
	db := testsvc.NewDatabase(tb)
	ns := testsvc.StartNATS(tb)
	nc, err := nats.Connect(ns.URL(), nats.MaxReconnects(-1))
	if err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(nc.Close)
	js, err := jetstream.New(nc)
	if err != nil {
		tb.Fatal(err)
	}
	e := &benchEnv{db: db, ns: ns, nc: nc, js: js, slot: db.Name}
	// conversations c0000 … c0999
	if _, err := db.Pool.Exec(context.Background(), `INSERT INTO conversations (id)
		SELECT 'c' || lpad(g::text, 4, '0') FROM generate_series(0, $1 - 1) g`, benchConvs); err != nil {
		tb.Fatal(err)
	}
	return e
}

func benchConv(i int) string { return fmt.Sprintf("c%04d", i%benchConvs) }

// createRelaySlot runs an in-process relay on slot with subject prefix until it streams, then
// stops it: the slot exists, its (empty) backfill is recorded in baton_relay_slots, and the
// streams exist. What is committed afterwards reaches the next relay through the slot, not
// the backfill.
func (e *benchEnv) createRelaySlot(tb testing.TB, slot, prefix string) {
	tb.Helper()
	r, err := relay.New(relay.Config{
		DatabaseURL: e.db.URL, NATS: e.nc, Slot: slot, SubjectPrefix: prefix,
		Logger: slog.New(slog.NewTextHandler(io.Discard, nil)),
	})
	if err != nil {
		tb.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- r.Run(ctx) }()
	for deadline := time.Now().Add(time.Minute); !r.Active(); time.Sleep(5 * time.Millisecond) {
		if time.Now().After(deadline) {
			cancel()
			tb.Fatalf("relay never became active (Run returned %v)", <-done)
		}
	}
	cancel()
	if err := <-done; err != nil {
		tb.Fatal(err)
	}
	e.waitSlotsIdle(tb)
}

// waitSlotsIdle waits until no walsender holds a slot of the database, so the next relay does
// not stand by for a slot its predecessor's walsender is still releasing.
func (e *benchEnv) waitSlotsIdle(tb testing.TB) {
	tb.Helper()
	for deadline := time.Now().Add(30 * time.Second); ; time.Sleep(5 * time.Millisecond) {
		var busy int
		if err := e.db.Pool.QueryRow(context.Background(), `SELECT count(*) FROM pg_replication_slots
			WHERE database = $1 AND active`, e.db.Name).Scan(&busy); err != nil {
			tb.Fatal(err)
		}
		if busy == 0 {
			return
		}
		if time.Now().After(deadline) {
			tb.Fatal("replication slots still active after 30s")
		}
	}
}

func (e *benchEnv) createBareSlot(tb testing.TB, name string) {
	tb.Helper()
	if _, err := e.db.Pool.Exec(context.Background(), `SELECT pg_create_logical_replication_slot($1, 'pgoutput')`, name); err != nil {
		tb.Fatal(err)
	}
}

func (e *benchEnv) walInsertLSN(tb testing.TB) pglogrepl.LSN {
	tb.Helper()
	var s string
	if err := e.db.Pool.QueryRow(context.Background(), `SELECT pg_current_wal_insert_lsn()::text`).Scan(&s); err != nil {
		tb.Fatal(err)
	}
	lsn, err := pglogrepl.ParseLSN(s)
	if err != nil {
		tb.Fatal(err)
	}
	return lsn
}

func (e *benchEnv) slotConfirmed(ctx context.Context, slot string) (pglogrepl.LSN, error) {
	var s string
	if err := e.db.Pool.QueryRow(ctx, `SELECT coalesce(confirmed_flush_lsn::text, '0/0') FROM pg_replication_slots
		WHERE slot_name = $1`, slot).Scan(&s); err != nil {
		return 0, err
	}
	return pglogrepl.ParseLSN(s)
}

func (e *benchEnv) streamMsgs(ctx context.Context, name string) (uint64, error) {
	s, err := e.js.Stream(ctx, name)
	if err != nil {
		return 0, err
	}
	info, err := s.Info(ctx)
	if err != nil {
		return 0, err
	}
	return info.State.Msgs, nil
}

// writeBacklog commits rows user messages with their outbox rows, rowsPerTx of them per
// transaction, round-robin over convs conversations. Each of `workers` sessions runs one DO
// block that commits inside its loop: no round trip per transaction, so 200k one-row
// transactions take seconds. Worker w owns the conversations ≡ w (mod workers) and inserts
// in id order, so each conversation's rows commit in id order.
//
// The sessions skip the commit's WAL flush wait (synchronous_commit = off): it slows the load
// and changes nothing in the WAL the relay decodes. The foreign-key checks stay: their row
// locks are WAL records too, which the walsender reads past, as it would behind real producers.
func writeBacklog(tb testing.TB, pool *pgxpool.Pool, rows, rowsPerTx, workers, convs int) {
	tb.Helper()
	if rows%(workers*rowsPerTx) != 0 || convs%workers != 0 {
		tb.Fatalf("rows %d must split into %d workers × whole transactions of %d", rows, workers, rowsPerTx)
	}
	txs := rows / workers / rowsPerTx
	ctx := context.Background()
	errs := make(chan error, workers)
	for w := range workers {
		go func() {
			conn, err := pool.Acquire(ctx)
			if err != nil {
				errs <- err
				return
			}
			defer conn.Release()
			if _, err := conn.Exec(ctx, `SET synchronous_commit = off`); err != nil {
				errs <- err
				return
			}
			// Row k of worker w: message 'w<w>-<k>' in conversation (w + workers·k) mod convs.
			_, err = conn.Exec(ctx, fmt.Sprintf(`DO $$
BEGIN
	FOR i IN 0..%[1]d - 1 LOOP
		INSERT INTO messages (id, conversation_id, role, content)
			SELECT 'w%[3]d-' || k, 'c' || lpad(((%[3]d + %[4]d * k) %% %[5]d)::text, 4, '0'), 'user', 'hello'
			FROM generate_series(i * %[2]d, i * %[2]d + %[2]d - 1) k;
		INSERT INTO agent_outbox (conversation_id, message_id)
			SELECT 'c' || lpad(((%[3]d + %[4]d * k) %% %[5]d)::text, 4, '0'), 'w%[3]d-' || k
			FROM generate_series(i * %[2]d, i * %[2]d + %[2]d - 1) k ORDER BY k;
		COMMIT;
	END LOOP;
END $$`, txs, rowsPerTx, w, workers, convs))
			errs <- err
		}()
	}
	for range workers {
		if err := <-errs; err != nil {
			tb.Fatal(err)
		}
	}
	var n int
	if err := pool.QueryRow(ctx, `SELECT count(*) FROM agent_outbox`).Scan(&n); err != nil || n != rows {
		tb.Fatalf("backlog holds %d outbox rows, want %d (%v)", n, rows, err)
	}
}

// benchProcess is `baton relay` running as a child process.
type benchProcess struct {
	cmd         *exec.Cmd
	startedAt   time.Time
	streamingAt time.Time     // set before streaming is closed
	streaming   chan struct{} // closed when the process logs that it streams
	exited      chan struct{}
	mu          sync.Mutex
	tail        []string // last log lines, for failures
}

func startBenchProcess(tb testing.TB, e *benchEnv, env ...string) *benchProcess {
	tb.Helper()
	bin := batonBinary(tb)
	cmd := exec.Command(bin, "relay")
	cmd.Env = append(os.Environ(),
		"BATON_DATABASE_URL="+e.db.URL,
		"BATON_NATS_URL="+e.ns.URL(),
		"BATON_SLOT="+e.slot,
		"BATON_LOG_LEVEL=info",
	)
	cmd.Env = append(cmd.Env, env...)
	stderr, err := cmd.StderrPipe()
	if err != nil {
		tb.Fatal(err)
	}
	p := &benchProcess{cmd: cmd, streaming: make(chan struct{}), exited: make(chan struct{})}
	p.startedAt = time.Now()
	if err := cmd.Start(); err != nil {
		tb.Fatal(err)
	}
	go func() {
		sc := bufio.NewScanner(stderr)
		sc.Buffer(make([]byte, 64<<10), 1<<20)
		seen := false
		for sc.Scan() {
			line := sc.Text()
			if !seen && strings.Contains(line, "msg=streaming") {
				seen = true
				p.streamingAt = time.Now()
				close(p.streaming)
			}
			p.mu.Lock()
			p.tail = append(p.tail, line)
			if len(p.tail) > 20 {
				p.tail = p.tail[1:]
			}
			p.mu.Unlock()
		}
		_ = cmd.Wait()
		close(p.exited)
	}()
	tb.Cleanup(p.kill)
	return p
}

func (p *benchProcess) waitStreaming(tb testing.TB) {
	tb.Helper()
	select {
	case <-p.streaming:
	case <-p.exited:
		tb.Fatalf("relay process exited before streaming: %s", p.logTail())
	case <-time.After(time.Minute):
		tb.Fatalf("relay process never streamed: %s", p.logTail())
	}
}

func (p *benchProcess) logTail() string {
	p.mu.Lock()
	defer p.mu.Unlock()
	return strings.Join(p.tail, "\n")
}

func (p *benchProcess) kill() {
	_ = p.cmd.Process.Signal(syscall.SIGKILL)
	select {
	case <-p.exited:
	case <-time.After(30 * time.Second):
	}
}

// peakRSS returns VmHWM of the running process: its peak resident set, in bytes.
func (p *benchProcess) peakRSS() (int64, error) {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", p.cmd.Process.Pid))
	if err != nil {
		return 0, err
	}
	for line := range strings.SplitSeq(string(b), "\n") {
		if rest, ok := strings.CutPrefix(line, "VmHWM:"); ok {
			kb, err := strconv.ParseInt(strings.TrimSpace(strings.TrimSuffix(strings.TrimSpace(rest), "kB")), 10, 64)
			return kb << 10, err
		}
	}
	return 0, errors.New("no VmHWM in /proc status")
}

// cpuSeconds returns the user+system CPU time process pid used so far (clock ticks of 10 ms).
func cpuSeconds(pid int) float64 {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return math.NaN()
	}
	// The command name (field 2) may hold spaces; fields after its closing parenthesis.
	f := strings.Fields(string(b[strings.LastIndexByte(string(b), ')')+1:]))
	if len(f) < 13 {
		return math.NaN()
	}
	utime, _ := strconv.ParseFloat(f[11], 64)
	stime, _ := strconv.ParseFloat(f[12], 64)
	return (utime + stime) / 100
}

// walsenderPID returns the pid of the walsender streaming slot.
func (e *benchEnv) walsenderPID(ctx context.Context, slot string) int {
	var pid int
	_ = e.db.Pool.QueryRow(ctx, `SELECT coalesce(active_pid, 0) FROM pg_replication_slots WHERE slot_name = $1`, slot).Scan(&pid)
	return pid
}

// replConn opens a replication connection and starts streaming slot from its confirmed
// position with the relay's plugin arguments.
func replConn(ctx context.Context, url, slot string) (*pgconn.PgConn, error) {
	cfg, err := pgconn.ParseConfig(url)
	if err != nil {
		return nil, err
	}
	cfg.RuntimeParams["replication"] = "database"
	cfg.RuntimeParams["application_name"] = "baton-bench"
	conn, err := pgconn.ConnectConfig(ctx, cfg)
	if err != nil {
		return nil, err
	}
	err = pglogrepl.StartReplication(ctx, conn, slot, 0, pglogrepl.StartReplicationOptions{
		Mode:       pglogrepl.LogicalReplication,
		PluginArgs: []string{"proto_version '1'", "publication_names 'baton'", "messages 'true'"},
	})
	if err != nil {
		_ = conn.Close(context.Background())
		return nil, err
	}
	return conn, nil
}

// bareReader reads a pgoutput stream and parses every message, nothing more. onInsert, when
// set, is called for each insert with the relation it belongs to.
type bareReader struct {
	conn     *pgconn.PgConn
	received pglogrepl.LSN
	rels     map[uint32]*pglogrepl.RelationMessage
	inserts  int
	onInsert func(rel *pglogrepl.RelationMessage, ins *pglogrepl.InsertMessage)
}

func (r *bareReader) sendStatus() error {
	return pglogrepl.SendStandbyStatusUpdate(context.Background(), r.conn, pglogrepl.StandbyStatusUpdate{
		WALWritePosition: r.received, WALFlushPosition: r.received, WALApplyPosition: r.received, ClientTime: time.Now(),
	})
}

// run reads until stop returns true (checked after each message) or ctx ends. A standby
// status with the received position goes out every second, on one deadline context per
// second as the relay does.
func (r *bareReader) run(ctx context.Context, stop func() bool) error {
	r.rels = map[uint32]*pglogrepl.RelationMessage{}
	next := time.Now().Add(time.Second)
	deadline, cancel := context.WithDeadline(ctx, next)
	defer func() { cancel() }()
	renew := func() {
		next = time.Now().Add(time.Second)
		cancel()
		deadline, cancel = context.WithDeadline(ctx, next)
	}
	for !stop() {
		if time.Now().After(next) {
			if err := r.sendStatus(); err != nil {
				return err
			}
			renew()
		}
		raw, err := r.conn.ReceiveMessage(deadline)
		if err != nil {
			if ctx.Err() != nil {
				return nil
			}
			if pgconn.Timeout(err) {
				continue
			}
			return err
		}
		cd, ok := raw.(*pgproto3.CopyData)
		if !ok {
			if er, ok := raw.(*pgproto3.ErrorResponse); ok {
				return pgconn.ErrorResponseToPgError(er)
			}
			continue
		}
		if len(cd.Data) == 0 {
			continue
		}
		switch cd.Data[0] {
		case pglogrepl.PrimaryKeepaliveMessageByteID:
			ka, err := pglogrepl.ParsePrimaryKeepaliveMessage(cd.Data[1:])
			if err != nil {
				return err
			}
			if ka.ReplyRequested {
				if err := r.sendStatus(); err != nil {
					return err
				}
			}
		case pglogrepl.XLogDataByteID:
			xld, err := pglogrepl.ParseXLogData(cd.Data[1:])
			if err != nil {
				return err
			}
			msg, err := pglogrepl.Parse(xld.WALData)
			if err != nil {
				return err
			}
			switch m := msg.(type) {
			case *pglogrepl.RelationMessage:
				r.rels[m.RelationID] = m
			case *pglogrepl.InsertMessage:
				r.inserts++
				if r.onInsert != nil {
					r.onInsert(r.rels[m.RelationID], m)
				}
			case *pglogrepl.CommitMessage:
				r.received = m.TransactionEndLSN
			}
		}
	}
	return nil
}

// bareDecode streams slot until it has parsed want inserts and returns the time from
// START_REPLICATION's answer to the last of them, and the CPU seconds the walsender and this
// process used meanwhile.
func bareDecode(tb testing.TB, e *benchEnv, slot string, want int) (took time.Duration, walCPU, selfCPU float64) {
	tb.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	conn, err := replConn(ctx, e.db.URL, slot)
	if err != nil {
		tb.Fatal(err)
	}
	defer func() { _ = conn.Close(context.Background()) }()
	walPID := e.walsenderPID(ctx, slot)
	wal0, self0 := cpuSeconds(walPID), cpuSeconds(os.Getpid())
	start := time.Now()
	r := &bareReader{conn: conn}
	if err := r.run(ctx, func() bool { return r.inserts >= want }); err != nil {
		tb.Fatal(err)
	}
	took = time.Since(start)
	walCPU, selfCPU = cpuSeconds(walPID)-wal0, cpuSeconds(os.Getpid())-self0
	if r.inserts < want {
		tb.Fatalf("bare decode saw %d of %d inserts", r.inserts, want)
	}
	if err := r.sendStatus(); err != nil {
		tb.Fatal(err)
	}
	return took, walCPU, selfCPU
}

// plainRelay is the simplest pipelined relay: for every outbox insert it reads, it builds the
// turn event and publishes it with PublishMsgAsync (up to window in flight, no per-subject
// ordering, no LSN bookkeeping: it confirms what it received). It is the ceiling the relay is
// compared with.
type plainRelay struct {
	js     jetstream.JetStream
	prefix string
	cols   map[*pglogrepl.RelationMessage][6]int
	failed atomic.Int64
	// onAck, when set, is called with the outbox id of each PubAck.
	onAck func(id int64)
}

func newPlainRelay(tb testing.TB, e *benchEnv, name string, window int) *plainRelay {
	tb.Helper()
	pr := &plainRelay{prefix: strings.ToLower(name), cols: map[*pglogrepl.RelationMessage][6]int{}}
	if _, err := e.js.CreateStream(context.Background(), jetstream.StreamConfig{
		Name: strings.ToUpper(name), Subjects: []string{wire.StreamFilter(pr.prefix, wire.KindTurns)},
		Storage: jetstream.FileStorage, Duplicates: 2 * time.Minute, MaxMsgs: -1, MaxBytes: -1,
	}); err != nil {
		tb.Fatal(err)
	}
	js, err := jetstream.New(e.nc, jetstream.WithPublishAsyncMaxPending(window),
		jetstream.WithPublishAsyncErrHandler(func(jetstream.JetStream, *nats.Msg, error) { pr.failed.Add(1) }),
		jetstream.WithPublishAsyncAckHandler(func(_ jetstream.JetStream, m *nats.Msg, _ *jetstream.PubAck) {
			if pr.onAck != nil {
				id, _ := strconv.ParseInt(m.Header.Get(wire.HeaderOutboxID), 10, 64)
				pr.onAck(id)
			}
		}))
	if err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(js.CleanupPublisher)
	pr.js = js
	return pr
}

var outboxColumns = [6]string{"id", "conversation_id", "message_id", "status", "attempts", "created_at"}

// publish publishes the turn event of an agent_outbox insert; other inserts are skipped.
func (pr *plainRelay) publish(rel *pglogrepl.RelationMessage, ins *pglogrepl.InsertMessage) error {
	if rel == nil || rel.RelationName != "agent_outbox" {
		return nil
	}
	idx, ok := pr.cols[rel]
	if !ok {
		for i, name := range outboxColumns {
			idx[i] = slices.IndexFunc(rel.Columns, func(c *pglogrepl.RelationMessageColumn) bool { return c.Name == name })
		}
		pr.cols[rel] = idx
	}
	col := func(i int) string { return string(ins.Tuple.Columns[idx[i]].Data) }
	var ev wire.TurnEvent
	ev.OutboxID, _ = strconv.ParseInt(col(0), 10, 64)
	ev.ConversationID, ev.MessageID, ev.Status = col(1), col(2), col(3)
	ev.Attempts, _ = strconv.Atoi(col(4))
	ev.CreatedAt, _ = time.Parse("2006-01-02 15:04:05.999999999-07", col(5))
	subj, err := wire.TurnSubject(pr.prefix, ev.ConversationID)
	if err != nil {
		return err
	}
	m := nats.NewMsg(subj)
	m.Data, _ = json.Marshal(ev)
	m.Header.Set(nats.MsgIdHdr, wire.TurnMsgID(ev.OutboxID))
	m.Header.Set(wire.HeaderOutboxID, strconv.FormatInt(ev.OutboxID, 10))
	m.Header.Set(wire.HeaderConversationID, ev.ConversationID)
	m.Header.Set(wire.HeaderMessageID, ev.MessageID)
	_, err = pr.js.PublishMsgAsync(m, jetstream.WithStallWait(time.Minute))
	return err
}

// plainCatchUp runs a plainRelay on slot until want events have their PubAck and returns the
// time from START_REPLICATION's answer to the last PubAck.
func plainCatchUp(tb testing.TB, e *benchEnv, slot, stream string, want int) time.Duration {
	tb.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	pr := newPlainRelay(tb, e, stream, 4096)
	conn, err := replConn(ctx, e.db.URL, slot)
	if err != nil {
		tb.Fatal(err)
	}
	defer func() { _ = conn.Close(context.Background()) }()
	start := time.Now()
	var pubErr error
	r := &bareReader{conn: conn, onInsert: func(rel *pglogrepl.RelationMessage, ins *pglogrepl.InsertMessage) {
		if err := pr.publish(rel, ins); err != nil && pubErr == nil {
			pubErr = err
		}
	}}
	if err := r.run(ctx, func() bool { return r.inserts >= want || pubErr != nil }); err != nil {
		tb.Fatal(err)
	}
	if pubErr != nil {
		tb.Fatal(pubErr)
	}
	select {
	case <-pr.js.PublishAsyncComplete():
	case <-ctx.Done():
		tb.Fatal("plain relay: PubAcks never all arrived")
	}
	took := time.Since(start)
	if pr.failed.Load() > 0 {
		tb.Fatalf("plain relay: %d publishes failed", pr.failed.Load())
	}
	if n, err := e.streamMsgs(ctx, stream); err != nil || n != uint64(want) {
		tb.Fatalf("plain relay stored %d of %d (%v)", n, want, err)
	}
	return took
}

// turnLikeMsg builds a message shaped like the relay's turn event of outbox row id: same
// subject form, the same headers (Nats-Msg-Id among them), a JSON body of ~180 B.
func turnLikeMsg(prefix string, id int64, conv string, at time.Time) *nats.Msg {
	subj, err := wire.TurnSubject(prefix, conv)
	if err != nil {
		panic(err)
	}
	body, _ := json.Marshal(wire.TurnEvent{OutboxID: id, ConversationID: conv, MessageID: fmt.Sprintf("w0-%d", id),
		Status: "pending", CreatedAt: at})
	m := nats.NewMsg(subj)
	m.Data = body
	m.Header.Set(nats.MsgIdHdr, wire.TurnMsgID(id))
	m.Header.Set(wire.HeaderOutboxID, strconv.FormatInt(id, 10))
	m.Header.Set(wire.HeaderConversationID, conv)
	m.Header.Set(wire.HeaderMessageID, fmt.Sprintf("w0-%d", id))
	return m
}

// barePublish publishes n turn-like events over benchConvs conversations with PublishMsgAsync,
// at most window in flight, into a fresh file stream, and returns the time until every PubAck.
func barePublish(tb testing.TB, e *benchEnv, name string, n, window int) time.Duration {
	tb.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	prefix := strings.ToLower(name)
	if _, err := e.js.CreateStream(ctx, jetstream.StreamConfig{
		Name: strings.ToUpper(name), Subjects: []string{wire.StreamFilter(prefix, wire.KindTurns)},
		Storage: jetstream.FileStorage, Duplicates: 2 * time.Minute, MaxMsgs: -1, MaxBytes: -1,
	}); err != nil {
		tb.Fatal(err)
	}
	var failed atomic.Int64
	js, err := jetstream.New(e.nc, jetstream.WithPublishAsyncMaxPending(window),
		jetstream.WithPublishAsyncErrHandler(func(jetstream.JetStream, *nats.Msg, error) { failed.Add(1) }))
	if err != nil {
		tb.Fatal(err)
	}
	defer js.CleanupPublisher()
	now := time.Now().UTC()
	start := time.Now()
	for i := range n {
		m := turnLikeMsg(prefix, int64(i+1), benchConv(i), now)
		if _, err := js.PublishMsgAsync(m, jetstream.WithStallWait(time.Minute)); err != nil {
			tb.Fatal(err)
		}
	}
	select {
	case <-js.PublishAsyncComplete():
	case <-ctx.Done():
		tb.Fatal("PubAcks never all arrived")
	}
	took := time.Since(start)
	if failed.Load() > 0 {
		tb.Fatalf("%d async publishes failed", failed.Load())
	}
	if got, err := e.streamMsgs(ctx, strings.ToUpper(name)); err != nil || got != uint64(n) {
		tb.Fatalf("stream %s holds %d of %d (%v)", name, got, n, err)
	}
	return took
}

// BenchmarkRelayCatchUp measures a `baton relay` process publishing a 200k-row backlog that
// sits in its slot (1,000 conversations; 1-row transactions, and 100-row ones), next to, on
// the same backlog: a bare pgoutput reader and a plain pipelined relay (plainRelay), each on
// a slot created before the backlog, and a bare async publisher of as many turn-shaped events.
//
// Everything runs one at a time, in two rounds for the 1-row backlog (relay, bare decode,
// plain relay, bare publish; then again on fresh slots and streams), and each figure is the
// better of its rounds: other people's load only ever slows a run down, so the best of two is
// the closer estimate, and interleaving keeps a burst of load from hitting one contender only.
//
// Metrics: rows/s (relay: from its "streaming" log line to the 200,000th event stored in
// JetStream), bare-decode-rows/s and x-bare-decode (rows/s ÷ bare decode, target ≥ 0.75),
// plain-relay-rows/s and x-plain-relay, bare-pub-msgs/s (window 4096) and x-bare-pub,
// confirm-s (streaming until the slot's confirmed_flush_lsn reaches the backlog's end; includes
// up to one 1 s status interval), peak-RSS-MiB (VmHWM of the relay process after catch-up, the
// higher of the two rounds; target ≤ 64), and the CPU time per row (the lower of the two) of
// the relay process, its walsender and this process, which hosts the NATS server and little
// else meanwhile: relay-cpu-us/row, walsender-cpu-us/row, nats-cpu-us/row. CPU time is much
// steadier than wall time on a shared machine.
func BenchmarkRelayCatchUp(b *testing.B) {
	// The 100-row variant is a side figure: one round keeps the whole run near 3 minutes.
	for _, v := range []struct{ perTx, rounds int }{{1, 2}, {100, 1}} {
		b.Run(fmt.Sprintf("rows-per-tx=%d", v.perTx), func(b *testing.B) { benchCatchUp(b, v.perTx, v.rounds) })
	}
}

// catchUpRound holds one round's figures.
type catchUpRound struct {
	relay, bare, plain, pub   time.Duration // time to handle benchRows
	confirm                   time.Duration // relay streaming → slot confirmed the backlog's end
	rss                       int64
	relayCPU, walCPU, natsCPU float64 // CPU seconds during the relay's catch-up
}

func benchCatchUp(b *testing.B, rowsPerTx, rounds int) {
	b.StopTimer()
	e := newBenchEnv(b)
	batonBinary(b)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
	defer cancel()

	// 1. Every slot exists before the backlog: the relays' (created by the relay, an empty
	// backfill recorded; one subject prefix per round so no round's events are dropped as
	// duplicates of the previous one), the bare readers' and the plain relays'.
	slot := func(kind string, r int) string { return fmt.Sprintf("%s_%s%d", e.slot, kind, r) }
	prefix := func(r int) string { return fmt.Sprintf("agent%d", r) }
	for r := range rounds {
		e.createRelaySlot(b, slot("relay", r), prefix(r))
		e.createBareSlot(b, slot("bare", r))
		e.createBareSlot(b, slot("plain", r))
	}

	// 2. The backlog, written while no relay runs.
	began := time.Now()
	writeBacklog(b, e.db.Pool, benchRows, rowsPerTx, 2, benchConvs)
	end := e.walInsertLSN(b)
	b.Logf("backlog: %d rows in %d-row transactions written in %v, WAL end %s", benchRows, rowsPerTx,
		time.Since(began).Round(time.Millisecond), end)

	res := make([]catchUpRound, rounds)
	for r := range rounds {
		res[r] = catchUpOnce(b, ctx, e, slot("relay", r), prefix(r), end)
		var bareWalCPU, bareCPU float64
		res[r].bare, bareWalCPU, bareCPU = bareDecode(b, e, slot("bare", r), benchRows)
		res[r].plain = plainCatchUp(b, e, slot("plain", r), fmt.Sprintf("PLAIN%d", r), benchRows)
		res[r].pub = barePublish(b, e, fmt.Sprintf("BENCH%d", r), benchRows, 4096)
		e.waitSlotsIdle(b)
		if _, err := e.db.Pool.Exec(ctx, `SELECT pg_drop_replication_slot(s) FROM unnest($1::text[]) s`,
			[]string{slot("relay", r), slot("bare", r), slot("plain", r)}); err != nil {
			b.Fatal(err)
		}
		x := res[r]
		b.Logf("round %d: relay %v (%.0f rows/s), confirmed after %v, peak RSS %.1f MiB, CPU s: relay %.2f walsender %.2f NATS %.2f; "+
			"bare decode %v (%.0f rows/s; CPU s: walsender %.2f reader %.2f); plain relay %v (%.0f rows/s); bare publish %v (%.0f msgs/s)",
			r, x.relay.Round(time.Millisecond), benchRows/x.relay.Seconds(), x.confirm.Round(time.Millisecond), float64(x.rss)/(1<<20),
			x.relayCPU, x.walCPU, x.natsCPU, x.bare.Round(time.Millisecond), benchRows/x.bare.Seconds(), bareWalCPU, bareCPU,
			x.plain.Round(time.Millisecond), benchRows/x.plain.Seconds(), x.pub.Round(time.Millisecond), benchRows/x.pub.Seconds())
	}

	best := func(f func(catchUpRound) float64) float64 {
		v := f(res[0])
		for _, x := range res[1:] {
			v = max(v, f(x))
		}
		return v
	}
	rate := func(d time.Duration) float64 { return benchRows / d.Seconds() }
	relayRate := best(func(x catchUpRound) float64 { return rate(x.relay) })
	bareRate := best(func(x catchUpRound) float64 { return rate(x.bare) })
	plainRate := best(func(x catchUpRound) float64 { return rate(x.plain) })
	pubRate := best(func(x catchUpRound) float64 { return rate(x.pub) })
	perRow := func(f func(catchUpRound) float64) float64 {
		return -best(func(x catchUpRound) float64 { return -f(x) }) / benchRows * 1e6
	}
	b.ReportMetric(relayRate, "rows/s")
	b.ReportMetric(bareRate, "bare-decode-rows/s")
	b.ReportMetric(relayRate/bareRate, "x-bare-decode")
	b.ReportMetric(plainRate, "plain-relay-rows/s")
	b.ReportMetric(relayRate/plainRate, "x-plain-relay")
	b.ReportMetric(pubRate, "bare-pub-msgs/s")
	b.ReportMetric(relayRate/pubRate, "x-bare-pub")
	b.ReportMetric(-best(func(x catchUpRound) float64 { return -x.confirm.Seconds() }), "confirm-s")
	b.ReportMetric(best(func(x catchUpRound) float64 { return float64(x.rss) / (1 << 20) }), "peak-RSS-MiB")
	b.ReportMetric(perRow(func(x catchUpRound) float64 { return x.relayCPU }), "relay-cpu-us/row")
	b.ReportMetric(perRow(func(x catchUpRound) float64 { return x.walCPU }), "walsender-cpu-us/row")
	b.ReportMetric(perRow(func(x catchUpRound) float64 { return x.natsCPU }), "nats-cpu-us/row")
}

// catchUpOnce starts a relay process on slot and prefix, waits until it stored benchRows
// events and confirmed end, and returns its figures. The benchmark timer runs meanwhile.
func catchUpOnce(b *testing.B, ctx context.Context, e *benchEnv, slot, prefix string, end pglogrepl.LSN) catchUpRound {
	b.Helper()
	stream := wire.StreamName(prefix, wire.KindTurns)
	b.StartTimer()
	p := startBenchProcess(b, e, "BATON_SLOT="+slot, "BATON_SUBJECT_PREFIX="+prefix)
	p.waitStreaming(b)
	walPID := e.walsenderPID(ctx, slot)
	nats0 := cpuSeconds(os.Getpid())
	var stored time.Time
	for {
		n, err := e.streamMsgs(ctx, stream)
		if err != nil {
			b.Fatal(err)
		}
		if n >= benchRows {
			stored = time.Now()
			break
		}
		select {
		case <-p.exited:
			b.Fatalf("relay exited during catch-up: %s", p.logTail())
		case <-ctx.Done():
			b.Fatalf("catch-up: %d of %d after %v", n, benchRows, time.Since(p.streamingAt))
		case <-time.After(5 * time.Millisecond):
		}
	}
	b.StopTimer()
	x := catchUpRound{relay: stored.Sub(p.streamingAt), relayCPU: cpuSeconds(p.cmd.Process.Pid),
		walCPU: cpuSeconds(walPID), natsCPU: cpuSeconds(os.Getpid()) - nats0}
	for {
		lsn, err := e.slotConfirmed(ctx, slot)
		if err != nil {
			b.Fatal(err)
		}
		if lsn >= end {
			x.confirm = time.Since(p.streamingAt)
			break
		}
		if ctx.Err() != nil {
			b.Fatalf("slot confirmed %s, never reached %s", lsn, end)
		}
		time.Sleep(5 * time.Millisecond)
	}
	var err error
	if x.rss, err = p.peakRSS(); err != nil {
		b.Fatal(err)
	}
	p.kill()
	if n, err := e.streamMsgs(ctx, stream); err != nil || n != benchRows {
		b.Fatalf("%s holds %d events, want %d (%v)", stream, n, benchRows, err)
	}
	return x
}

// commitRecord is one paced commit: its outbox id and when the statement returned.
type commitRecord struct {
	id   int64
	done time.Time
}

// paceCommits commits one user message and outbox row every 1/rate for d, from 8 sessions fed
// by a pacer on absolute deadlines (no drift when one commit is slow). Each commit's return
// time is recorded.
func paceCommits(tb testing.TB, pool *pgxpool.Pool, tag string, rate int, d time.Duration) []commitRecord {
	tb.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), d+time.Minute)
	defer cancel()
	n := int(d.Seconds() * float64(rate))
	recs := make([]commitRecord, n)
	jobs := make(chan int, n)
	var wg sync.WaitGroup
	var failed atomic.Value
	for range 8 {
		wg.Go(func() {
			conn, err := pool.Acquire(ctx)
			if err != nil {
				failed.Store(err)
				return
			}
			defer conn.Release()
			for i := range jobs {
				id, err := send(ctx, conn, benchConv(i), fmt.Sprintf("%s-%d", tag, i))
				if err != nil {
					failed.Store(err)
					return
				}
				recs[i] = commitRecord{id: id, done: time.Now()}
			}
		})
	}
	interval := time.Second / time.Duration(rate)
	t0 := time.Now()
	for i := range n {
		if wait := time.Until(t0.Add(time.Duration(i) * interval)); wait > 0 {
			time.Sleep(wait)
		}
		jobs <- i
	}
	close(jobs)
	wg.Wait()
	if err, _ := failed.Load().(error); err != nil {
		tb.Fatal(err)
	}
	tb.Logf("%s: %d commits in %v (%.0f/s)", tag, n, time.Since(t0).Round(time.Millisecond), float64(n)/time.Since(t0).Seconds())
	return recs
}

func percentile(sorted []time.Duration, q float64) time.Duration {
	if len(sorted) == 0 {
		return 0
	}
	i := int(math.Ceil(q*float64(len(sorted)))) - 1
	return sorted[max(0, min(i, len(sorted)-1))]
}

func ms(d time.Duration) float64 { return float64(d) / float64(time.Millisecond) }

// latencies returns commit-returned → at for every record after the warm-up, sorted; records
// without an arrival are counted as missing.
func latencies(recs []commitRecord, warmup int, at map[int64]time.Time) (sorted []time.Duration, missing int) {
	for _, r := range recs[warmup:] {
		t, ok := at[r.id]
		if !ok {
			missing++
			continue
		}
		sorted = append(sorted, t.Sub(r.done))
	}
	slices.Sort(sorted)
	return sorted, missing
}

// BenchmarkRelayLatency measures commit → stored in JetStream through a `baton relay` process
// at a steady 1,000 transactions/s for 10 s. Before it, in the same run and at the same rate
// for 5 s, a bare replication client measures commit → received, and a plain pipelined relay
// on the same stream (see plainRelay, running in this process) commit → stored.
//
// Commit time is when the producer's statement (an implicit transaction) returned; stored
// time is the JetStream message timestamp, taken by the in-process NATS server when it stores
// the event, just before it sends the PubAck (same clock). The first second of each run is
// warm-up and not counted.
//
// Metrics: p50-ms and p99-ms (relay, commit → stored; target p99 ≤ 1 ms), max-ms,
// recv-p99-ms (commit → a JetStream subscriber received it), bare-p50-ms and bare-p99-ms
// (commit → bare replication client), plain-p50-ms and plain-p99-ms (commit → stored through
// the plain relay), hist-le1ms-% (the relay's own baton_relay_commit_to_ack_seconds over the
// measured window: share of events acknowledged within 1 ms of the commit record's timestamp).
func BenchmarkRelayLatency(b *testing.B) {
	b.StopTimer()
	const rate = 1000
	e := newBenchEnv(b)
	batonBinary(b)
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()

	// 1. The bare replication client, publishing as the plain relay.
	bareSlot := e.slot + "_bare"
	e.createBareSlot(b, bareSlot)
	plain := newPlainRelay(b, e, "PLAIN", 4096)
	plainStored := collectStored(b, e, "PLAIN")
	conn, err := replConn(ctx, e.db.URL, bareSlot)
	if err != nil {
		b.Fatal(err)
	}
	var mu sync.Mutex
	received := map[int64]time.Time{}
	var pubErr error
	reader := &bareReader{conn: conn, onInsert: func(rel *pglogrepl.RelationMessage, ins *pglogrepl.InsertMessage) {
		now := time.Now()
		if rel == nil || rel.RelationName != "agent_outbox" {
			return
		}
		if i := slices.IndexFunc(rel.Columns, func(c *pglogrepl.RelationMessageColumn) bool { return c.Name == "id" }); i >= 0 {
			id, _ := strconv.ParseInt(string(ins.Tuple.Columns[i].Data), 10, 64)
			mu.Lock()
			received[id] = now
			mu.Unlock()
		}
		if err := plain.publish(rel, ins); err != nil && pubErr == nil {
			pubErr = err
		}
	}}
	rctx, stopReader := context.WithCancel(ctx)
	readerDone := make(chan error, 1)
	go func() { readerDone <- reader.run(rctx, func() bool { return pubErr != nil }) }()
	bareRecs := paceCommits(b, e.db.Pool, "bare+plain", rate, 5*time.Second)
	plainAt := plainStored.wait(b, bareRecs[len(bareRecs)-1].id)
	stopReader()
	if err := <-readerDone; err != nil {
		b.Fatal(err)
	}
	if pubErr != nil {
		b.Fatal(pubErr)
	}
	_ = conn.Close(context.Background())
	mu.Lock()
	bareLat, bareMissing := latencies(bareRecs, rate, received)
	mu.Unlock()
	plainLat, plainMissing := latencies(bareRecs, rate, plainAt.stored)
	if bareMissing+plainMissing > 0 {
		b.Fatalf("bare client missed %d commits, plain relay %d", bareMissing, plainMissing)
	}
	e.waitSlotsIdle(b)
	if _, err := e.db.Pool.Exec(ctx, `SELECT pg_drop_replication_slot($1)`, bareSlot); err != nil {
		b.Fatal(err)
	}

	// 2. The relay process. On its first start it backfills the rows above; wait for them.
	port, err := freeTCPPort()
	if err != nil {
		b.Fatal(err)
	}
	metricsAddr := fmt.Sprintf("127.0.0.1:%d", port)
	p := startBenchProcess(b, e, "BATON_METRICS_ADDR="+metricsAddr)
	p.waitStreaming(b)
	for {
		n, err := e.streamMsgs(ctx, "AGENT_TURNS")
		if err == nil && n >= uint64(len(bareRecs)) {
			break
		}
		if ctx.Err() != nil {
			b.Fatal("the relay never published the backfill")
		}
		time.Sleep(10 * time.Millisecond)
	}
	relayStored := collectStored(b, e, "AGENT_TURNS")

	// The histogram is scraped at the end of the warm-up second and after the run.
	type scraped struct {
		h   histogram
		err error
	}
	atWarm := make(chan scraped, 1)
	go func() {
		time.Sleep(time.Second)
		h, err := scrapeCommitToAck(metricsAddr)
		atWarm <- scraped{h, err}
	}()
	b.StartTimer()
	recs := paceCommits(b, e.db.Pool, "relay", rate, 10*time.Second)
	b.StopTimer()
	warm := <-atWarm
	at := relayStored.wait(b, recs[len(recs)-1].id)
	hist1, err := scrapeCommitToAck(metricsAddr)
	if err != nil || warm.err != nil {
		b.Fatalf("scrape metrics: %v %v", err, warm.err)
	}
	lat, missing := latencies(recs, rate, at.stored)
	recv, _ := latencies(recs, rate, at.recv)
	if missing > 0 {
		b.Fatalf("%d events never arrived", missing)
	}
	window := hist1.minus(warm.h)
	b.ReportMetric(ms(percentile(lat, .50)), "p50-ms")
	b.ReportMetric(ms(percentile(lat, .99)), "p99-ms")
	b.ReportMetric(ms(lat[len(lat)-1]), "max-ms")
	b.ReportMetric(ms(percentile(recv, .99)), "recv-p99-ms")
	b.ReportMetric(ms(percentile(bareLat, .50)), "bare-p50-ms")
	b.ReportMetric(ms(percentile(bareLat, .99)), "bare-p99-ms")
	b.ReportMetric(ms(percentile(plainLat, .50)), "plain-p50-ms")
	b.ReportMetric(ms(percentile(plainLat, .99)), "plain-p99-ms")
	b.ReportMetric(100*window.share(0.001), "hist-le1ms-%")
	b.Logf("relay commit→stored p50 %.3f p90 %.3f p99 %.3f p99.9 %.3f max %.3f ms (n=%d); commit→subscriber p50 %.3f p99 %.3f ms; "+
		"relay histogram: %.1f%% ≤1ms, %.1f%% ≤2.5ms (n=%.0f)",
		ms(percentile(lat, .5)), ms(percentile(lat, .9)), ms(percentile(lat, .99)), ms(percentile(lat, .999)), ms(lat[len(lat)-1]), len(lat),
		ms(percentile(recv, .5)), ms(percentile(recv, .99)), 100*window.share(0.001), 100*window.share(0.0025), window.count)
	b.Logf("bare client commit→received p50 %.3f p99 %.3f max %.3f ms; plain relay commit→stored p50 %.3f p99 %.3f max %.3f ms (n=%d)",
		ms(percentile(bareLat, .5)), ms(percentile(bareLat, .99)), ms(bareLat[len(bareLat)-1]),
		ms(percentile(plainLat, .5)), ms(percentile(plainLat, .99)), ms(plainLat[len(plainLat)-1]), len(plainLat))

	// 3. The same relay code in this process, as the plain relay runs: it takes the slot over
	// from the killed process. Next to run 2, it tells the relay's own cost from what running
	// as a separate, mostly idle process on this machine adds.
	p.kill()
	inLat := inProcessLatency(b, e, rate, 5*time.Second)
	b.ReportMetric(ms(percentile(inLat, .99)), "inproc-p99-ms")
	b.Logf("relay in this process commit→stored p50 %.3f p99 %.3f max %.3f ms (n=%d)",
		ms(percentile(inLat, .5)), ms(percentile(inLat, .99)), ms(inLat[len(inLat)-1]), len(inLat))
}

// inProcessLatency runs the relay library in this process on the bench slot and returns the
// commit→stored latencies of d of commits at rate.
func inProcessLatency(b *testing.B, e *benchEnv, rate int, d time.Duration) []time.Duration {
	b.Helper()
	nc, err := nats.Connect(e.ns.URL())
	if err != nil {
		b.Fatal(err)
	}
	defer nc.Close()
	r, err := relay.New(relay.Config{DatabaseURL: e.db.URL, NATS: nc, Slot: e.slot,
		Logger: slog.New(slog.NewTextHandler(io.Discard, nil))})
	if err != nil {
		b.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- r.Run(ctx) }()
	defer func() {
		cancel()
		if err := <-done; err != nil {
			b.Error(err)
		}
	}()
	for deadline := time.Now().Add(time.Minute); !r.Active(); time.Sleep(5 * time.Millisecond) {
		if time.Now().After(deadline) {
			b.Fatal("the in-process relay never took the slot over")
		}
	}
	stored := collectStored(b, e, "AGENT_TURNS")
	recs := paceCommits(b, e.db.Pool, "relay in process", rate, d)
	at := stored.wait(b, recs[len(recs)-1].id)
	lat, missing := latencies(recs, rate, at.stored)
	if missing > 0 {
		b.Fatalf("in-process relay: %d events never arrived", missing)
	}
	return lat
}

// storedCollector records, for each event of a stream stored after it started, the JetStream
// store time and when this process received it, by outbox id.
type storedCollector struct {
	mu     sync.Mutex
	stored map[int64]time.Time
	recv   map[int64]time.Time
	cc     jetstream.ConsumeContext
}

func collectStored(tb testing.TB, e *benchEnv, stream string) *storedCollector {
	tb.Helper()
	c := &storedCollector{stored: map[int64]time.Time{}, recv: map[int64]time.Time{}}
	cons, err := e.js.OrderedConsumer(context.Background(), stream, jetstream.OrderedConsumerConfig{DeliverPolicy: jetstream.DeliverNewPolicy})
	if err != nil {
		tb.Fatal(err)
	}
	c.cc, err = cons.Consume(func(m jetstream.Msg) {
		now := time.Now()
		md, err := m.Metadata()
		if err != nil {
			return
		}
		id, _ := strconv.ParseInt(m.Headers().Get(wire.HeaderOutboxID), 10, 64)
		c.mu.Lock()
		c.stored[id], c.recv[id] = md.Timestamp, now
		c.mu.Unlock()
	})
	if err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(func() { c.cc.Stop(); <-c.cc.Closed() })
	return c
}

// wait waits up to 30 s for outbox id last, stops the consumer and returns what it collected.
func (c *storedCollector) wait(tb testing.TB, last int64) *storedCollector {
	tb.Helper()
	for deadline := time.Now().Add(30 * time.Second); ; time.Sleep(10 * time.Millisecond) {
		c.mu.Lock()
		_, ok := c.stored[last]
		c.mu.Unlock()
		if ok {
			break
		}
		if time.Now().After(deadline) {
			tb.Fatalf("event of outbox %d never arrived", last)
		}
	}
	time.Sleep(100 * time.Millisecond) // stragglers of other conversations
	c.cc.Stop()
	<-c.cc.Closed()
	c.mu.Lock()
	defer c.mu.Unlock()
	return &storedCollector{stored: maps.Clone(c.stored), recv: maps.Clone(c.recv)}
}

// histogram is a scraped Prometheus histogram: cumulative counts by upper bound.
type histogram struct {
	le    map[float64]float64
	count float64
}

func (h histogram) minus(o histogram) histogram {
	out := histogram{le: map[float64]float64{}, count: h.count - o.count}
	for k, v := range h.le {
		out.le[k] = v - o.le[k]
	}
	return out
}

// share returns the fraction of observations at or below bound (a bucket boundary).
func (h histogram) share(bound float64) float64 {
	if h.count == 0 {
		return 0
	}
	return h.le[bound] / h.count
}

// scrapeCommitToAck reads baton_relay_commit_to_ack_seconds from the relay's /metrics.
func scrapeCommitToAck(addr string) (histogram, error) {
	h := histogram{le: map[float64]float64{}}
	req, err := http.NewRequestWithContext(context.Background(), http.MethodGet, "http://"+addr+"/metrics", nil)
	if err != nil {
		return h, err
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return h, err
	}
	defer func() { _ = resp.Body.Close() }()
	sc := bufio.NewScanner(resp.Body)
	sc.Buffer(make([]byte, 64<<10), 1<<20)
	const name = "baton_relay_commit_to_ack_seconds"
	for sc.Scan() {
		line := sc.Text()
		switch {
		case strings.HasPrefix(line, name+`_bucket{le="`):
			rest := strings.TrimPrefix(line, name+`_bucket{le="`)
			bound, value, ok := strings.Cut(rest, `"} `)
			if !ok {
				continue
			}
			le, err1 := strconv.ParseFloat(bound, 64)
			v, err2 := strconv.ParseFloat(value, 64)
			if err1 == nil && err2 == nil {
				h.le[le] = v
			}
		case strings.HasPrefix(line, name+"_count "):
			h.count, _ = strconv.ParseFloat(strings.TrimPrefix(line, name+"_count "), 64)
		}
	}
	return h, sc.Err()
}

func freeTCPPort() (int, error) {
	l, err := (&net.ListenConfig{}).Listen(context.Background(), "tcp", "127.0.0.1:0")
	if err != nil {
		return 0, err
	}
	defer func() { _ = l.Close() }()
	return l.Addr().(*net.TCPAddr).Port, nil
}
