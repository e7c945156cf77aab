package wire

import (
	"encoding/base64"
	"strings"
	"testing"
	"unicode"
	"unicode/utf8"

	"github.com/stretchr/testify/require"
)

// requireTokenCharset asserts that tok is one NATS subject token that cannot
// act as a wildcard or split a subject: non-empty, at most maxTokenLen bytes,
// only [A-Za-z0-9_-], plus "~" as its first byte only. It is a plain loop
// rather than a chain of require calls so the fuzz targets stay fast.
func requireTokenCharset(t testing.TB, tok string) {
	t.Helper()
	if tok == "" || len(tok) > maxTokenLen {
		t.Fatalf("token %q has length %d, want 1..%d", tok, len(tok), maxTokenLen)
	}
	for i, r := range tok {
		switch {
		case r == '.' || r == '*' || r == '>' || unicode.IsSpace(r):
			t.Fatalf("token %q has %q at %d", tok, r, i)
		case i == 0 && r == '~':
		case r >= utf8.RuneSelf || !isPlainByte(byte(r)):
			t.Fatalf("token %q has %q at %d, outside the alphabet", tok, r, i)
		}
	}
}

// hostileIDs are valid conversation ids chosen to break a naive encoding.
// want is the exact token: it pins the wire format other programs rely on.
var hostileIDs = []struct {
	name string
	id   string
	want string
}{
	{"plain letters", "abc", "abc"},
	{"plain full alphabet", "AZaz09_-", "AZaz09_-"},
	{"looks like base64", "YWJj", "YWJj"},
	{"single dash", "-", "-"},
	{"single underscore", "_", "_"},
	{"200-byte plain", strings.Repeat("x", 200), strings.Repeat("x", 200)},
	{"dot", "a.b", "~YS5i"},
	{"star wildcard", "*", "~Kg"},
	{"gt wildcard", ">", "~Pg"},
	{"inner space", "a b", "~YSBi"},
	{"single space", " ", "~IA"},
	{"tab", "\t", "~CQ"},
	{"newline", "\n", "~Cg"},
	{"emoji", "🙂", "~8J-Zgg"},
	{"accented", "é", "~w6k"},
	{"looks encoded", "~abc", "~fmFiYw"},
	{"bare mark", "~", "~fg"},
	{"encoding of another id", "~YS5i", "~fllTNWk"},
	{"NUL byte", "\x00", "~AA"},
	{"embedded NUL", "a\x00b", "~YQBi"},
	{"invalid UTF-8", "\xff\xfe", "~__4"},
	{"whole subject", "agent.turns.x", "~YWdlbnQudHVybnMueA"},
	{"200-byte emoji-ish", strings.Repeat("🙂", 50), "~" + base64.RawURLEncoding.EncodeToString([]byte(strings.Repeat("🙂", 50)))},
	{"200-byte plain but one dot", strings.Repeat("x", 199) + ".", "~" + base64.RawURLEncoding.EncodeToString([]byte(strings.Repeat("x", 199)+"."))},
}

func TestToken(t *testing.T) {
	t.Parallel()
	for _, tc := range hostileIDs {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			tok, err := Token(tc.id)
			require.NoError(t, err)
			require.Equal(t, tc.want, tok)
			requireTokenCharset(t, tok)

			// Plain ids are their own token; everything else is marked.
			plain := isPlain(tc.id)
			require.Equal(t, plain, tok == tc.id)
			require.Equal(t, !plain, strings.HasPrefix(tok, "~"))

			got, err := ParseToken(tok)
			require.NoError(t, err)
			require.Equal(t, tc.id, got)
		})
	}
}

func TestTokenLengths(t *testing.T) {
	t.Parallel()
	require.Len(t, strings.Repeat("🙂", 50), MaxConversationIDLen)

	for _, id := range []string{strings.Repeat("x", MaxConversationIDLen), strings.Repeat("\xff", MaxConversationIDLen)} {
		tok, err := Token(id)
		require.NoError(t, err)
		requireTokenCharset(t, tok)
	}
	tok, err := Token(strings.Repeat("\xff", MaxConversationIDLen))
	require.NoError(t, err)
	require.Len(t, tok, maxTokenLen, "the longest id gives the longest token")
}

