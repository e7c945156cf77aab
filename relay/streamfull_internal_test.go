package relay

import (
	"context"
	"errors"
	"strconv"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"
)

// workQueue creates a turns-like stream on work.>: work-queue retention, discard new, at most
// maxMsgs messages, taking fast-ingest batches.
func workQueue(t *testing.T, nc *nats.Conn, maxMsgs int64) (jetstream.JetStream, jetstream.Stream) {
	t.Helper()
	js, err := jetstream.New(nc)
	require.NoError(t, err)
	st, err := js.CreateStream(context.Background(), jetstream.StreamConfig{Name: "WORK", Subjects: []string{"work.>"},
		Storage: jetstream.FileStorage, Retention: jetstream.WorkQueuePolicy, Discard: jetstream.DiscardNew,
		MaxMsgs: maxMsgs, Duplicates: time.Minute, AllowBatchPublish: true})
	require.NoError(t, err)
	return js, st
}

// runPipeline runs a pipeline (in batches when batched) on nc over items, with metrics m, and
// returns the confirmed LSN and run's result.
func runPipeline(t *testing.T, nc *nats.Conn, m *metrics, batched bool, items ...item) (uint64, error) {
	t.Helper()
	cfg := Config{DatabaseURL: "x", NATS: nc, AckTimeout: 10 * time.Second, TurnsStream: "WORK", alwaysBatches: batched}
	return runPipelineWith(t, cfg, m, batched, items...)
}

// runPipelineWith runs a pipeline of cfg (filled here) over items, with metrics m, taking
// fast-ingest batches when batched, and returns the confirmed LSN and run's result.
func runPipelineWith(t *testing.T, cfg Config, m *metrics, batched bool, items ...item) (uint64, error) {
	t.Helper()
	var confirmed atomic.Uint64
	require.NoError(t, cfg.fill())
	p := newPipeline(&cfg, m, &confirmed, natsSender(cfg.NATS), batched)
	done := make(chan error, 1)
	go func() { done <- p.run(nil, nil, 0) }()
	if err := p.feed(context.Background(), items...); err == nil {
		p.closeInput()
	}
	select {
	case err := <-done:
		return confirmed.Load(), err
	case <-time.After(30 * time.Second):
		t.Fatal("the pipeline did not end")
		return 0, nil
	}
}

// ackAll acknowledges every message the stream holds with a worker-like consumer (explicit
// ack), so that the work queue deletes them, and returns their Nats-Msg-Ids.
func ackAll(t *testing.T, st jetstream.Stream) []string {
	t.Helper()
	ctx := context.Background()
	cons, err := st.CreateOrUpdateConsumer(ctx, jetstream.ConsumerConfig{Durable: "workers", AckPolicy: jetstream.AckExplicitPolicy})
	require.NoError(t, err)
	var ids []string
	for {
		info, err := st.Info(ctx)
		require.NoError(t, err)
		if info.State.Msgs == 0 {
			return ids
		}
		batch, err := cons.Fetch(100, jetstream.FetchMaxWait(time.Second))
		require.NoError(t, err)
		for m := range batch.Messages() {
			require.NoError(t, m.DoubleAck(ctx))
			ids = append(ids, m.Headers().Get(nats.MsgIdHdr))
		}
		require.NoError(t, batch.Error())
	}
}

