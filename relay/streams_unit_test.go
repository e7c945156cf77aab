package relay

import (
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/stretchr/testify/require"
)

// The streams the relay wants: turns a work queue that refuses new events when full and never
// ages them out; outcomes and dead letters drop their oldest. compatible names every setting
// of an existing stream that breaks that; otherLimits the limits it keeps.
func TestWantStreamsAndTheirChecks(t *testing.T) {
	cfg := Config{DatabaseURL: "x", NATS: new(nats.Conn), Streams: StreamSettings{MaxMsgs: 50, MaxBytes: 1 << 20, MaxAge: time.Hour}}
	require.NoError(t, cfg.fill())
	want := wantStreams(&cfg)
	turns, outcomes, deadLetter := want[0], want[1], want[2]
	require.Equal(t, "AGENT_TURNS", turns.Name)
	require.Equal(t, jetstream.WorkQueuePolicy, turns.Retention)
	require.Equal(t, jetstream.DiscardNew, turns.Discard)
	require.Zero(t, turns.MaxAge)
	require.EqualValues(t, 50, turns.MaxMsgs)
	require.Equal(t, jetstream.LimitsPolicy, outcomes.Retention)
	require.Equal(t, jetstream.DiscardOld, outcomes.Discard)
	require.Equal(t, time.Hour, outcomes.MaxAge)
	require.Equal(t, DefaultDeadLetterMaxAge, deadLetter.MaxAge)
	require.EqualValues(t, -1, deadLetter.MaxMsgs)
	for _, w := range want {
		require.NoError(t, compatible(w, w, 1<<20), w.Name)
		require.Empty(t, otherLimits(w, w), w.Name)
	}

	old := turns // a turns stream of an older relay
	old.Retention, old.Discard, old.MaxAge = jetstream.LimitsPolicy, jetstream.DiscardOld, 24*time.Hour
	err := compatible(old, turns, 1<<20)
	require.ErrorContains(t, err, "retention Limits (want WorkQueue; JetStream cannot change it in place")
	require.ErrorContains(t, err, "nats stream rm AGENT_TURNS")
	require.ErrorContains(t, err, "discard DiscardOld (want DiscardNew: discarding old events would drop unfinished turn events")
	require.ErrorContains(t, err, "`nats stream edit AGENT_TURNS --discard new`")
	require.ErrorContains(t, err, "max_age 24h0m0s (want none")

	full := outcomes
	full.Discard = jetstream.DiscardNew
	require.ErrorContains(t, compatible(full, outcomes, 1<<20), "discard DiscardNew (want DiscardOld: discarding new events would stall the relay")

	other := outcomes
	other.MaxBytes, other.MaxMsgs, other.MaxAge, other.Replicas = -1, 10, 0, 3
	require.NoError(t, compatible(other, outcomes, 1<<20), "limits are the operator's")
	require.Equal(t, "max_age 0s (configured 1h0m0s), max_bytes -1 (configured 1048576), max_msgs 10 (configured 50), replicas 3 (configured 1)",
		otherLimits(other, outcomes))
}

// StreamSettings fill bounded defaults and turn "negative: none" into JetStream's values.
func TestStreamSettingsFill(t *testing.T) {
	var s StreamSettings
	require.NoError(t, s.fill())
	require.Equal(t, StreamSettings{Duplicates: 2 * time.Minute, MaxAge: 7 * 24 * time.Hour, MaxBytes: 1 << 30, MaxMsgs: 1_000_000, Replicas: 1}, s)
	s = StreamSettings{MaxAge: -1, MaxBytes: -5, MaxMsgs: -1}
	require.NoError(t, s.fill())
	require.Equal(t, StreamSettings{Duplicates: 2 * time.Minute, MaxBytes: -1, MaxMsgs: -1, Replicas: 1}, s)
	for _, bad := range []StreamSettings{{Duplicates: -time.Second}, {Duplicates: 2 * time.Hour, MaxAge: time.Hour}, {Replicas: 6}} {
		require.ErrorIs(t, bad.fill(), ErrConfig, "%+v", bad)
	}
}

// A stream-full episode retries within streamFullMaxBackoff, however long the backoff had
// grown; other errors double it up to MaxBackoff.
func TestNextBackoff(t *testing.T) {
	for _, tc := range []struct {
		cur, max  time.Duration
		full      bool
		now, next time.Duration
	}{
		{100 * time.Millisecond, 10 * time.Second, false, 100 * time.Millisecond, 200 * time.Millisecond},
		{8 * time.Second, 10 * time.Second, false, 8 * time.Second, 10 * time.Second},
		{10 * time.Second, 10 * time.Second, false, 10 * time.Second, 10 * time.Second},
		{100 * time.Millisecond, 10 * time.Second, true, 100 * time.Millisecond, 200 * time.Millisecond},
		{800 * time.Millisecond, 10 * time.Second, true, 800 * time.Millisecond, time.Second},
		{8 * time.Second, 10 * time.Second, true, time.Second, time.Second},
		{8 * time.Second, 500 * time.Millisecond, true, 500 * time.Millisecond, 500 * time.Millisecond},
	} {
		now, next := nextBackoff(tc.cur, tc.max, tc.full)
		require.Equal(t, []time.Duration{tc.now, tc.next}, []time.Duration{now, next}, "%+v", tc)
	}
}
