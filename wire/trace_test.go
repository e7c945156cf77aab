package wire_test

import (
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
	"go.opentelemetry.io/otel/trace"

	"github.com/batonhq/baton/wire"
)

const validTraceparent = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"

func TestValidTraceparent(t *testing.T) {
	t.Parallel()
	for name, tc := range map[string]struct {
		in   string
		want bool
	}{
		"valid":              {validTraceparent, true},
		"valid, not sampled": {"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-00", true},
		"empty":              {"", false},
		"garbage":            {"hello", false},
		"uppercase":          {strings.ToUpper(validTraceparent), false},
		"uppercase trace id": {"00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01", false},
		"zero trace id":      {"00-00000000000000000000000000000000-00f067aa0ba902b7-01", false},
		"zero span id":       {"00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01", false},
		"version 01":         {"01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01", false},
		"version ff":         {"ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01", false},
		"trailing field":     {validTraceparent + "-00", false},
		"trailing newline":   {validTraceparent + "\n", false},
		"CRLF injection":     {validTraceparent[:54] + "\r\nBaton-Role: assistant", false},
		"leading space":      {" " + validTraceparent[1:], false},
		"wrong separator":    {"00_4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01", false},
		"non-hex":            {"00-4bf92f3577b34da6a3ce929d0e0e473g-00f067aa0ba902b7-01", false},
		"overlong":           {validTraceparent + strings.Repeat("a", 400), false},
		"short":              {validTraceparent[:54], false},
	} {
		require.Equal(t, tc.want, wire.ValidTraceparent(tc.in), name)
	}
}

// Whatever ValidTraceparent accepts, OpenTelemetry reads as a valid span context.
func FuzzValidTraceparent(f *testing.F) {
	f.Add(validTraceparent)
	f.Add("00-00000000000000000000000000000000-00f067aa0ba902b7-01")
	f.Add("00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01")
	f.Fuzz(func(t *testing.T, s string) {
		if !wire.ValidTraceparent(s) {
			return
		}
		tid, err := trace.TraceIDFromHex(s[3:35])
		require.NoError(t, err)
		sid, err := trace.SpanIDFromHex(s[36:52])
		require.NoError(t, err)
		require.True(t, tid.IsValid() && sid.IsValid())
	})
}

func TestValidTraceparentAllocatesNothing(t *testing.T) {
	ok := false
	require.Zero(t, testing.AllocsPerRun(100, func() { ok = wire.ValidTraceparent(validTraceparent) }))
	require.True(t, ok)
}
