package bench

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"time"

	"github.com/jackc/pglogrepl"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgproto3"
)

// Bulk reading: a bulk client reads the socket into a buffer of bulkBuffer bytes and, after a
// read that brought less than bulkLittle, pauses before the next (see pause). A
// client that keeps up makes the walsender send each message on its own and wake the client
// for it (FIELD-NOTES: the walsender, not decoding, is the read bottleneck); one that lets
// the socket fill a little lets the walsender send in bulk. Measured here (200k 1-row
// transactions, 2 cores, quiet, two rounds each): eager 40k rows/s (448 B per read), a pause of
// 50 µs 38-40k, 100 µs 48-54k, 200 µs 83-88k (6.5 KB per read), 500 µs 47k; spinning 20 µs
// per read instead 43-45k. The pause must be precise: time.Sleep wakes after about a
// millisecond here whatever is asked below that, which is why an earlier version of this
// client (time.Sleep(150µs) and 2 µs of spinning per message) read no faster than the eager one.
// The best pause depends on how fast the walsender produces (on a 1M-row backlog 200 µs read
// only 61k rows/s), so the bench runs a client per pause of bulkPauses and the fastest counts.
const (
	bulkBuffer = 1 << 20
	bulkLittle = 16 << 10
)

// bulkPauses are the pauses of the bulk-reading clients a catch-up runs.
var bulkPauses = []time.Duration{100 * time.Microsecond, 200 * time.Microsecond, 400 * time.Microsecond}

// pausingReader is a socket reader that pauses after each read that returned little.
type pausingReader struct {
	r     io.Reader
	pause time.Duration
}

func (p pausingReader) Read(b []byte) (int, error) {
	n, err := p.r.Read(b)
	if err == nil && n < bulkLittle {
		pause(p.pause)
	}
	return n, err
}

// replConn opens a replication connection and starts streaming slot from its confirmed
// position with the relay's plugin arguments. A bulkPause above 0 makes it read the socket in
// bulk (see pausingReader).
func replConn(ctx context.Context, url, slot string, bulkPause time.Duration) (*pgconn.PgConn, error) {
	cfg, err := pgconn.ParseConfig(url)
	if err != nil {
		return nil, fmt.Errorf("replication connection: %w", err)
	}
	cfg.RuntimeParams["replication"] = "database"
	cfg.RuntimeParams["application_name"] = "baton-bench"
	if bulkPause > 0 {
		cfg.BuildFrontend = func(r io.Reader, w io.Writer) *pgproto3.Frontend {
			return pgproto3.NewFrontend(bufio.NewReaderSize(pausingReader{r: r, pause: bulkPause}, bulkBuffer), w)
		}
	}
	conn, err := pgconn.ConnectConfig(ctx, cfg)
	if err != nil {
		return nil, fmt.Errorf("replication connection: %w", err)
	}
	err = pglogrepl.StartReplication(ctx, conn, slot, 0, pglogrepl.StartReplicationOptions{
		Mode:       pglogrepl.LogicalReplication,
		PluginArgs: []string{"proto_version '1'", "publication_names '" + publication + "'", "messages 'true'"},
	})
	if err != nil {
		_ = conn.Close(context.WithoutCancel(ctx))
		return nil, fmt.Errorf("start replication on slot %s: %w", slot, err)
	}
	return conn, nil
}

// bareReader reads a pgoutput stream and parses every message, nothing more. onInsert, when
// set, is called for each insert with the relation it belongs to, and onCommit with each
// transaction's end position.
type bareReader struct {
	conn     *pgconn.PgConn
	received pglogrepl.LSN // the last transaction's end
	idleEnd  pglogrepl.LSN // the server's WAL end in the last keepalive outside a transaction
	inTx     bool
	rels     map[uint32]*pglogrepl.RelationMessage
	inserts  int
	onInsert func(rel *pglogrepl.RelationMessage, ins *pglogrepl.InsertMessage) error
	onCommit func(end pglogrepl.LSN)
	// confirmed, when set, returns the position to confirm given idleEnd (which the caller
	// may confirm once everything it received is handled); default: all that was received.
	confirmed func(idleEnd pglogrepl.LSN) pglogrepl.LSN
}

