package relay

import (
	"context"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/stretchr/testify/require"
)

// batchStream creates a file stream on subjects batch.> that takes fast-ingest batches, with
// messages of at most maxMsgSize bytes.
func batchStream(t *testing.T, nc *nats.Conn, maxMsgSize int32) jetstream.Stream {
	t.Helper()
	js, err := jetstream.New(nc)
	require.NoError(t, err)
	st, err := js.CreateStream(context.Background(), jetstream.StreamConfig{Name: "BATCH", Subjects: []string{"batch.>"},
		Storage: jetstream.FileStorage, MaxMsgSize: maxMsgSize, AllowBatchPublish: true, Duplicates: time.Minute})
	require.NoError(t, err)
	require.True(t, st.CachedInfo().Config.AllowBatchPublish, "the test server takes fast-ingest batches")
	return st
}

// runBatched runs a batched pipeline on nc over items and returns the confirmed LSN and run's
// result.
func runBatched(t *testing.T, nc *nats.Conn, items ...item) (uint64, error) {
	t.Helper()
	cfg := Config{DatabaseURL: "x", NATS: nc, AckTimeout: 10 * time.Second, alwaysBatches: true}
	return runPipelineWith(t, cfg, newMetrics(nil), true, items...)
}

func batchEvent(subj string, i int, size int) item {
	m := nats.NewMsg(subj)
	m.Header.Set(nats.MsgIdHdr, "e"+strconv.Itoa(i))
	m.Data = []byte(strings.Repeat("x", size))
	return item{kind: itemEvent, msg: m}
}

func storedIDs(t *testing.T, st jetstream.Stream) []string {
	t.Helper()
	info, err := st.Info(context.Background())
	require.NoError(t, err)
	var ids []string
	for seq := uint64(1); seq <= info.State.LastSeq; seq++ {
		m, err := st.GetMsg(context.Background(), seq)
		require.NoError(t, err)
		ids = append(ids, m.Header.Get(nats.MsgIdHdr))
	}
	return ids
}

// One conversation's events go out in a batch without waiting for each other's PubAck; the
// pipeline confirms the transaction once the batch is acknowledged, which happens when the
// lane goes idle and is committed.
func TestBatchedPipelineStoresInOrderAndConfirms(t *testing.T) {
	t.Parallel()
	nc := connectNATS(t)
	st := batchStream(t, nc, -1)
	items := []item{begin()}
	var want []string
	for i := range 2000 {
		items = append(items, batchEvent("batch.hot", i, 100))
		want = append(want, "e"+strconv.Itoa(i))
	}
	items = append(items, commit(4242))
	lsn, err := runBatched(t, nc, items...)
	require.NoError(t, err)
	require.EqualValues(t, 4242, lsn)
	require.Equal(t, want, storedIDs(t, st))

	// A replay (the next session after a crash) is deduplicated, batch or not.
	lsn, err = runBatched(t, nc, items...)
	require.NoError(t, err)
	require.EqualValues(t, 4242, lsn)
	require.Len(t, storedIDs(t, st), len(want))
}

// A batch stops at its first event the server refuses: no later event is stored, whatever
// its subject, so a conversation's order survives the failure (the session replays from the
// confirmed LSN).
func TestBatchStoresNothingAfterARefusedEvent(t *testing.T) {
	t.Parallel()
	nc := connectNATS(t)
	st := batchStream(t, nc, 1000)
	items := []item{begin()}
	for i := range 10 {
		size := 100
		if i == 5 {
			size = 5000 // over the stream's max_msg_size
		}
		items = append(items, batchEvent("batch.c"+strconv.Itoa(i%2), i, size))
	}
	items = append(items, commit(77))
	lsn, err := runBatched(t, nc, items...)
	require.ErrorContains(t, err, "message size exceeds maximum")
	require.Zero(t, lsn, "nothing confirmed")
	require.Equal(t, []string{"e0", "e1", "e2", "e3", "e4"}, storedIDs(t, st))
}

// A lane is due for its commit batchIdleCommit after its last send, or batchMaxWait after its
// oldest unacknowledged event was sent if that comes first: a lane that keeps sending slower
// than its flow still has its events acknowledged.
func TestLaneCommitDue(t *testing.T) {
	t0 := time.Unix(1000, 0)
	l := &lane{state: laneOpen, lastSend: t0}
	require.Equal(t, t0.Add(batchIdleCommit), l.commitDue(), "nothing unacknowledged: idle only")

	old := &pendingEvent{}
	old.sentAt.Store(t0.Add(-batchMaxWait + time.Millisecond).UnixNano())
	l.events = []*pendingEvent{old}
	require.Equal(t, t0.Add(time.Millisecond), l.commitDue(), "the oldest event has waited almost batchMaxWait")

	old.sentAt.Store(t0.UnixNano())
	require.Equal(t, t0.Add(batchIdleCommit), l.commitDue())
}