func TestTokenRejects(t *testing.T) {
	t.Parallel()
	for name, id := range map[string]string{
		"empty":               "",
		"201-byte plain":      strings.Repeat("x", 201),
		"201-byte non-plain":  strings.Repeat("🙂", 50) + ".",
		"much too long":       strings.Repeat("a.b", 1000),
		"201-byte whitespace": strings.Repeat(" ", 201),
	} {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			tok, err := Token(id)
			require.ErrorIs(t, err, ErrInvalidConversationID)
			require.Empty(t, tok)

			_, err = TurnSubject("agent", id)
			require.ErrorIs(t, err, ErrInvalidConversationID)
			_, err = OutcomeSubject("agent", id)
			require.ErrorIs(t, err, ErrInvalidConversationID)
		})
	}
}

// TestTokenDistinct checks that no two ids share a token, including ids that
// are themselves the tokens of other ids.
func TestTokenDistinct(t *testing.T) {
	t.Parallel()
	ids := map[string]bool{}
	for _, tc := range hostileIDs {
		ids[tc.id] = true
		if len(tc.want) <= MaxConversationIDLen {
			ids[tc.want] = true // a token used as an id
		}
	}
	owner := map[string]string{}
	for id := range ids {
		tok, err := Token(id)
		require.NoError(t, err)
		prev, dup := owner[tok]
		require.False(t, dup, "ids %q and %q share token %q", prev, id, tok)
		owner[tok] = id
	}
}

func TestParseTokenRejects(t *testing.T) {
	t.Parallel()
	for name, tok := range map[string]string{
		"empty":                      "",
		"bare mark":                  "~",
		"double mark":                "~~",
		"mark inside":                "ab~c",
		"mark inside payload":        "~YS5i~",
		"encoded plain id":           "~YWJj", // "abc" must be spelled abc
		"encoded plain dash":         "~LQ",   // "-"
		"padding":                    "~YS5i=",
		"padding short":              "~Kg==",
		"non-zero trailing bits":     "~YS5",
		"non-zero trailing bits 2":   "~Kh",
		"impossible length":          "~Y",
		"impossible length 5":        "~YS5iY",
		"std alphabet plus":          "~+/8",
		"std alphabet slash":         "~__/",
		"newline in payload":         "~YS\n5i",
		"carriage return in payload": "~YS5i\r",
		"space in payload":           "~YS 5i",
		"dot":                        "a.b",
		"star":                       "*",
		"gt":                         ">",
		"space":                      "a b",
		"tab":                        "\t",
		"NUL":                        "\x00",
		"non-ASCII":                  "é",
		"invalid UTF-8":              "\xff",
		"201-byte plain":             strings.Repeat("x", 201),
		"too long encoded":           "~" + base64.RawURLEncoding.EncodeToString([]byte(strings.Repeat("\xff", 201))),
		"encoded 201 bytes at limit": "~" + base64.RawURLEncoding.EncodeToString([]byte(strings.Repeat("\xff", 200)+".")),
	} {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			id, err := ParseToken(tok)
			require.ErrorIs(t, err, ErrInvalidToken)
			require.Empty(t, id)
		})
	}
}

func TestValidatePrefix(t *testing.T) {
	t.Parallel()
	for _, p := range []string{"agent", "a", "agent.v1", "Baton_prod-2.agent", "a.b.c.d", "-", "_.-"} {
		require.NoError(t, ValidatePrefix(p), "prefix %q", p)
	}
	for _, p := range []string{
		"", ".", "..", ".agent", "agent.", "a..b",
		"*", ">", "agent.*", "agent.>", "a*", "a>b",
		" ", "agent ", " agent", "a b", "a\tb", "a\nb",
		"~", "agent.~x", "é", "\x00", "\xff", "a/b", "a$b",
	} {
		require.ErrorIs(t, ValidatePrefix(p), ErrInvalidPrefix, "prefix %q", p)
	}
}

