package main

import (
	"context"
	"encoding/json"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/stretchr/testify/require"

	"github.com/batonhq/baton/internal/statusreport"
	"github.com/batonhq/baton/internal/testsvc"
	"github.com/batonhq/baton/relay"
)

// `baton status` given every node of a 3-node cluster shows each stream's replica count, its
// leader and its other replicas, follows the leader through an election, and reports the
// replica that went away.
func TestStatusOfStreamsOnACluster(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(t.Context(), 2*time.Minute)
	defer cancel()
	cl := testsvc.StartCluster(t, 3)
	db := testsvc.NewDatabase(t)
	nc, err := nats.Connect(cl.URLs(), nats.MaxReconnects(-1), nats.ReconnectWait(100*time.Millisecond))
	require.NoError(t, err)
	t.Cleanup(nc.Close)
	js, err := jetstream.New(nc)
	require.NoError(t, err)

	r, err := relay.New(relay.Config{DatabaseURL: db.URL, NATS: nc, Slot: db.Name, Streams: relay.StreamSettings{Replicas: 3},
		StatusInterval: 100 * time.Millisecond, Logger: discardLogger()})
	require.NoError(t, err)
	b := &statusBundle{t: t, db: db}
	b.runUntilStopped("relay", r.Run, r.Active)
	for _, st := range []string{"AGENT_TURNS", "AGENT_OUTCOMES"} {
		_, err := cl.AwaitStreamReplicas(ctx, js, st)
		require.NoError(t, err)
	}

	status := func(args ...string) result {
		return runBaton(t, append([]string{"status", "--database-url", db.URL, "--slot", db.Name, "--nats-url", cl.URLs()}, args...)...)
	}
	report := func() statusreport.Report {
		t.Helper()
		res := status("--json")
		var rep statusreport.Report
		require.NoError(t, json.Unmarshal([]byte(res.stdout), &rep), "stdout: %s\nstderr: %s", res.stdout, res.stderr)
		return rep
	}
	peerNames := func(c *statusreport.StreamCluster) []string {
		var names []string
		for _, p := range c.Peers {
			names = append(names, p.Name)
		}
		return names
	}

	// The workers' consumer does not exist here (a warning of its own): only the replicas'
	// warnings count.
	replicaWarnings := func(rep statusreport.Report) []string {
		var out []string
		for _, w := range rep.Warnings {
			if strings.HasPrefix(w, "replica ") || strings.Contains(w, " replica on cluster ") {
				out = append(out, w)
			}
		}
		return out
	}

	leader, err := cl.StreamLeader(ctx, js, "AGENT_TURNS")
	require.NoError(t, err)
	rep := report()
	require.Empty(t, rep.Attention)
	require.Empty(t, replicaWarnings(rep))
	turns := rep.Streams.Turns.Cluster
	require.NotNil(t, turns)
	require.Equal(t, 3, turns.Replicas)
	require.Equal(t, testsvc.ClusterName, turns.Cluster)
	require.Equal(t, leader.Name, turns.Leader)
	require.Len(t, turns.Peers, 2)
	require.NotContains(t, peerNames(turns), leader.Name)
	for _, p := range turns.Peers {
		require.True(t, p.Current, "%+v", p)
		require.False(t, p.Offline, "%+v", p)
	}
	require.Equal(t, 3, rep.Streams.Outcomes.Cluster.Replicas)
	require.NotEmpty(t, rep.Streams.Outcomes.Cluster.Leader)

	text := status()
	require.Equal(t, 0, text.code, text.stderr) // warnings only
	require.Regexp(t, `(?m)^  AGENT_TURNS +3 on `+testsvc.ClusterName+` +`+leader.Name+` +baton-n\d \(current\), baton-n\d \(current\)$`, text.stdout)

	// The leader goes away: another replica leads, and the one that went away shows offline
	// once the new leader notices (a warning: two of three still run).
	t0 := time.Now()
	leader.Stop()
	require.Eventually(t, func() bool {
		rep = report()
		c := rep.Streams.Turns.Cluster
		if c == nil || c.Leader == "" || c.Leader == leader.Name || len(rep.Attention) > 0 { // the outcomes stream may still elect
			return false
		}
		for _, p := range c.Peers {
			if p.Name == leader.Name {
				return p.Offline || !p.Current
			}
		}
		return false
	}, time.Minute, 200*time.Millisecond, "the report never showed a new leader and %s away: %+v", leader.Name, rep.Streams.Turns)
	require.Empty(t, rep.Attention)
	require.NotEmpty(t, replicaWarnings(rep))
	require.Contains(t, replicaWarnings(rep)[0], "replica "+leader.Name+" of stream AGENT_TURNS")

	t.Logf("a new leader and %s away in the report after %v", leader.Name, time.Since(t0).Round(time.Millisecond))
	t0 = time.Now()
	// Back again: it catches up and the warnings go.
	require.NoError(t, leader.Start())
	require.Eventually(t, func() bool {
		rep = report()
		return len(replicaWarnings(rep)) == 0 && len(rep.Attention) == 0
	}, time.Minute, 200*time.Millisecond, "warnings stayed after %s came back: %q", leader.Name, rep.Warnings)
	t.Logf("%s current again in the report after %v", leader.Name, time.Since(t0).Round(time.Millisecond))
}
