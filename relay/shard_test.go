package relay_test

import (
	"fmt"
	"math/rand/v2"
	"strconv"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/batonhq/baton/internal/testsvc"
	"github.com/batonhq/baton/migrations"
	"github.com/batonhq/baton/relay"
	"github.com/batonhq/baton/wire"
)

// shardSetup is a bundle whose database has n shard publications (baton_0 …) for relays on
// slots <b.cfg.Slot>_<K>.
func shardSetup(t *testing.T, n int) *bundle {
	t.Helper()
	b := setup(t)
	_, err := migrations.EnsureShards(ctxT(t, time.Minute), b.db.Pool, migrations.ShardOptions{Slot: b.cfg.Slot}, n)
	require.NoError(t, err)
	return b
}

// startShard runs `baton relay --shard k/n` as a process until the test ends.
func (b *bundle) startShard(t *testing.T, k, n int) *haProcess {
	t.Helper()
	return b.startHAProcess(t, b.cfg.DatabaseURL, "--shard", fmt.Sprintf("%d/%d", k, n))
}

func (p *haProcess) awaitLogged(t *testing.T, s string) {
	t.Helper()
	require.Eventually(t, func() bool { return p.logged(s) }, time.Minute, 10*time.Millisecond, "relay pid %d never logged %q", p.cmd.Process.Pid, s)
}

func (p *haProcess) kill9(t *testing.T) {
	t.Helper()
	require.NoError(t, p.cmd.Process.Kill())
	select {
	case <-p.exited:
	case <-time.After(30 * time.Second):
		t.Fatal("relay process did not exit after SIGKILL")
	}
}

// turns reads the turns stream without a consumer (any retention), as assertExactlyOnceInOrder
// takes it.
func (b *bundle) turns(t *testing.T) []got {
	t.Helper()
	var out []got
	for _, m := range testsvc.StreamMsgs(ctxT(t, time.Minute), t, b.js, "AGENT_TURNS") {
		out = append(out, got{seq: m.Sequence, stored: m.Time, subject: m.Subject, header: m.Header, data: m.Data})
	}
	return out
}

// shardOf returns the shard of n that each of ids is in, by the publications' own predicate.
func shardOf(t *testing.T, b *bundle, n int, ids []string) map[string]int {
	t.Helper()
	out := map[string]int{}
	for k := range n {
		rows, err := b.db.Pool.Query(ctxT(t, time.Minute), `SELECT conversation_id FROM unnest($1::text[]) AS conversation_id WHERE `+
			migrations.ShardPredicate(n, k), ids)
		require.NoError(t, err)
		in, err := pgx.CollectRows(rows, pgx.RowTo[string])
		require.NoError(t, err)
		for _, id := range in {
			_, twice := out[id]
			require.False(t, twice, "conversation %s in two shards", id)
			out[id] = k
		}
	}
	require.Len(t, out, len(ids), "every conversation in a shard")
	return out
}

// N shard relays, each a real process, over many conversations with producers committing, and
// shard relays killed with SIGKILL and restarted during the run: every outbox row reaches the
// turns stream exactly once, each conversation's in commit order (a conversation lives in one
// shard, so one relay publishes all of it); each shard's first-start backfill published exactly
// the pending rows of its own conversations; and every shard slot confirms up to the end of
// the WAL written.
func TestShardedRelaysKilledExactlyOnce(t *testing.T) {
	t.Parallel()
	for _, n := range []int{2, 4} {
		t.Run(strconv.Itoa(n)+" shards", func(t *testing.T) {
			t.Parallel()
			b := shardSetup(t, n)
			ctx := ctxT(t, 2*time.Minute)
			convs := conversationIDs(40)
			createConversations(t, b.db.Pool, convs...)
			shard := shardOf(t, b, n, convs)

			// A backlog before any relay: each shard's first start backfills its part.
			const backlog = 120
			for i := range backlog {
				_, err := send(ctx, b.db.Pool, convs[i%len(convs)], fmt.Sprintf("pre-%d", i))
				require.NoError(t, err)
			}
			pending := make([]int, n)
			for i := range backlog {
				pending[shard[convs[i%len(convs)]]]++
			}
			procs := make([]*haProcess, n)
			for k := range n {
				procs[k] = b.startShard(t, k, n)
			}
			for k := range n {
				procs[k].awaitLogged(t, "msg=streaming")
			}
			for k := range n {
				var rows int
				require.NoError(t, b.db.Pool.QueryRow(ctx, `SELECT backfill_rows FROM baton_relay_slots WHERE slot_name = $1 AND backfill_done`,
					migrations.ShardName(b.cfg.Slot, k)).Scan(&rows))
				require.Equal(t, pending[k], rows, "shard %d backfilled the pending rows of its conversations, no others", k)
			}

			stop := make(chan struct{})
			wait := producers(ctx, t, b.db.Pool, convs, 4, 1500*int64(n), stop)
			kills := 0
			for kills < 2*n {
				time.Sleep(time.Duration(50+rand.IntN(250)) * time.Millisecond) // a random moment of the load
				k := rand.IntN(n)
				procs[k].kill9(t)
				kills++
				procs[k] = b.startShard(t, k, n)
				procs[k].awaitLogged(t, "msg=streaming")
			}
			written := wait()
			close(stop)
			want := truth(t, b.db.Pool)
			require.Len(t, want, int(written)+backlog)
			b.waitStreamCount(t, "AGENT_TURNS", len(want), time.Minute)
			assertExactlyOnceInOrder(t, b.turns(t), want)

			var end string
			require.NoError(t, b.db.Pool.QueryRow(ctx, `SELECT pg_current_wal_lsn()::text`).Scan(&end))
			for k := range n {
				slot := migrations.ShardName(b.cfg.Slot, k)
				require.Eventually(t, func() bool {
					var confirmed string
					err := b.db.Pool.QueryRow(ctx, `SELECT coalesce(confirmed_flush_lsn::text, '0/0') FROM pg_replication_slots WHERE slot_name = $1`,
						slot).Scan(&confirmed)
					return err == nil && lsnOf(t, confirmed) >= lsnOf(t, end)
				}, 30*time.Second, 20*time.Millisecond, "slot %s never confirmed %s", slot, end)
			}
			t.Logf("%d shards: %d kills, %d rows", n, kills, len(want))
		})
	}
}

