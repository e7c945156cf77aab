package wire

import (
	"encoding/base64"
	"errors"
	"regexp"
	"strings"
	"testing"
)

// plainRE is the rule as DESIGN.md writes it. It serves as the reference the
// byte loop in Token is checked against; the package itself uses no regexp.
var plainRE = regexp.MustCompile(`^[A-Za-z0-9_-]{1,200}$`)

// referenceToken is the encoding exactly as DESIGN.md states it.
func referenceToken(id string) string {
	if plainRE.MatchString(id) {
		return id
	}
	return "~" + base64.RawURLEncoding.EncodeToString([]byte(id))
}

func addSeeds(f *testing.F) {
	for _, tc := range hostileIDs {
		f.Add(tc.id)
		f.Add(tc.want)
	}
	f.Add("")
	f.Add(strings.Repeat("x", 201))
	f.Add("~YWJj")
	f.Add("~YS5")
	f.Add("~Kg==")
	f.Add("~YS\n5i")
}

// FuzzToken checks, for any id: Token fails exactly for empty or over-long
// ids; otherwise the token matches the DESIGN.md reference, is one safe NATS
// token, decodes back to the id (so Token is injective) and the subjects built
// from it parse back to the id.
func FuzzToken(f *testing.F) {
	addSeeds(f)
	f.Fuzz(func(t *testing.T, id string) {
		tok, err := Token(id)
		if len(id) == 0 || len(id) > MaxConversationIDLen {
			if !errors.Is(err, ErrInvalidConversationID) || tok != "" {
				t.Fatalf("Token(%q) = %q, %v; want ErrInvalidConversationID", id, tok, err)
			}
			return
		}
		if err != nil {
			t.Fatalf("Token(%q): %v", id, err)
		}
		if want := referenceToken(id); tok != want {
			t.Fatalf("Token(%q) = %q, reference gives %q", id, tok, want)
		}
		requireTokenCharset(t, tok)
		if plain := plainRE.MatchString(id); plain != (tok == id) || plain == strings.HasPrefix(tok, "~") {
			t.Fatalf("Token(%q) = %q: plain=%v but token is in the wrong space", id, tok, plain)
		}

		got, err := ParseToken(tok)
		if err != nil || got != id {
			t.Fatalf("ParseToken(Token(%q)) = %q, %v", id, got, err)
		}

		for _, build := range []struct {
			kind string
			fn   func(string, string) (string, error)
		}{{KindTurns, TurnSubject}, {KindOutcomes, OutcomeSubject}} {
			subj, err := build.fn("agent", id)
			if err != nil {
				t.Fatalf("%s(agent, %q): %v", build.kind, id, err)
			}
			if want := "agent." + build.kind + "." + tok; subj != want {
				t.Fatalf("%s(agent, %q) = %q, want %q", build.kind, id, subj, want)
			}
			kind, pid, err := ParseSubject("agent", subj)
			if err != nil || kind != build.kind || pid != id {
				t.Fatalf("ParseSubject(agent, %q) = %q, %q, %v; want %q, %q", subj, kind, pid, err, build.kind, id)
			}
		}
	})
}

// FuzzParseToken checks that ParseToken never panics, accepts only canonical tokens
// (Token of its result gives the token back, so no two tokens name one id),
// and that every failure wraps ErrInvalidToken. ParseSubject gets the same input as
// a conversation token and as a whole subject.
func FuzzParseToken(f *testing.F) {
	addSeeds(f)
	f.Add("agent.turns.abc")
	f.Add("agent.outcomes.~YS5i")
	f.Fuzz(func(t *testing.T, token string) {
		id, err := ParseToken(token)
		if err != nil {
			if !errors.Is(err, ErrInvalidToken) || id != "" {
				t.Fatalf("ParseToken(%q) = %q, %v; want ErrInvalidToken", token, id, err)
			}
		} else {
			requireTokenCharset(t, token)
			back, err := Token(id)
			if err != nil || back != token {
				t.Fatalf("ParseToken(%q) = %q, but Token gives %q, %v", token, id, back, err)
			}
		}

		kind, pid, perr := ParseSubject("agent", "agent.turns."+token)
		if (perr == nil) != (err == nil) || pid != id || (perr == nil && kind != KindTurns) {
			t.Fatalf("ParseSubject of token %q = %q, %q, %v; ParseToken gave %q, %v", token, kind, pid, perr, id, err)
		}

		kind, pid, perr = ParseSubject("agent", token)
		if perr != nil {
			if !errors.Is(perr, ErrInvalidSubject) {
				t.Fatalf("ParseSubject(agent, %q): %v does not wrap ErrInvalidSubject", token, perr)
			}
			return
		}
		var rebuilt string
		switch kind {
		case KindTurns:
			rebuilt, err = TurnSubject("agent", pid)
		case KindOutcomes:
			rebuilt, err = OutcomeSubject("agent", pid)
		default:
			t.Fatalf("ParseSubject(agent, %q) gave kind %q", token, kind)
		}
		if err != nil || rebuilt != token {
			t.Fatalf("ParseSubject(agent, %q) = %q, %q, but rebuilding gives %q, %v", token, kind, pid, rebuilt, err)
		}
	})
}
