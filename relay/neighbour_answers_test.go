package relay_test

import (
	"encoding/json"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/batonhq/baton/wire"
)

// Any role may emit a baton.answers message (pg_logical_emit_message is PUBLIC). One of 66 MB,
// {"outbox_ids":[1,1,…]}, is under the 64 MiB MaxChangeBytes default and so is received
// whole; parsed into an []int64 it grew about 15 times (seen: the relay's peak RSS went from
// 25 MB to 966–994 MB), past the 512Mi limit of relay-deployment.yaml: OOM-killed, restarted
// at the same LSN, killed again, for ever, while the slot retained WAL.
//
// The real binary, with its defaults, must keep its peak RSS under 256 MiB: half that limit
// (as TestInFlightIsBoundedInBytes), room for the message itself (which pgx receives whole,
// 66 MB) and the runtime's GC headroom over it, and a quarter of what the unbounded parse took.
// The reply's outcome carries the first wire.MaxBodyOutboxIDs ids and counts the rest, as for
// any reply that answers more rows than an event carries, and a row committed after it is
// relayed.
func TestHugeAnswersMessageDoesNotCostTheRelayItsMemory(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := ctxT(t, 4*time.Minute)
	createConversations(t, b.db.Pool, "c")
	p := b.startAdvProcess(t, b.cfg.DatabaseURL, b.nats.URL())
	require.Eventually(t, func() bool { return p.logged("msg=streaming") }, time.Minute, 20*time.Millisecond, "relay never streamed")
	const limit = 256 << 20

	const n = 33_000_000 // "1," n times and one more id: 66 MB of ids
	tx, err := b.db.Pool.Begin(ctx)
	require.NoError(t, err)
	_, err = tx.Exec(ctx, `SELECT pg_logical_emit_message(true, $1, '{"message_id":"r-huge","outbox_ids":[' || repeat('1,', $2) || '1]}')`,
		wire.AnswersPrefix, n)
	require.NoError(t, err)
	_, err = tx.Exec(ctx, `INSERT INTO messages (id, conversation_id, role, content) VALUES ('r-huge', 'c', 'assistant', 'done')`)
	require.NoError(t, err)
	require.NoError(t, tx.Commit(ctx))
	id, err := send(ctx, b.db.Pool, "c", "after")
	require.NoError(t, err)

	turns := b.waitStream(t, "AGENT_TURNS", 1, 3*time.Minute)
	assertExactlyOnceInOrder(t, turns, map[int64]string{id: "c"})
	hwm := peakRSS(t, p.cmd.Process.Pid)
	t.Logf("relay peak RSS %d MiB after a %d MB answers message", hwm>>20, (2*n+40)/1_000_000)

	outcomes := b.waitStream(t, "AGENT_OUTCOMES", 1, 30*time.Second)
	require.Len(t, outcomes, 1, "published once")
	var ev wire.OutcomeEvent
	require.NoError(t, json.Unmarshal(outcomes[0].data, &ev))
	require.Equal(t, "r-huge", ev.MessageID)
	require.Equal(t, "done", ev.Content)
	require.Len(t, ev.OutboxIDs, wire.MaxBodyOutboxIDs)
	require.Equal(t, n+1-wire.MaxBodyOutboxIDs, ev.OutboxIDsOmitted, "the ids left out are counted")
	h := outcomes[0].header
	require.Len(t, strings.Split(h.Get(wire.HeaderOutboxID), ","), wire.MaxHeaderOutboxIDs)
	require.Equal(t, strconv.Itoa(n+1-wire.MaxHeaderOutboxIDs), h.Get(wire.HeaderOutboxIDsOmitted))

	require.Less(t, hwm, int64(limit), "peak RSS %d MiB for one answers message", hwm>>20)
	requireSlotCaughtUp(t, b)
}
