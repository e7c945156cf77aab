package relay_test

import (
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"
)

// A first start whose backfill meets a full turns stream: the session ends, and the next one
// finds a slot without a finished backfill. The slot holds every reply committed since its
// consistent point, and the backfill reads only the outbox: a reply committed while the relay
// retries must still reach the outcomes stream, so the slot is kept, not created again.
// Failed when the relay dropped and recreated such a slot (r1 never published).
func TestFullStreamDuringFirstStartBackfillKeepsReplies(t *testing.T) {
	t.Parallel()
	b := setup(t)
	reg := prometheus.NewRegistry()
	b.cfg.Registerer = reg
	b.cfg.Streams.MaxMsgs = 3 // two events (or outcomes) and the slot's fence
	ctx := ctxT(t, 2*time.Minute)
	createConversations(t, b.db.Pool, "a")
	for _, id := range []string{"u1", "u2", "u3"} { // a backlog larger than the stream
		_, err := send(ctx, b.db.Pool, "a", id)
		require.NoError(t, err)
	}
	r := b.start(t)
	reconnects := func() float64 { return metricValue(t, reg, "baton_relay_reconnects_total", "", "") }
	require.Eventually(t, func() bool {
		return metricValue(t, reg, "baton_relay_stream_full", "stream", "AGENT_TURNS") == 1
	}, time.Minute, 10*time.Millisecond, "the backfill never met the full stream")

	// A worker answers the first request while the relay retries its first start.
	_, err := b.db.Pool.Exec(ctx, `INSERT INTO messages (id, conversation_id, role, content)
		VALUES ('r1', 'a', 'assistant', 'answer')`)
	require.NoError(t, err)
	after := reconnects()
	require.Eventually(t, func() bool { return reconnects() >= after+2 },
		time.Minute, 10*time.Millisecond, "the relay did not retry")

	// The workers drain the turns stream; the backfill then completes.
	s, err := b.js.Stream(ctx, "AGENT_TURNS")
	require.NoError(t, err)
	cons, err := s.CreateOrUpdateConsumer(ctx, jetstream.ConsumerConfig{Durable: "workers", FilterSubject: "agent.turns.>",
		AckPolicy: jetstream.AckExplicitPolicy, DeliverPolicy: jetstream.DeliverAllPolicy})
	require.NoError(t, err)
	deadline := time.Now().Add(time.Minute)
	for !r.Active() && time.Now().Before(deadline) {
		batch, err := cons.Fetch(10, jetstream.FetchMaxWait(200*time.Millisecond))
		require.NoError(t, err)
		for m := range batch.Messages() {
			require.NoError(t, m.DoubleAck(ctx))
		}
	}
	require.True(t, r.Active(), "the relay never finished its first start")

	// The reply must be published.
	_, err = b.db.Pool.Exec(ctx, `INSERT INTO messages (id, conversation_id, role, content)
		VALUES ('r2', 'a', 'assistant', 'later answer')`)
	require.NoError(t, err)
	has := func(outcomes []got, msgID string) bool {
		for _, o := range outcomes {
			if strings.Contains(string(o.data), `"message_id":"`+msgID+`"`) {
				return true
			}
		}
		return false
	}
	var outcomes []got
	require.Eventually(t, func() bool {
		outcomes = b.readStream(t, "AGENT_OUTCOMES")
		return has(outcomes, "r2")
	}, 30*time.Second, 50*time.Millisecond, "the later reply never arrived")
	t.Logf("outcomes stored: %d", len(outcomes))
	require.True(t, has(outcomes, "r1"), "the reply r1, committed while the first start retried, never reached the outcomes stream")
}
