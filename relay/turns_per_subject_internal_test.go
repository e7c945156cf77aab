package relay

import (
	"context"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"github.com/stretchr/testify/require"
)

// A turns stream the start-up check accepts must never drop a turn event nobody acknowledged.
// An operator's max_msgs_per_subject (turn subjects are per conversation) with discard new but
// not discard-new-per-subject drops the conversation's older unfinished event, like the age
// limit compatible refuses.
func TestTurnsStreamWithPerSubjectLimitIsRefused(t *testing.T) {
	t.Parallel()
	nc := connectNATS(t)
	cfg := Config{DatabaseURL: "x", NATS: nc}
	require.NoError(t, cfg.fill())
	want := wantStreams(&cfg)[0]
	require.Equal(t, jetstream.WorkQueuePolicy, want.Retention)
	have := want
	have.MaxMsgsPerSubject = 1

	js, err := jetstream.New(nc)
	require.NoError(t, err)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	st, err := js.CreateStream(ctx, have)
	require.NoError(t, err)
	have = st.CachedInfo().Config
	accepted := compatible(have, want, nc.MaxPayload()) == nil

	subject := cfg.SubjectPrefix + ".turns.conv1" // one conversation, two unfinished turns
	for _, id := range []string{"1", "2"} {
		_, err := js.Publish(ctx, subject, []byte(id), jetstream.WithMsgID("turn-"+id))
		require.NoError(t, err)
	}
	info, err := st.Info(ctx)
	require.NoError(t, err)
	t.Logf("accepted by compatible: %v; stream holds %d of 2 unacknowledged turn events", accepted, info.State.Msgs)
	require.False(t, accepted && info.State.Msgs < 2, "compatible accepted a turns stream that dropped an unfinished turn event")
}
