package bench

import (
	"context"
	"encoding/json"
	"fmt"
	"strconv"
	"sync/atomic"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/batonhq/baton/wire"
)

// turnLikeMsg builds a message shaped like the relay's turn event of outbox row id: same
// subject form, the same headers (Nats-Msg-Id among them), a JSON body of the same size.
func turnLikeMsg(prefix string, id int64, conv string, at time.Time) (*nats.Msg, error) {
	subj, err := wire.TurnSubject(prefix, conv)
	if err != nil {
		return nil, err
	}
	msgID := fmt.Sprintf("w0-%d", id)
	body, err := json.Marshal(wire.TurnEvent{OutboxID: id, ConversationID: conv, MessageID: msgID,
		Status: "pending", CreatedAt: at})
	if err != nil {
		return nil, fmt.Errorf("turn event: %w", err)
	}
	m := nats.NewMsg(subj)
	m.Data = body
	m.Header.Set(nats.MsgIdHdr, wire.TurnMsgID(id))
	m.Header.Set(wire.HeaderOutboxID, strconv.FormatInt(id, 10))
	m.Header.Set(wire.HeaderConversationID, conv)
	m.Header.Set(wire.HeaderMessageID, msgID)
	return m, nil
}

// publishCeiling publishes n turn-like events over convs conversations with PublishMsgAsync,
// at most PlainWindow in flight, into a fresh turns stream of prefix, and returns the time
// until every PubAck arrived.
func publishCeiling(ctx context.Context, e *env, prefix string, n, convs int) (time.Duration, error) {
	ctx, cancel := context.WithTimeout(ctx, runTimeout(n))
	defer cancel()
	if err := createTurnStream(ctx, e.nc, prefix, 1); err != nil { // the ceiling: one replica
		return 0, err
	}
	var failed atomic.Int64
	js, err := jetstream.New(e.nc, jetstream.WithPublishAsyncMaxPending(PlainWindow),
		jetstream.WithPublishAsyncErrHandler(func(jetstream.JetStream, *nats.Msg, error) { failed.Add(1) }))
	if err != nil {
		return 0, fmt.Errorf("jetstream: %w", err)
	}
	defer js.CleanupPublisher()
	now := time.Now().UTC()
	start := time.Now()
	for i := range n {
		m, err := turnLikeMsg(prefix, int64(i+1), conversationID(i, convs), now)
		if err != nil {
			return 0, err
		}
		if _, err := js.PublishMsgAsync(m, jetstream.WithStallWait(time.Minute)); err != nil {
			return 0, fmt.Errorf("publish: %w", err)
		}
	}
	select {
	case <-js.PublishAsyncComplete():
	case <-ctx.Done():
		return 0, fmt.Errorf("publish ceiling: PubAcks missing after %v", runTimeout(n))
	}
	took := time.Since(start)
	if f := failed.Load(); f > 0 {
		return 0, fmt.Errorf("publish ceiling: %d publishes failed", f)
	}
	stream := wire.StreamName(prefix, wire.KindTurns)
	got, err := e.streamMsgs(ctx, stream)
	if err != nil {
		return 0, fmt.Errorf("publish ceiling: %w", err)
	}
	if got != n {
		return 0, fmt.Errorf("publish ceiling: stream %s holds %d of %d", stream, got, n)
	}
	return took, nil
}
