package statusreport

import (
	"bytes"
	"encoding/json"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"github.com/stretchr/testify/require"
)

// replicated is healthy() on a 3-node cluster: both streams R3, led by n0, replicas current.
func replicated() *Report {
	r := healthy()
	for _, s := range []*Stream{r.Streams.Turns, r.Streams.Outcomes} {
		s.Cluster = &StreamCluster{Replicas: 3, Cluster: "baton", Leader: "n0", Peers: []StreamPeer{
			{Name: "n1", Current: true, ActiveSeconds: 0.1}, {Name: "n2", Current: true, ActiveSeconds: 0.2}}}
	}
	return r
}

func TestStatusEvaluateStreamClusters(t *testing.T) {
	for _, tt := range []struct {
		name      string
		change    func(r *Report)
		attention []string
		warnings  []string
	}{
		{name: "R3, all current", change: func(*Report) {}},
		{name: "no leader", change: func(r *Report) { r.Streams.Turns.Cluster.Leader = "" },
			attention: []string{"stream AGENT_TURNS has no leader: fewer than a quorum of its 3 replicas run"}},
		{name: "a replica offline", change: func(r *Report) {
			r.Streams.Outcomes.Cluster.Peers[1] = StreamPeer{Name: "n2", Offline: true, ActiveSeconds: 42}
		}, warnings: []string{"replica n2 of stream AGENT_OUTCOMES is offline (last seen 42s ago): the stream runs on 2 of 3 replicas"}},
		{name: "a replica catching up", change: func(r *Report) {
			r.Streams.Turns.Cluster.Peers[0] = StreamPeer{Name: "n1", Lag: 17}
		}, warnings: []string{"replica n1 of stream AGENT_TURNS is catching up (17 operations behind n0)"}},
		{name: "R1 on a cluster", change: func(r *Report) {
			r.Streams.Turns.Cluster = &StreamCluster{Replicas: 1, Cluster: "baton", Leader: "n1", Peers: []StreamPeer{}}
		}, warnings: []string{"stream AGENT_TURNS has 1 replica on cluster baton: it is unavailable whenever n1 is down"}},
		{name: "R1 on a single server", change: func(r *Report) {
			r.Streams.Turns.Cluster = &StreamCluster{Replicas: 1, Leader: "solo", Peers: []StreamPeer{}}
		}},
	} {
		t.Run(tt.name, func(t *testing.T) {
			r := replicated()
			tt.change(r)
			r.Evaluate()
			requireEach(t, "attention", r.Attention, tt.attention)
			requireEach(t, "warnings", r.Warnings, tt.warnings)
		})
	}
}

func TestStatusWriteTextStreamClusters(t *testing.T) {
	r := replicated()
	r.Streams.Outcomes.Cluster.Leader = ""
	r.Streams.Outcomes.Cluster.Peers = []StreamPeer{{Name: "n1", Offline: true, ActiveSeconds: 5}, {Name: "n2", Lag: 3}}
	r.Evaluate()
	var b bytes.Buffer
	require.NoError(t, WriteText(&b, r))
	require.Contains(t, b.String(), `
  AGENT_OUTCOMES  11        0 B    0          11        -

  STREAM          REPLICAS    LEADER            OTHER REPLICAS
  AGENT_TURNS     3 on baton  n0                n1 (current), n2 (current)
  AGENT_OUTCOMES  3 on baton  none (no quorum)  n1 (offline, seen 5s ago), n2 (catching up, 3 behind)

  CONSUMER  `)

	// Without cluster information (an older report), no table.
	b.Reset()
	require.NoError(t, WriteText(&b, healthy()))
	require.NotContains(t, b.String(), "REPLICAS")
}

func TestStatusJSONStreamCluster(t *testing.T) {
	r := replicated()
	r.Evaluate()
	var b bytes.Buffer
	require.NoError(t, WriteJSON(&b, r))
	var raw struct {
		Streams struct {
			Turns map[string]any `json:"turns"`
		} `json:"streams"`
	}
	require.NoError(t, json.Unmarshal(b.Bytes(), &raw))
	require.Equal(t, map[string]any{"replicas": 3.0, "cluster": "baton", "leader": "n0", "peers": []any{
		map[string]any{"name": "n1", "current": true, "offline": false, "active_seconds": 0.1, "lag": 0.0},
		map[string]any{"name": "n2", "current": true, "offline": false, "active_seconds": 0.2, "lag": 0.0},
	}}, raw.Streams.Turns["cluster"])
	var back Report
	require.NoError(t, json.Unmarshal(b.Bytes(), &back))
	require.Equal(t, *r, back)
}

func TestStreamClusterFromInfo(t *testing.T) {
	require.Nil(t, streamCluster(nil))
	// A server outside a cluster reports itself as the leader of an R1 stream (and an older
	// one may leave Replicas 0).
	require.Equal(t, &StreamCluster{Replicas: 1, Leader: "solo", Peers: []StreamPeer{}},
		streamCluster(&jetstream.StreamInfo{Cluster: &jetstream.ClusterInfo{Leader: "solo"}}))
	require.Equal(t, &StreamCluster{Replicas: 3, Cluster: "c", Leader: "a", Peers: []StreamPeer{
		{Name: "b", Current: true, ActiveSeconds: 0.5},
		{Name: "c", Offline: true, ActiveSeconds: 90, Lag: 12},
	}}, streamCluster(&jetstream.StreamInfo{Config: jetstream.StreamConfig{Replicas: 3},
		Cluster: &jetstream.ClusterInfo{Name: "c", Leader: "a", Replicas: []*jetstream.PeerInfo{
			{Name: "b", Current: true, Active: 500 * time.Millisecond},
			nil,
			{Name: "c", Offline: true, Active: 90 * time.Second, Lag: 12},
		}}}))
}
