package main

import (
	"testing"

	"github.com/stretchr/testify/require"
)

// An OTEL_* value the relay cannot honour is a usage error (exit 2) before it connects
// anywhere, saying which variable.
func TestRelayRefusesUnsupportedTracesExporter(t *testing.T) {
	t.Setenv("OTEL_SDK_DISABLED", "")
	t.Setenv("OTEL_TRACES_EXPORTER", "console")
	r := runBaton(t, "relay", "--database-url", "postgres://nobody@127.0.0.1:1/none", "--nats-url", "nats://127.0.0.1:1")
	require.Equal(t, 2, r.code, r.stderr)
	require.Contains(t, r.stderr, "OTEL_TRACES_EXPORTER")
}
