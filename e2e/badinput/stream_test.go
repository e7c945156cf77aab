package badinput

import (
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/stretchr/testify/require"

	"github.com/batonhq/baton/consumer"
	"github.com/batonhq/baton/internal/testsvc"
	"github.com/batonhq/baton/producer"
)

// TestOperatorDeletesStreams deletes the turns stream, then the outcomes stream, while
// producers, the relay and the worker run. The relay's next publish finds no stream ("no
// responders"): it logs a WARN naming the subject, confirms nothing past it, and its next
// session creates the streams again and publishes from its confirmed position. The worker
// creates its durable consumer again on the new turns stream. Events deleted with a stream
// are gone from JetStream, not from Postgres: their rows are answered by the conversation's
// next claim or the workers' sweep. Nothing accepted is lost: every message is answered, every
// event of the new turns stream is acked, every row committed after a deletion has its event
// in the new stream, and every reply committed after it its outcome.
func TestOperatorDeletesStreams(t *testing.T) {
	t.Parallel()
	s := start(t, options{})
	ctx := ctxFor(t, 3*time.Minute)
	convs := []string{"del-a", "del-b", "del-c", "del-d"}
	for _, c := range convs {
		s.conversation(c)
	}
	// One producer per conversation sends until stopped.
	stop := make(chan struct{})
	var wg sync.WaitGroup
	for _, c := range convs {
		wg.Go(func() {
			for n := 0; ; n++ {
				select {
				case <-stop:
					return
				case <-time.After(10 * time.Millisecond):
				}
				_, err := s.prod.Send(ctx, s.db.Pool, producer.Message{ConversationID: c, ID: fmt.Sprintf("%s-%d", c, n), Content: "hi"})
				if err != nil {
					t.Errorf("send: %v", err)
					return
				}
			}
		})
	}
	defer func() {
		close(stop)
		wg.Wait()
	}()
	// answeredSince waits until 20 rows created after since are done.
	answeredSince := func(since time.Time) {
		t.Helper()
		require.Eventually(t, func() bool {
			var n int
			err := s.db.Pool.QueryRow(ctx, `SELECT count(*) FROM agent_outbox WHERE status = 'done' AND created_at > $1`, since).Scan(&n)
			return err == nil && n >= 20
		}, time.Minute, 20*time.Millisecond, "the system stopped answering")
	}
	answeredSince(time.Time{})

	require.NoError(t, s.js.DeleteStream(ctx, "AGENT_TURNS"))
	turnsGone := s.dbNow()
	s.relay.waitLog(t, `"msg":"relay session ended; reconnecting"`, time.Minute, "agent.turns.", "no responders")
	s.worker.waitLog(t, "creating the consumer again", time.Minute)
	answeredSince(turnsGone)

	require.NoError(t, s.js.DeleteStream(ctx, "AGENT_OUTCOMES"))
	outcomesGone := s.dbNow()
	s.relay.waitLog(t, `"msg":"relay session ended; reconnecting"`, time.Minute, "agent.outcomes.", "no responders")
	answeredSince(outcomesGone)
	close(stop)
	wg.Wait()
	stop = make(chan struct{})

	s.requireAnswered(time.Minute, outcomesGone)
	// Every row committed after the turns stream was deleted has its event in the new one.
	published := map[string]bool{}
	for _, m := range s.readStream("AGENT_TURNS") {
		published[m.Header.Get(nats.MsgIdHdr)] = true
	}
	for _, id := range testsvc.Query[int64](t, s.db, `SELECT id FROM agent_outbox WHERE created_at > $1`, turnsGone) {
		require.True(t, published[fmt.Sprintf("turn:%d", id)], "outbox %d committed after the deletion has no event", id)
	}
	// And the workers took and acked every event of the new stream.
	require.Eventually(t, func() bool {
		c, err := s.js.Consumer(ctx, "AGENT_TURNS", consumer.DefaultDurable)
		if err != nil {
			return false
		}
		info, err := c.Info(ctx)
		return err == nil && info.NumPending == 0 && info.NumAckPending == 0 && info.Delivered.Stream > 0
	}, time.Minute, 20*time.Millisecond, "the workers' durable consumer did not take the new stream's events")
	s.requireFlowing("deleted-streams")
	requireNoErrorLogs(t, s.relay, s.worker)
}