func TestSubjects(t *testing.T) {
	t.Parallel()
	for _, prefix := range []string{"agent", "baton.prod"} {
		for _, tc := range hostileIDs {
			turns, err := TurnSubject(prefix, tc.id)
			require.NoError(t, err)
			require.Equal(t, prefix+".turns."+tc.want, turns)

			outcomes, err := OutcomeSubject(prefix, tc.id)
			require.NoError(t, err)
			require.Equal(t, prefix+".outcomes."+tc.want, outcomes)

			// Exactly the prefix's tokens plus kind plus one conversation token.
			require.Len(t, strings.Split(turns, "."), strings.Count(prefix, ".")+3)

			kind, id, err := ParseSubject(prefix, turns)
			require.NoError(t, err)
			require.Equal(t, KindTurns, kind)
			require.Equal(t, tc.id, id)

			kind, id, err = ParseSubject(prefix, outcomes)
			require.NoError(t, err)
			require.Equal(t, KindOutcomes, kind)
			require.Equal(t, tc.id, id)

			require.True(t, strings.HasPrefix(turns, strings.TrimSuffix(StreamFilter(prefix, KindTurns), ">")))
			require.True(t, strings.HasPrefix(outcomes, strings.TrimSuffix(StreamFilter(prefix, KindOutcomes), ">")))
		}
	}
}

func TestSubjectsRejectPrefix(t *testing.T) {
	t.Parallel()
	for _, prefix := range []string{"", "agent.", "agent.*", "a b"} {
		_, err := TurnSubject(prefix, "abc")
		require.ErrorIs(t, err, ErrInvalidPrefix)
		_, err = OutcomeSubject(prefix, "abc")
		require.ErrorIs(t, err, ErrInvalidPrefix)
		_, _, err = ParseSubject(prefix, prefix+".turns.abc")
		require.ErrorIs(t, err, ErrInvalidPrefix)
	}
}

func TestParseSubjectRejects(t *testing.T) {
	t.Parallel()
	for name, subj := range map[string]string{
		"empty":                 "",
		"prefix only":           "agent",
		"prefix dot":            "agent.",
		"no token":              "agent.turns",
		"empty token":           "agent.turns.",
		"unknown kind":          "agent.other.abc",
		"empty kind":            "agent..abc",
		"kind case":             "agent.Turns.abc",
		"other prefix":          "baton.turns.abc",
		"longer prefix":         "agentx.turns.abc",
		"prefix repeated":       "agent.agent.turns.abc",
		"extra token":           "agent.turns.a.b",
		"star token":            "agent.turns.*",
		"gt token":              "agent.turns.>",
		"stream filter":         "agent.turns.>",
		"non-canonical token":   "agent.turns.~YWJj",
		"padded token":          "agent.outcomes.~Kg==",
		"space token":           "agent.turns.a b",
		"leading space":         " agent.turns.abc",
		"trailing dot":          "agent.turns.abc.",
		"token too long":        "agent.turns." + strings.Repeat("x", 201),
		"prefix missing dot":    "agentturns.abc",
		"kind without prefix":   "turns.abc",
		"whitespace after kind": "agent.turns .abc",
	} {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			kind, id, err := ParseSubject("agent", subj)
			require.ErrorIs(t, err, ErrInvalidSubject)
			require.Empty(t, kind)
			require.Empty(t, id)
		})
	}
	_, _, err := ParseSubject("agent", "agent.turns.~YWJj")
	require.ErrorIs(t, err, ErrInvalidToken, "a bad token also wraps ErrInvalidToken")
}

func TestStreamFilter(t *testing.T) {
	t.Parallel()
	require.Equal(t, "agent.turns.>", StreamFilter("agent", KindTurns))
	require.Equal(t, "baton.prod.outcomes.>", StreamFilter("baton.prod", KindOutcomes))
}
