package relay

import (
	"encoding/json"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/batonhq/baton/wire"
)

// The hand-written turn body must be byte for byte what encoding/json writes.
func TestTurnBodyMatchesEncodingJSON(t *testing.T) {
	at := time.Date(2026, 11, 30, 1, 2, 3, 456789000, time.UTC)
	for _, s := range []string{"plain", "a.b", `quo"te\\`, "tab\tnew\nline\r", "\x00\x01\x1f", "<&>", "🙂 ünïcode",
		"line\u2028sep\u2029", "bad\xffutf8", ""} {
		row := wire.TurnEvent{OutboxID: 42, ConversationID: s, MessageID: s + "m", Status: "pending", Attempts: 3, CreatedAt: at}
		want, err := json.Marshal(row)
		require.NoError(t, err)
		wantS, _ := json.Marshal(s)
		require.Equal(t, string(wantS), string(appendJSONString(nil, s)), "string %q", s)
		if s == "" {
			continue // an empty conversation id has no subject
		}
		msg, err := turnMsg("agent", row, "")
		require.NoError(t, err)
		require.Equal(t, string(want), string(msg.Data))
	}
}

func FuzzAppendJSONString(f *testing.F) {
	for _, s := range []string{"", "a", "\"", "\\", "\x00", "\u2028", "\xff", "🙂"} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, s string) {
		want, _ := json.Marshal(s)
		require.Equal(t, string(want), string(appendJSONString(nil, s)))
	})
}

func TestParseTimestamptz(t *testing.T) {
	want := time.Date(2026, 11, 30, 1, 2, 3, 456789000, time.UTC)
	for in, exp := range map[string]time.Time{
		"2026-11-30 01:02:03.456789+00":       want,
		"2026-11-30 06:32:03.456789+05:30":    want,
		"2026-11-29 21:31:51.456789-03:30:12": want,
		"2026-11-30 01:02:03+00":              want.Truncate(time.Second),
	} {
		got, err := parseTimestamptz(in)
		require.NoError(t, err, in)
		require.True(t, exp.Equal(got), "%s: got %v", in, got)
	}
	_, err := parseTimestamptz("yesterday")
	require.Error(t, err)
}