func (r *bareReader) sendStatus(ctx context.Context) error {
	lsn := max(r.received, r.idleEnd)
	if r.confirmed != nil {
		lsn = r.confirmed(r.idleEnd)
	}
	err := pglogrepl.SendStandbyStatusUpdate(ctx, r.conn, pglogrepl.StandbyStatusUpdate{
		WALWritePosition: lsn, WALFlushPosition: lsn, WALApplyPosition: lsn, ClientTime: time.Now(),
	})
	if err != nil {
		return fmt.Errorf("standby status: %w", err)
	}
	return nil
}

// run reads until stop returns true (checked after each message) or ctx ends, when it returns
// nil. A standby status goes out every second, on one deadline context per second as the
// relay does.
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
			if err := r.sendStatus(ctx); err != nil {
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
			return fmt.Errorf("receive: %w", err)
		}
		if err := r.handle(ctx, raw); err != nil {
			return err
		}
	}
	return nil
}

func (r *bareReader) handle(ctx context.Context, raw pgproto3.BackendMessage) error {
	cd, ok := raw.(*pgproto3.CopyData)
	if !ok {
		if er, ok := raw.(*pgproto3.ErrorResponse); ok {
			return pgconn.ErrorResponseToPgError(er)
		}
		return nil
	}
	if len(cd.Data) == 0 {
		return nil
	}
	switch cd.Data[0] {
	case pglogrepl.PrimaryKeepaliveMessageByteID:
		ka, err := pglogrepl.ParsePrimaryKeepaliveMessage(cd.Data[1:])
		if err != nil {
			return fmt.Errorf("keepalive: %w", err)
		}
		if !r.inTx {
			r.idleEnd = max(r.idleEnd, pglogrepl.LSN(ka.ServerWALEnd))
		}
		if ka.ReplyRequested {
			return r.sendStatus(ctx)
		}
	case pglogrepl.XLogDataByteID:
		xld, err := pglogrepl.ParseXLogData(cd.Data[1:])
		if err != nil {
			return fmt.Errorf("XLogData: %w", err)
		}
		msg, err := pglogrepl.Parse(xld.WALData)
		if err != nil {
			return fmt.Errorf("pgoutput at %s: %w", xld.WALStart, err)
		}
		switch m := msg.(type) {
		case *pglogrepl.RelationMessage:
			r.rels[m.RelationID] = m
		case *pglogrepl.InsertMessage:
			r.inserts++
			if r.onInsert != nil {
				return r.onInsert(r.rels[m.RelationID], m)
			}
		case *pglogrepl.BeginMessage:
			r.inTx = true
		case *pglogrepl.CommitMessage:
			r.inTx = false
			r.received = m.TransactionEndLSN
			if r.onCommit != nil {
				r.onCommit(m.TransactionEndLSN)
			}
		}
	}
	return nil
}

// decodeRun is one decode-ceiling measurement.
type decodeRun struct {
	took   time.Duration // START_REPLICATION's answer → the last insert parsed
	walCPU float64       // CPU seconds of the walsender meanwhile (NaN when not measurable)
}

// decode streams slot until it has parsed want inserts (eagerly, or reading the socket in
// bulk) and returns the time from START_REPLICATION's answer to the last of them.
func decode(ctx context.Context, e *env, slot string, want int, bulkPause time.Duration) (decodeRun, error) {
	ctx, cancel := context.WithTimeout(ctx, runTimeout(want))
	defer cancel()
	conn, err := replConn(ctx, e.dbURL, slot, bulkPause)
	if err != nil {
		return decodeRun{}, err
	}
	defer func() { _ = conn.Close(context.WithoutCancel(ctx)) }()
	walPID, err := e.walsender(ctx, slot)
	if err != nil {
		return decodeRun{}, err
	}
	wal0 := cpuSeconds(walPID)
	start := time.Now()
	r := &bareReader{conn: conn}
	if err := r.run(ctx, func() bool { return r.inserts >= want }); err != nil {
		return decodeRun{}, err
	}
	x := decodeRun{took: time.Since(start), walCPU: cpuSeconds(walPID) - wal0}
	if r.inserts < want {
		return decodeRun{}, fmt.Errorf("decode: %d of %d inserts within %v", r.inserts, want, runTimeout(want))
	}
	if err := r.sendStatus(ctx); err != nil && !errors.Is(err, context.Canceled) {
		return decodeRun{}, err
	}
	return x, nil
}
