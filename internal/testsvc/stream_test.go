package testsvc

import (
	"context"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/stretchr/testify/require"
)

func TestStreamMsgsReadsAWorkQueue(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	n := StartNATS(t)
	nc, err := nats.Connect(n.URL())
	require.NoError(t, err)
	defer nc.Close()
	js, err := jetstream.New(nc)
	require.NoError(t, err)
	_, err = js.CreateStream(ctx, jetstream.StreamConfig{Name: "WQ", Subjects: []string{"wq.>"}, Retention: jetstream.WorkQueuePolicy})
	require.NoError(t, err)
	for _, s := range []string{"wq.a", "wq.b", "wq.c"} {
		_, err := js.Publish(ctx, s, []byte(s))
		require.NoError(t, err)
	}
	st, err := js.Stream(ctx, "WQ")
	require.NoError(t, err)
	require.NoError(t, st.DeleteMsg(ctx, 2))
	var got []string
	for _, m := range StreamMsgs(ctx, t, js, "WQ") {
		got = append(got, m.Subject)
	}
	require.Equal(t, []string{"wq.a", "wq.c"}, got)
}
