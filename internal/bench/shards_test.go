package bench

import (
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
)

func TestShardsConfig(t *testing.T) {
	t.Parallel()
	require.NoError(t, Config{Shards: 2}.Validate())
	require.NoError(t, Config{Shards: MaxBenchShards}.Validate())
	for _, tc := range []struct {
		cfg  Config
		want string
	}{
		{Config{Shards: 1}, "shards must be 2…16"},
		{Config{Shards: MaxBenchShards + 1}, "shards must be 2…16"},
		{Config{Shards: -2}, "shards must be 2…16"},
		{Config{Shards: 2, Parts: []string{PartLatency}}, "shard relays run in the catchup part"},
	} {
		require.ErrorContains(t, tc.cfg.Validate(), tc.want, "%+v", tc.cfg)
	}

	cfg, _ := Config{Rounds: 2, Shards: 3}.withDefaults()
	require.Equal(t, 2*len(catchUpReaders)+2*3, cfg.slotsNeeded())
	require.Equal(t, append(append([]string(nil), catchUpReaders...), "relay_shards3"), cfg.catchUpContenders())
	cfg, _ = Config{}.withDefaults()
	require.Equal(t, catchUpReaders, cfg.catchUpContenders(), "no shard contender by default")

	n, ok := isShards("relay_shards3")
	require.True(t, ok)
	require.Equal(t, 3, n)
	for _, c := range []string{cRelay, cPlain, "relay_shards1", "relay_shardsx"} {
		_, ok := isShards(c)
		require.False(t, ok, c)
	}
	require.True(t, strings.HasPrefix(contenderLabel("relay_shards2"), "2 shard relays at once"))
}