// A full turns stream (discard new) refuses events; the pipeline fails with a streamFullError
// naming the stream and the first refused event, confirms nothing of its transaction, and a
// replay once the workers acknowledged stores the rest without doubling what was stored:
// Nats-Msg-Id deduplication still covers events a work queue deleted on their ack. The
// stream-full episode ends on the PubAck that stored the refused event, not on a duplicate's
// PubAck: a replay into a still full stream keeps it.
func TestFullWorkQueueRefusesThenTakesTheReplayOnce(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name    string
		batched bool
	}{{"event by event", false}, {"batches", true}} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			nc := connectNATS(t)
			_, st := workQueue(t, nc, 3)
			reg := prometheus.NewRegistry()
			m := newMetrics(reg)
			items := []item{begin()}
			for i := range 6 {
				items = append(items, batchEvent("work.c"+strconv.Itoa(i%2), i, 100))
			}
			items = append(items, commit(4242))

			lsn, err := runPipeline(t, nc, m, tc.batched, items...)
			var full *streamFullError
			require.ErrorAs(t, err, &full)
			require.Equal(t, "WORK", full.stream)
			require.Equal(t, laneTurns, full.lane)
			require.Equal(t, "e3", full.msgID, "the first event past max_msgs")
			require.EqualValues(t, 10077, full.err.ErrorCode)
			require.Zero(t, lsn, "nothing of the refused transaction is confirmed")
			require.Equal(t, []string{"e0", "e1", "e2"}, storedIDs(t, st))
			require.True(t, m.streamIsFull(laneTurns, "WORK", full.msgID))

			// Replayed into the still full stream: the stored events' PubAcks are duplicates'.
			lsn, err = runPipeline(t, nc, m, tc.batched, items...)
			require.ErrorAs(t, err, &full)
			require.Zero(t, lsn)
			require.True(t, m.full[laneTurns].Load(), "duplicates' PubAcks do not end the episode")
			require.InDelta(t, 1, streamFullGauge(t, reg, "WORK"), 0)

			// The workers acknowledge (the work queue deletes the events); the replay stores
			// the rest, and only the rest.
			require.Equal(t, []string{"e0", "e1", "e2"}, ackAll(t, st))
			lsn, err = runPipeline(t, nc, m, tc.batched, items...)
			require.NoError(t, err)
			require.EqualValues(t, 4242, lsn)
			require.False(t, m.full[laneTurns].Load(), "the stored refused event ends the episode")
			require.Zero(t, streamFullGauge(t, reg, "WORK"))
			require.Equal(t, []string{"e3", "e4", "e5"}, ackAll(t, st), "e0 to e2, acknowledged and deleted, are not stored again")
			info, err := st.Info(context.Background())
			require.NoError(t, err)
			require.EqualValues(t, 6, info.State.LastSeq, "six events stored in all")
		})
	}
}

// Only refusals for lack of room are stream-full errors: other API errors pass as they are.
func TestAsStreamFull(t *testing.T) {
	msg := nats.NewMsg("agent.turns.c")
	msg.Header.Set(nats.MsgIdHdr, "id1")
	for _, code := range streamFullCodes {
		err := asStreamFull(&jetstream.APIError{Code: 503, ErrorCode: code, Description: "maximum bytes exceeded"}, laneTurns, "T", msg)
		var full *streamFullError
		require.ErrorAs(t, err, &full, "code %d", code)
		require.Equal(t, "id1", full.msgID)
		require.ErrorContains(t, err, "stream T refused agent.turns.c for lack of room")
	}
	other := &jetstream.APIError{Code: 400, ErrorCode: 10054, Description: "message size exceeds maximum allowed"}
	var full *streamFullError
	require.False(t, errors.As(asStreamFull(other, laneTurns, "T", msg), &full))
	require.False(t, errors.As(asStreamFull(errNoResponders, laneTurns, "T", msg), &full))
	// 10077 for what is no limit: a store closed during a leader change, a message too large.
	for _, d := range []string{"store closed", "message too large"} {
		require.False(t, errors.As(asStreamFull(&jetstream.APIError{Code: 503, ErrorCode: 10077, Description: d}, laneTurns, "T", msg), &full), d)
	}
	require.True(t, errors.As(asStreamFull(&jetstream.APIError{Code: 503, ErrorCode: 10077, Description: "maximum messages exceeded"},
		laneTurns, "T", msg), &full))
}

// streamFullGauge returns baton_relay_stream_full{stream} from reg, or -1.
func streamFullGauge(t *testing.T, reg prometheus.Gatherer, stream string) float64 {
	t.Helper()
	mfs, err := reg.Gather()
	require.NoError(t, err)
	for _, mf := range mfs {
		if mf.GetName() != "baton_relay_stream_full" {
			continue
		}
		for _, m := range mf.GetMetric() {
			for _, l := range m.GetLabel() {
				if l.GetName() == "stream" && l.GetValue() == stream {
					return m.GetGauge().GetValue()
				}
			}
		}
	}
	return -1
}
