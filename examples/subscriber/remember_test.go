package main

import (
	"os"
	"os/exec"
	"testing"

	"github.com/stretchr/testify/require"
)

// --remember is bounded like wire.OutcomeSubscriberConfig.DedupeWindow, and a value out of
// range is refused before the subscriber connects (the NATS URL here has no server).
func TestSubscriberRememberIsBounded(t *testing.T) {
	t.Parallel()
	for _, tt := range []struct {
		remember, stderr string
	}{
		{"0", "--remember must be 1 to 1000000"},
		{"1000001", "--remember must be 1 to 1000000"},
		{"9223372036854775807", "--remember must be 1 to 1000000"},
	} {
		cmd := exec.Command(subscriberBinary(t), "--remember", tt.remember)
		cmd.Env = append(os.Environ(), "BATON_NATS_URL=nats://127.0.0.1:1")
		out, err := cmd.CombinedOutput()
		require.Error(t, err, "--remember %s", tt.remember)
		require.Contains(t, string(out), tt.stderr, "--remember %s", tt.remember)
		require.NotContains(t, string(out), "127.0.0.1:1", "--remember %s: it connected first", tt.remember)
	}
}
