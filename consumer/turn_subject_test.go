package consumer

import (
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/batonhq/baton/wire"
)

// checkTurnSubject accepts exactly the subject the relay publishes a conversation's turn
// events on (wire.TurnSubject), under the worker's prefix.
func TestCheckTurnSubject(t *testing.T) {
	t.Parallel()
	for _, tt := range []struct {
		name, prefix, subject, conv string
		ok                          bool
	}{
		{"plain", "agent", "agent.turns.c1", "c1", true},
		{"encoded", "agent", "agent.turns.~eCB5", "x y", true},
		{"dotted prefix", "acme.agent", "acme.agent.turns.c1", "c1", true},
		{"another conversation", "agent", "agent.turns.a", "b", false},
		{"another encoded conversation", "agent", "agent.turns.~eCB5", "x z", false},
		{"plain id encoded", "agent", "agent.turns.~YQ", "a", false},    // not canonical: a's token is "a"
		{"encoded id plain", "agent", "agent.turns.x y", "x y", false},  // not a token
		{"more tokens", "agent", "agent.turns.a.b", "a.b", false},       // a.b's token is ~YS5i
		{"case", "agent", "agent.turns.C1", "c1", false},                // ids are case-sensitive
		{"outcome subject", "agent", "agent.outcomes.c1", "c1", false},  // not a turn subject
		{"another prefix", "agent", "other.turns.c1", "c1", false},      // not under the prefix
		{"prefix's neighbour", "agent", "agents.turns.c1", "c1", false}, // not under the prefix
		{"no token", "agent", "agent.turns", "turns", false},            // no conversation
		{"empty token", "agent", "agent.turns.", "", false},             // no conversation
		{"wildcard", "agent", "agent.turns.*", "*", false},              // not a token
		{"padded", "agent", "agent.turns.~eCB5==", "x y", false},        // not canonical
		{"longest", "agent", "agent.turns." + strings.Repeat("x", 200), strings.Repeat("x", 200), true},
		{"too long", "agent", "agent.turns." + strings.Repeat("x", 201), strings.Repeat("x", 201), false}, // over 200 bytes
	} {
		err := checkTurnSubject(tt.prefix, tt.subject, tt.conv)
		if tt.ok {
			require.NoError(t, err, tt.name)
			want, err := wire.TurnSubject(tt.prefix, tt.conv)
			require.NoError(t, err, tt.name)
			require.Equal(t, want, tt.subject, tt.name)
		} else {
			require.Error(t, err, tt.name)
		}
	}
}

// FuzzCheckTurnSubject: whatever subject and conversation id a publisher sends, checkTurnSubject
// accepts the pair only when the subject is the conversation's turn subject, and accepts the
// turn subject of every id a relay can write.
func FuzzCheckTurnSubject(f *testing.F) {
	f.Add("agent.turns.c1", "c1")
	f.Add("agent.turns.~eCB5", "x y")
	f.Add("agent.turns.~YQ", "a")
	f.Add("agent.turns.a", "b")
	f.Add("agent.outcomes.c1", "c1")
	f.Fuzz(func(t *testing.T, subject, conv string) {
		want, wantErr := wire.TurnSubject("agent", conv)
		if err := checkTurnSubject("agent", subject, conv); err == nil && (wantErr != nil || subject != want) {
			t.Fatalf("accepted subject %q for conversation %q, whose turn subject is %q (%v)", subject, conv, want, wantErr)
		}
		if validID(conv) {
			if wantErr != nil {
				t.Fatalf("TurnSubject(%q): %v", conv, wantErr)
			}
			if err := checkTurnSubject("agent", want, conv); err != nil {
				t.Fatalf("refused conversation %q's own subject %q: %v", conv, want, err)
			}
		}
	})
}
