package main

import (
	"bytes"
	"context"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/stretchr/testify/require"

	"github.com/batonhq/baton/internal/config"
	"github.com/batonhq/baton/internal/testsvc"
	"github.com/batonhq/baton/relay"
)

// Every stream setting the command accepts, the relay accepts too, with the same meaning: no
// age limit is 0 on the command line and negative in relay.StreamSettings.
func TestStreamSettingsAgreeWithTheRelay(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name string
		set  func(*config.Config)
		want relay.StreamSettings
	}{
		{"defaults", func(*config.Config) {},
			relay.StreamSettings{Replicas: 1, MaxAge: 168 * time.Hour, MaxBytes: 1 << 30, MaxMsgs: 1_000_000, Duplicates: 2 * time.Minute}},
		{"no caps", func(c *config.Config) { c.StreamMaxAge, c.StreamMaxBytes, c.StreamMaxMsgs = "0", "-1", "-1" },
			relay.StreamSettings{Replicas: 1, MaxAge: -1, MaxBytes: -1, MaxMsgs: -1, Duplicates: 2 * time.Minute}},
		{"set", func(c *config.Config) {
			c.StreamReplicas, c.StreamMaxAge, c.StreamMaxBytes, c.StreamMaxMsgs, c.StreamDuplicates = "3", "1h", "64MiB", "10", "1h"
		}, relay.StreamSettings{Replicas: 3, MaxAge: time.Hour, MaxBytes: 64 << 20, MaxMsgs: 10, Duplicates: time.Hour}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			cli := config.Config{SubjectPrefix: "agent", Slot: "baton", Publication: "baton", Schema: "public", FatalLinger: "2m",
				LogLevel: "info", LogFormat: "text", StreamReplicas: "1", StreamMaxAge: "168h", StreamMaxBytes: "1GiB",
				StreamMaxMsgs: "1000000", StreamDuplicates: "2m"}
			tc.set(&cli)
			require.NoError(t, cli.Validate())
			got := streamSettings(cli.Streams())
			require.Equal(t, tc.want, got)
			_, err := relay.New(relay.Config{DatabaseURL: "postgres://localhost/db", NATS: new(nats.Conn), Streams: got})
			require.NoError(t, err)
		})
	}
}

// `baton relay` creates its streams with the settings of its flags (--dup-window is the older
// name of --stream-duplicates), and refuses a bad one naming the flag, with exit 1 like any
// invalid configuration.
func TestRelayStreamFlags(t *testing.T) {
	t.Parallel()
	db := testsvc.NewDatabase(t)
	ns := testsvc.StartNATS(t)
	args := []string{"relay", "--database-url", db.RoleURL(testsvc.RoleRelay), "--nats-url", ns.URL(), "--slot", db.Name}

	var stdout, stderr bytes.Buffer
	code := run(context.Background(), append(args, "--stream-max-msgs", "0"), &stdout, &stderr)
	require.Equal(t, 1, code, stderr.String())
	require.Contains(t, stderr.String(), "--stream-max-msgs: must be a positive number, or -1 for no cap")

	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	done := make(chan int, 1)
	go func() {
		var stdout, stderr bytes.Buffer
		done <- run(ctx, append(args, "--stream-max-msgs", "50", "--stream-max-bytes", "1MiB", "--stream-max-age", "1h",
			"--dup-window", "30s"), &stdout, &stderr)
	}()
	nc, err := nats.Connect(ns.URL())
	require.NoError(t, err)
	defer nc.Close()
	js, err := jetstream.New(nc)
	require.NoError(t, err)
	streams := map[string]jetstream.StreamConfig{}
	require.Eventually(t, func() bool {
		for _, name := range []string{"AGENT_TURNS", "AGENT_OUTCOMES", "AGENT_DEADLETTER"} {
			s, err := js.Stream(ctx, name)
			if err != nil {
				return false
			}
			streams[name] = s.CachedInfo().Config
		}
		return true
	}, 30*time.Second, 20*time.Millisecond, "the relay never created its streams")
	cancel()
	select {
	case code := <-done:
		require.Equal(t, 0, code)
	case <-time.After(30 * time.Second):
		t.Fatal("the relay did not stop")
	}

	turns, outcomes, deadLetter := streams["AGENT_TURNS"], streams["AGENT_OUTCOMES"], streams["AGENT_DEADLETTER"]
	require.Equal(t, jetstream.WorkQueuePolicy, turns.Retention)
	require.Equal(t, jetstream.DiscardNew, turns.Discard)
	require.Zero(t, turns.MaxAge, "never an age limit on turns")
	require.EqualValues(t, 50, turns.MaxMsgs)
	require.EqualValues(t, 1<<20, turns.MaxBytes)
	require.Equal(t, jetstream.LimitsPolicy, outcomes.Retention)
	require.Equal(t, jetstream.DiscardOld, outcomes.Discard)
	require.Equal(t, time.Hour, outcomes.MaxAge)
	require.EqualValues(t, 50, outcomes.MaxMsgs)
	for _, s := range []jetstream.StreamConfig{turns, outcomes, deadLetter} {
		require.Equal(t, 30*time.Second, s.Duplicates, s.Name)
		require.Equal(t, 1, s.Replicas, s.Name)
	}
	require.Equal(t, jetstream.LimitsPolicy, deadLetter.Retention)
	require.Equal(t, relay.DefaultDeadLetterMaxAge, deadLetter.MaxAge)
}
