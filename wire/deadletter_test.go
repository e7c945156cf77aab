package wire_test

import (
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/batonhq/baton/wire"
)

// Dead-letter Nats-Msg-Ids are part of the contract: their exact forms, and that no two
// distinct (shard, shards, lsn, n) give one id, nor one of an unsharded relay or the backfill.
func TestDeadLetterMsgIDForms(t *testing.T) {
	for _, tc := range []struct{ got, want string }{
		{wire.DeadLetterMsgID("16/B374D848"), "deadletter:16/B374D848"},
		{wire.DeadLetterNthMsgID("16/B374D848", 0), "deadletter:16/B374D848"},
		{wire.DeadLetterNthMsgID("16/B374D848", 3), "deadletter:16/B374D848:3"},
		{wire.DeadLetterShardMsgID(0, 2, "16/B374D848", 0), "deadletter:shard:0/2:16/B374D848"},
		{wire.DeadLetterShardMsgID(1, 2, "16/B374D848", 3), "deadletter:shard:1/2:16/B374D848:3"},
		{wire.DeadLetterBackfillMsgID(42), "deadletter:backfill:42"},
	} {
		require.Equal(t, tc.want, tc.got)
	}

	seen := map[string]string{}
	add := func(id, what string) {
		t.Helper()
		prev, dup := seen[id]
		require.False(t, dup, "%s and %s share the id %s", prev, what, id)
		seen[id] = what
	}
	for _, lsn := range []string{"0/0", "0/3000", "1/3000", "16/B374D848"} {
		for n := range 3 {
			add(wire.DeadLetterNthMsgID(lsn, n), "unsharded "+lsn)
			for shards := 1; shards <= 3; shards++ {
				for shard := range shards {
					add(wire.DeadLetterShardMsgID(shard, shards, lsn, n), "shard "+lsn)
				}
			}
		}
	}
	add(wire.DeadLetterBackfillMsgID(0), "backfill")
}
