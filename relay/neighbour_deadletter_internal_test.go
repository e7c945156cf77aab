package relay

import (
	"testing"

	"github.com/nats-io/nats.go"
	"github.com/stretchr/testify/require"

	"github.com/batonhq/baton/wire"
)

// shardDeadLetterIDs decodes, as shard k of n, one COPY's rows that shard's publication sends
// it (all at position 0x3000, two of them unpublishable) and then a malformed answers message
// at 0x3100, and returns the Nats-Msg-Ids of the dead-letter records.
func shardDeadLetterIDs(t *testing.T, k, n int, rows ...string) []string {
	t.Helper()
	d := decoderWithRelations(t, 1<<20).inShard(k, n)
	_, err := d.decodeAt(0x2FF0, beginMsg())
	require.NoError(t, err)
	var ids []string
	for _, created := range rows {
		it, err := d.decodeAt(0x3000, append([]byte{'I'}, insertBody(16384, textCols("7", "c", "m", "pending", "0", created)...)...))
		require.NoError(t, err)
		if it.deadLetter != "" {
			ids = append(ids, it.msg.Header.Get(nats.MsgIdHdr))
		}
	}
	it, err := d.decodeAt(0x3100, logicalMsg(true, wire.AnswersPrefix, "x"))
	require.NoError(t, err)
	require.Equal(t, wire.DeadLetterAnswers, it.deadLetter)
	return append(ids, it.msg.Header.Get(nats.MsgIdHdr))
}

// A sharded relay's dead-letter ids name its shard: the same changes decoded again by the same
// shard (a replay of its slot, by a restarted relay or its standby) give the same ids, which
// JetStream deduplicates; another shard's changes at the same positions, or the same shard
// number of another shard count, give other ids. An unsharded relay keeps
// wire.DeadLetterNthMsgID's ids.
func TestShardDeadLetterIDsAreTheShardsOwn(t *testing.T) {
	const ok, far = "2026-11-30 01:02:03+00", "10000-01-01 00:00:00+00"
	first := shardDeadLetterIDs(t, 1, 2, ok, far, far)
	require.Equal(t, []string{"deadletter:shard:1/2:0/3000:1", "deadletter:shard:1/2:0/3000:2", "deadletter:shard:1/2:0/3100"}, first)
	require.Equal(t, first, shardDeadLetterIDs(t, 1, 2, ok, far, far), "a replay by the same shard keeps the ids")

	other := shardDeadLetterIDs(t, 0, 2, far, ok, far)
	require.Equal(t, []string{"deadletter:shard:0/2:0/3000", "deadletter:shard:0/2:0/3000:2", "deadletter:shard:0/2:0/3100"}, other)
	require.Equal(t, []string{"deadletter:shard:1/3:0/3000:1", "deadletter:shard:1/3:0/3000:2", "deadletter:shard:1/3:0/3100"},
		shardDeadLetterIDs(t, 1, 3, ok, far, far))
	require.Equal(t, []string{"deadletter:0/3000:1", "deadletter:0/3000:2", "deadletter:0/3100"},
		shardDeadLetterIDs(t, 0, 0, ok, far, far), "not sharded")
}
