package statusreport

import (
	"fmt"
	"strings"

	"github.com/nats-io/nats.go/jetstream"
)

// StreamCluster is where a stream's replicas run and which one leads (JetStream's
// StreamInfo.Cluster, as the server that answered sees it).
type StreamCluster struct {
	// Replicas is the stream's configured replica count (BATON_STREAM_REPLICAS when the relay
	// created it).
	Replicas int `json:"replicas"`
	// Cluster is the NATS cluster's name; empty on a server that is not part of a cluster.
	Cluster string `json:"cluster,omitempty"`
	// Leader is the server that leads the stream: it takes every publish and delivery. Empty
	// while the stream has none: an election is under way, or fewer than a quorum of its
	// replicas run, and publishes stall (the relay holds its LSN) until one is elected.
	Leader string `json:"leader"`
	// Peers are the stream's other replicas, as the leader sees them; empty for R1.
	Peers []StreamPeer `json:"peers"`
}

// StreamPeer is a replica of a stream other than its leader.
type StreamPeer struct {
	Name string `json:"name"`
	// Current is true when the replica has everything the leader committed.
	Current bool `json:"current"`
	// Offline is true when the leader has not heard from the replica for a while.
	Offline bool `json:"offline"`
	// ActiveSeconds is how long ago the leader last heard from it.
	ActiveSeconds float64 `json:"active_seconds"`
	// Lag is how many operations it is behind the leader.
	Lag uint64 `json:"lag"`
}

// streamCluster reads the replica count and StreamInfo.Cluster of info.
func streamCluster(info *jetstream.StreamInfo) *StreamCluster {
	if info == nil {
		return nil
	}
	c := &StreamCluster{Replicas: max(info.Config.Replicas, 1), Peers: []StreamPeer{}}
	if ci := info.Cluster; ci != nil {
		c.Cluster, c.Leader = ci.Name, ci.Leader
		for _, p := range ci.Replicas {
			if p == nil {
				continue
			}
			c.Peers = append(c.Peers, StreamPeer{Name: p.Name, Current: p.Current, Offline: p.Offline,
				ActiveSeconds: p.Active.Seconds(), Lag: p.Lag})
		}
	}
	return c
}

// evaluateStreamClusters adds to the report's lists what the streams' replicas need.
//
// Attention: a stream without a leader (no publish or delivery until one is elected).
// Warnings: a replica offline or behind the leader; a stream of one replica on a cluster (it
// is unavailable whenever its one server is).
func (r *Report) evaluateStreamClusters(attn, warn func(format string, args ...any)) {
	st := r.Streams
	if !st.Checked || st.Error != "" {
		return
	}
	for _, s := range []*Stream{st.Turns, st.Outcomes} {
		if s == nil || !s.Exists || s.Cluster == nil {
			continue
		}
		c := s.Cluster
		if c.Leader == "" {
			attn("stream %s has no leader: fewer than a quorum of its %d replicas run, or an election is under way; publishes and deliveries wait until one is elected", s.Name, c.Replicas)
			continue
		}
		for _, p := range c.Peers {
			switch {
			case p.Offline:
				warn("replica %s of stream %s is offline (last seen %s ago): the stream runs on %d of %d replicas", p.Name, s.Name, fmtSeconds(p.ActiveSeconds), c.Replicas-offline(c.Peers), c.Replicas)
			case !p.Current:
				warn("replica %s of stream %s is catching up (%d operations behind %s)", p.Name, s.Name, p.Lag, c.Leader)
			}
		}
		if c.Cluster != "" && c.Replicas == 1 {
			warn("stream %s has 1 replica on cluster %s: it is unavailable whenever %s is down; set BATON_STREAM_REPLICAS=3", s.Name, c.Cluster, c.Leader)
		}
	}
}

func offline(peers []StreamPeer) int {
	n := 0
	for _, p := range peers {
		if p.Offline {
			n++
		}
	}
	return n
}

// writeStreamClusters prints the streams' replicas and leaders under the streams table, when
// the server reported them.
func writeStreamClusters(p func(format string, args ...any), st Streams) {
	var rows []*Stream
	for _, s := range []*Stream{st.Turns, st.Outcomes} {
		if s != nil && s.Exists && s.Cluster != nil {
			rows = append(rows, s)
		}
	}
	if len(rows) == 0 {
		return
	}
	p("")
	p("  STREAM\tREPLICAS\tLEADER\tOTHER REPLICAS")
	for _, s := range rows {
		c := s.Cluster
		peers := make([]string, 0, len(c.Peers))
		for _, pr := range c.Peers {
			state := "current"
			switch {
			case pr.Offline:
				state = "offline, seen " + fmtSeconds(pr.ActiveSeconds) + " ago"
			case !pr.Current:
				state = fmt.Sprintf("catching up, %d behind", pr.Lag)
			}
			peers = append(peers, pr.Name+" ("+state+")")
		}
		leader := c.Leader
		if leader == "" {
			leader = "none (no quorum)"
		}
		replicas := fmt.Sprint(c.Replicas)
		if c.Cluster != "" {
			replicas += " on " + c.Cluster
		}
		p("  %s\t%s\t%s\t%s", s.Name, replicas, leader, orDash(strings.Join(peers, ", ")))
	}
}