// Two relays on shard 0 of 2: one streams, the other stands by, since the relay lock is per
// slot. While only shard 0 is relayed, no event of a shard 1 conversation reaches the stream:
// the rows of all conversations commit, then a marker on a shard 0 conversation, and once the
// marker is in the stream (one slot streams in commit order) nothing of shard 1 is. Shard 1's
// relay then publishes its part; SIGKILL the active shard 0 relay and the standby takes over,
// with nothing lost or doubled.
func TestShardStandbyTakesOver(t *testing.T) {
	t.Parallel()
	b := shardSetup(t, 2)
	ctx := ctxT(t, 2*time.Minute)
	convs := conversationIDs(20)
	createConversations(t, b.db.Pool, convs...)
	shard := shardOf(t, b, 2, convs)
	var zero string
	for _, c := range convs {
		if shard[c] == 0 {
			zero = c
		}
	}
	require.NotEmpty(t, zero, "shard 0 has conversations")

	first := b.startShard(t, 0, 2)
	first.awaitLogged(t, "msg=streaming")
	second := b.startShard(t, 0, 2)
	second.awaitLogged(t, "standing by")
	require.False(t, second.logged("msg=streaming"), "two relays stream shard 0")

	for i, c := range convs {
		_, err := send(ctx, b.db.Pool, c, fmt.Sprintf("before-%d", i))
		require.NoError(t, err)
	}
	marker, err := send(ctx, b.db.Pool, zero, "marker")
	require.NoError(t, err)
	require.Eventually(t, func() bool {
		msgs := b.turns(t)
		return len(msgs) > 0 && msgs[len(msgs)-1].header.Get(wire.HeaderOutboxID) == strconv.FormatInt(marker, 10)
	}, 30*time.Second, 20*time.Millisecond, "the marker never reached the stream")
	for _, m := range b.turns(t) {
		conv := m.header.Get(wire.HeaderConversationID)
		k, ok := shard[conv]
		require.True(t, ok, "unknown conversation %q", conv)
		require.Equal(t, 0, k, "shard 0's relay published conversation %s of shard 1", conv)
	}

	other := b.startShard(t, 1, 2)
	other.awaitLogged(t, "msg=streaming")
	b.waitStreamCount(t, "AGENT_TURNS", len(convs)+1, 30*time.Second)

	first.kill9(t)
	second.awaitLogged(t, "msg=streaming")
	for i, c := range convs {
		_, err := send(ctx, b.db.Pool, c, fmt.Sprintf("after-%d", i))
		require.NoError(t, err)
	}
	want := truth(t, b.db.Pool)
	b.waitStreamCount(t, "AGENT_TURNS", len(want), 30*time.Second)
	assertExactlyOnceInOrder(t, b.turns(t), want)
}

// A relay refuses, with ErrSetup, a shard whose publication is missing or was made for another
// shard count: it would publish other conversations than its backfill, and leave some to no
// shard or to two.
func TestShardPublicationChecked(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := ctxT(t, time.Minute)
	run := func(k, n int) error {
		cfg := b.cfg
		cfg.Shard, cfg.Shards = k, n
		r, err := relay.New(cfg)
		require.NoError(t, err)
		return r.Run(ctx)
	}
	err := run(0, 2)
	require.ErrorIs(t, err, relay.ErrSetup)
	require.ErrorContains(t, err, `publication "baton_0" does not exist; run `+"`baton migrate --shards 2`")

	_, err = migrations.EnsureShards(ctx, b.db.Pool, migrations.ShardOptions{Slot: b.cfg.Slot}, 2)
	require.NoError(t, err)
	err = run(1, 4)
	require.ErrorIs(t, err, relay.ErrSetup)
	require.ErrorContains(t, err, `publication "baton_1" filters public.`)
	require.ErrorContains(t, err, "not by shard 1 of 4")

	// Out-of-range shards are configuration errors.
	for _, kn := range [][2]int{{2, 2}, {-1, 2}, {0, migrations.MaxShards + 1}} {
		cfg := b.cfg
		cfg.Shard, cfg.Shards = kn[0], kn[1]
		_, err := relay.New(cfg)
		require.ErrorIs(t, err, relay.ErrConfig, "%v", kn)
	}
	var slots int
	require.NoError(t, b.db.Pool.QueryRow(ctx, `SELECT count(*) FROM pg_replication_slots WHERE slot_name LIKE $1 || '\_%'`, b.cfg.Slot).Scan(&slots))
	require.Zero(t, slots, "a refused shard relay creates no slot")
}
