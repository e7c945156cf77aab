package relay

import (
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// A standby breaks the relay lock only after its holder has sat idle, without a walsender on
// the slot, for longer than the bound without a break: a streaming or busy holder (a backfill
// runs in a transaction) resets the count, and so does a new holder.
func TestStaleLockNeedsAnUnbrokenIdleSpell(t *testing.T) {
	t0 := time.Unix(1000, 0)
	at := func(s int) time.Time { return t0.Add(time.Duration(s) * time.Second) }
	idle := lockHolder{pid: 7, idle: true}
	for _, tc := range []struct {
		name  string
		polls []lockHolder // one a second from t0
		stale bool         // at the last poll
	}{
		{"streaming holder", rep(lockHolder{pid: 7, idle: true, streaming: true}, 30), false},
		{"busy holder, a backfill", rep(lockHolder{pid: 7}, 30), false},
		{"nobody holds it", rep(lockHolder{}, 30), false},
		{"idle and not streaming for the bound", rep(idle, 11), false}, // 10s exactly
		{"idle and not streaming past the bound", rep(idle, 12), true},
		{"a streaming poll resets the count", append(append(rep(idle, 8), lockHolder{pid: 7, idle: true, streaming: true}), rep(idle, 8)...), false},
		{"a new holder resets the count", append(rep(idle, 8), rep(lockHolder{pid: 8, idle: true}, 8)...), false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			s := staleLock{after: 10 * time.Second}
			var stale bool
			for i, h := range tc.polls {
				stale = s.observe(at(i), h)
			}
			require.Equal(t, tc.stale, stale)
		})
	}
}

func rep(h lockHolder, n int) []lockHolder {
	out := make([]lockHolder, n)
	for i := range out {
		out[i] = h
	}
	return out
}

// Every connection asks the server for TCP keepalives and a user timeout, so that the backends
// of a vanished host end in seconds, not hours; what the database URL sets wins.
func TestKeepalivesAreSentUnlessTheURLSetsThem(t *testing.T) {
	params := map[string]string{"TCP_KEEPALIVES_IDLE": "60", "application_name": "x"}
	setKeepalives(params)
	require.Equal(t, map[string]string{
		"TCP_KEEPALIVES_IDLE":     "60",
		"tcp_keepalives_interval": "5",
		"tcp_keepalives_count":    "3",
		"tcp_user_timeout":        "30000",
		"application_name":        "x",
	}, params)
}
