package bench

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"strconv"
	"sync/atomic"
	"time"

	"github.com/jackc/pglogrepl"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/batonhq/baton/natsconn"
	"github.com/batonhq/baton/wire"
)

// PlainWindow is how many events the plain relay and the publish ceiling keep in flight
// without a PubAck: what nats.go's async publishing does best on this kind of machine.
const PlainWindow = 4096

// PlainRelayConfig configures RunPlainRelay.
type PlainRelayConfig struct {
	// DatabaseURL is the database whose slot is read. Required.
	DatabaseURL string
	// NATS is the NATS server to publish to (its URL, login and TLS settings). Required.
	NATS natsconn.Settings
	// Slot is the pgoutput slot to stream, which must exist. Required.
	Slot string
	// SubjectPrefix is the subject prefix; the stream is wire.StreamName(prefix, turns),
	// created when missing. Required.
	SubjectPrefix string
	// Window is how many events may wait for their PubAck. Default PlainWindow.
	Window int
	// Replicas is the replica count of the stream it creates. Default 1.
	Replicas int
	// Logger receives "streaming" once replication started. Default: discard.
	Logger *slog.Logger
}

// RunPlainRelay runs the plain relay until ctx ends or a publish fails: the simplest correct
// pipelined relay, the baseline Baton's relay is compared with. For every outbox insert it
// reads it builds the turn event (the relay's subject, headers and body) and publishes it with
// PublishMsgAsync, up to Window in flight, in the order read (no per-conversation ordering). It
// confirms a transaction's end LSN once every event published up to it has its PubAck: a
// single connection to a single stream gets its PubAcks in publication order, so a count of
// PubAcks is enough. `baton bench relay` runs it as a process of its own, `baton bench
// plain-relay`, so that its CPU time and memory are measured the way the relay's are.
func RunPlainRelay(ctx context.Context, cfg PlainRelayConfig) error {
	if cfg.Window == 0 {
		cfg.Window = PlainWindow
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.New(slog.DiscardHandler)
	}
	if cfg.DatabaseURL == "" || cfg.NATS.URL == "" || cfg.Slot == "" || cfg.SubjectPrefix == "" {
		return errors.New("plain relay: the database URL, NATS URL, slot and subject prefix are required")
	}
	nc, err := cfg.NATS.Connect(nats.Name("baton-bench-plain-relay"))
	if err != nil {
		return fmt.Errorf("plain relay: %w", err)
	}
	defer nc.Close()
	pr, err := newPlainRelay(ctx, nc, cfg.SubjectPrefix, cfg.Window, cfg.Replicas)
	if err != nil {
		return err
	}
	defer pr.js.CleanupPublisher()
	conn, err := replConn(ctx, cfg.DatabaseURL, cfg.Slot, 0)
	if err != nil {
		return fmt.Errorf("plain relay: %w", err)
	}
	defer func() { _ = conn.Close(context.WithoutCancel(ctx)) }()
	cfg.Logger.Info("streaming", "slot", cfg.Slot)
	r := &bareReader{conn: conn, onInsert: pr.publish, onCommit: pr.commit, confirmed: pr.confirmed}
	if err := r.run(ctx, func() bool { return pr.failed.Load() > 0 }); err != nil {
		return fmt.Errorf("plain relay: %w", err)
	}
	if n := pr.failed.Load(); n > 0 {
		return fmt.Errorf("plain relay: %d publishes failed", n)
	}
	// Stopping: wait a little for what is in flight, and confirm it.
	t := time.NewTimer(10 * time.Second)
	defer t.Stop()
	select {
	case <-pr.js.PublishAsyncComplete():
	case <-t.C:
	}
	sctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 5*time.Second)
	defer cancel()
	return r.sendStatus(sctx)
}

// plainRelay publishes turn events of outbox inserts and keeps what may be confirmed.
type plainRelay struct {
	js     jetstream.JetStream
	prefix string
	cols   map[*pglogrepl.RelationMessage][6]int
	failed atomic.Int64

	published int64         // events published; the reader's own
	acked     atomic.Int64  // PubAcks received
	commits   []commitMark  // commits not yet confirmable, oldest first; the reader's own
	confirm   pglogrepl.LSN // the highest confirmable commit end; the reader's own
}

