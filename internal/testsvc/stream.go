package testsvc

import (
	"context"
	"errors"
	"testing"

	"github.com/nats-io/nats.go/jetstream"
	"github.com/stretchr/testify/require"

	"github.com/batonhq/baton/wire"
)

// StreamMsgs returns every message the stream stores, in sequence order, read one by one by
// sequence. It needs no consumer, so it works on any retention: an ordered consumer (ack
// none) is refused on a work-queue stream, and any consumer there would conflict with the
// workers' durable one. Meant for tests with up to a few thousand messages. The relay's fence
// messages (wire.FenceSubject), which the streams hold beside the events, are left out.
func StreamMsgs(ctx context.Context, t testing.TB, js jetstream.JetStream, stream string) []*jetstream.RawStreamMsg {
	t.Helper()
	st, err := js.Stream(ctx, stream)
	require.NoError(t, err, "look up stream %s", stream)
	info, err := st.Info(ctx)
	require.NoError(t, err, "read stream %s", stream)
	var out []*jetstream.RawStreamMsg
	if info.State.Msgs == 0 {
		return out
	}
	for seq := info.State.FirstSeq; seq <= info.State.LastSeq; seq++ {
		m, err := st.GetMsg(ctx, seq)
		if errors.Is(err, jetstream.ErrMsgNotFound) {
			continue // deleted: acked on a work queue, or removed
		}
		require.NoError(t, err, "read message %d of stream %s", seq, stream)
		if wire.IsFenceSubject(m.Subject) {
			continue
		}
		out = append(out, m)
	}
	return out
}
