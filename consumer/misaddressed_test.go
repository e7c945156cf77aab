package consumer_test

import (
	"context"
	"encoding/json"
	"strconv"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"

	"github.com/batonhq/baton/consumer"
	"github.com/batonhq/baton/internal/testsvc"
	"github.com/batonhq/baton/wire"
)

// A turn event whose subject names another conversation than its body (here conversation b's
// event, replayed by someone with publish rights onto conversation a's subject) is set aside:
// terminated, counted as baton_worker_events_total{result="misaddressed"}, never claimed. Only
// the event on b's own subject answers b's message.
func TestEventOnAnotherConversationsSubjectIsTerminated(t *testing.T) {
	t.Parallel()
	b := setup(t, jetStream)
	ctx := context.Background()
	b.conversation("a")
	b.conversation("b")
	id := b.send("b", "m1", "hi")

	js, err := jetstream.New(b.nc)
	require.NoError(t, err)
	subject, err := wire.TurnSubject(wire.DefaultSubjectPrefix, "a")
	require.NoError(t, err)
	body, err := json.Marshal(wire.TurnEvent{OutboxID: id, ConversationID: "b", MessageID: "m1", Status: "pending",
		CreatedAt: time.Now().UTC()})
	require.NoError(t, err)
	m := nats.NewMsg(subject)
	m.Header.Set(wire.HeaderOutboxID, strconv.FormatInt(id, 10))
	m.Header.Set(wire.HeaderConversationID, wire.HeaderID("b"))
	m.Header.Set(wire.HeaderMessageID, wire.HeaderID("m1"))
	m.Data = body
	ack, err := js.PublishMsg(ctx, m)
	require.NoError(t, err)

	// JetStream's advisory says which stream message a consumer terminated.
	terminated := make(chan uint64, 16)
	sub, err := b.nc.Subscribe("$JS.EVENT.ADVISORY.CONSUMER.MSG_TERMINATED."+wire.StreamName(wire.DefaultSubjectPrefix, wire.KindTurns)+"."+consumer.DefaultDurable,
		func(msg *nats.Msg) {
			var adv struct {
				StreamSeq uint64 `json:"stream_seq"`
			}
			if json.Unmarshal(msg.Data, &adv) == nil {
				terminated <- adv.StreamSeq
			}
		})
	require.NoError(t, err)
	t.Cleanup(func() { _ = sub.Unsubscribe() })
	require.NoError(t, b.nc.Flush())

	reg := prometheus.NewRegistry()
	b.worker(consumer.Config{Registerer: reg, SweepInterval: time.Hour}) // only events wake rows
	require.Eventually(t, func() bool { return counter(t, reg, "baton_worker_events_total", "misaddressed") == 1 },
		30*time.Second, 10*time.Millisecond, "the event on conversation a's subject was not set aside as misaddressed")
	select {
	case seq := <-terminated:
		require.Equal(t, ack.Sequence, seq, "another stream message was terminated")
	case <-time.After(30 * time.Second):
		t.Fatal("JetStream reported no terminated message")
	}
	b.waitTerminal(time.Minute)
	require.Equal(t, []string{"b echo: hi"},
		testsvc.Query[string](t, b.db, `SELECT conversation_id || ' ' || content FROM messages WHERE role <> 'user'`))
	require.Zero(t, counter(t, reg, "baton_worker_events_total", "terminated"), "counted as malformed")
}