// commitMark is a transaction's end LSN and how many events were published up to it.
type commitMark struct {
	lsn       pglogrepl.LSN
	published int64
}

// newPlainRelay creates the turns stream of prefix (as the relay creates its own: file
// storage, a 2 minute duplicate window, replicas replicas) and a publisher with window in
// flight.
func newPlainRelay(ctx context.Context, nc *nats.Conn, prefix string, window, replicas int) (*plainRelay, error) {
	pr := &plainRelay{prefix: prefix, cols: map[*pglogrepl.RelationMessage][6]int{}}
	if err := createTurnStream(ctx, nc, prefix, replicas); err != nil {
		return nil, err
	}
	js, err := jetstream.New(nc, jetstream.WithPublishAsyncMaxPending(window),
		jetstream.WithPublishAsyncErrHandler(func(jetstream.JetStream, *nats.Msg, error) { pr.failed.Add(1) }),
		jetstream.WithPublishAsyncAckHandler(func(jetstream.JetStream, *nats.Msg, *jetstream.PubAck) { pr.acked.Add(1) }))
	if err != nil {
		return nil, fmt.Errorf("plain relay: %w", err)
	}
	pr.js = js
	return pr, nil
}

// createTurnStream creates the turns stream of prefix as the relay would, when missing.
func createTurnStream(ctx context.Context, nc *nats.Conn, prefix string, replicas int) error {
	js, err := jetstream.New(nc)
	if err != nil {
		return fmt.Errorf("jetstream: %w", err)
	}
	name := wire.StreamName(prefix, wire.KindTurns)
	if _, err := js.CreateOrUpdateStream(ctx, jetstream.StreamConfig{
		Name: name, Subjects: []string{wire.StreamFilter(prefix, wire.KindTurns)},
		Storage: jetstream.FileStorage, Retention: jetstream.LimitsPolicy, Discard: jetstream.DiscardOld,
		Duplicates: 2 * time.Minute, MaxMsgs: -1, MaxBytes: -1, Replicas: max(1, replicas),
	}); err != nil {
		return fmt.Errorf("create stream %s: %w", name, err)
	}
	return nil
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
			if idx[i] < 0 {
				return fmt.Errorf("agent_outbox has no column %s", name)
			}
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
	if m.Data, err = json.Marshal(ev); err != nil {
		return fmt.Errorf("turn event: %w", err)
	}
	m.Header.Set(nats.MsgIdHdr, wire.TurnMsgID(ev.OutboxID))
	m.Header.Set(wire.HeaderOutboxID, strconv.FormatInt(ev.OutboxID, 10))
	m.Header.Set(wire.HeaderConversationID, ev.ConversationID)
	m.Header.Set(wire.HeaderMessageID, ev.MessageID)
	if _, err := pr.js.PublishMsgAsync(m, jetstream.WithStallWait(time.Minute)); err != nil {
		return fmt.Errorf("publish outbox %d: %w", ev.OutboxID, err)
	}
	pr.published++
	return nil
}

// commit notes a transaction's end: confirmable once its events have their PubAcks.
func (pr *plainRelay) commit(lsn pglogrepl.LSN) {
	pr.commits = append(pr.commits, commitMark{lsn: lsn, published: pr.published})
}

// confirmed returns the highest transaction end whose events all have their PubAck, or
// idleEnd (the server's WAL end, seen outside a transaction) once every event has its PubAck:
// PG 15 sends nothing for transactions that touch no published table, so a quiet outbox would
// otherwise hold WAL.
func (pr *plainRelay) confirmed(idleEnd pglogrepl.LSN) pglogrepl.LSN {
	acked := pr.acked.Load()
	i := 0
	for i < len(pr.commits) && pr.commits[i].published <= acked {
		pr.confirm = pr.commits[i].lsn
		i++
	}
	pr.commits = slices.Delete(pr.commits, 0, i)
	if len(pr.commits) == 0 && acked == pr.published {
		pr.confirm = max(pr.confirm, idleEnd)
	}
	return pr.confirm
}
