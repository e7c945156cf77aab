package wire

import (
	"net/textproto"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
)

// idPairs are distinct ids that must never share a header value or an outcome Nats-Msg-Id.
// nats.go trims a header value's surrounding whitespace and turns CR and LF into spaces, and
// the "~" form of an encoded id is also a legal plain id.
var idPairs = [][2]string{
	{"r1", "r1 "},
	{"r1", " r1"},
	{"r1", "r1\t"},
	{"r1", "r1\n"},
	{"a\n", "~YQo"},
	{"a b", "a\nb"},
	{"a\rb", "a b"},
	{"~invalid", "\x01" + strings.Repeat("x", 300)},
	{"\x01" + strings.Repeat("x", 300), "\x02" + strings.Repeat("x", 300)},
	{"", "~"},
	{"~", "~~"},
}

// sentAs is a header value as nats.go puts it on the wire and a receiver reads it back.
func sentAs(v string) string {
	return strings.NewReplacer("\r", " ", "\n", " ").Replace(textproto.TrimString(v))
}

func TestHeaderIDsNeverCollide(t *testing.T) {
	for _, p := range idPairs {
		a, b := p[0], p[1]
		require.NotEqual(t, sentAs(OutcomeMsgID(a)), sentAs(OutcomeMsgID(b)), "Nats-Msg-Id of %q and %q", a, b)
		require.NotEqual(t, sentAs(HeaderID(a)), sentAs(HeaderID(b)), "header value of %q and %q", a, b)
		for _, id := range p {
			v := HeaderID(id)
			require.Equal(t, v, sentAs(v), "header value of %q changes on the wire", id)
			back, err := ParseHeaderID(v)
			require.NoError(t, err)
			require.Equal(t, id, back)
		}
	}
}

func TestHeaderIDForms(t *testing.T) {
	for id, want := range map[string]string{
		"r1":                   "r1",
		"baton:reply:0a1b":     "baton:reply:0a1b",
		"conv-42_x.y/z@w=+!#$": "conv-42_x.y/z@w=+!#$",
		"a~b":                  "a~b",
		"~YQo":                 "~fllRbw",
		"~":                    "~fg",
		"":                     "~",
		"a\n":                  "~YQo",
		"r1 ":                  "~cjEg",
		"a b":                  "~YSBi",
		"🙂":                    "~8J-Zgg",
		"bad\xff":              "~YmFk_w",
	} {
		require.Equal(t, want, HeaderID(id), "HeaderID(%q)", id)
		back, err := ParseHeaderID(want)
		require.NoError(t, err, want)
		require.Equal(t, id, back)
	}
	for _, v := range []string{"", "r1 ", " r1", "a b", "~YQo=", "~YQp", "~cjE", "~YQ\no", "~a.b", "🙂", "~~"} {
		_, err := ParseHeaderID(v)
		require.ErrorIs(t, err, ErrInvalidHeaderID, "%q", v)
	}
}

// FuzzHeaderID checks, for any ids a and b: HeaderID(a) survives nats.go unchanged, is
// printable ASCII, and ParseHeaderID gives a back, so distinct ids never share a value (and
// never share an outcome Nats-Msg-Id); and ParseHeaderID never panics and accepts only the
// values HeaderID produces.
func FuzzHeaderID(f *testing.F) {
	for _, p := range idPairs {
		f.Add(p[0], p[1])
		f.Add(HeaderID(p[0]), p[1])
	}
	f.Add("~YQ", "~YR")
	f.Fuzz(func(t *testing.T, a, b string) {
		va := HeaderID(a)
		require.Equal(t, va, sentAs(va), "HeaderID(%q) = %q changes on the wire", a, va)
		for i := 0; i < len(va); i++ {
			require.True(t, va[i] >= '!' && va[i] <= '~', "HeaderID(%q) = %q", a, va)
		}
		back, err := ParseHeaderID(va)
		require.NoError(t, err, "ParseHeaderID(HeaderID(%q))", a)
		require.Equal(t, a, back)
		if a != b {
			require.NotEqual(t, va, HeaderID(b), "%q and %q", a, b)
			require.NotEqual(t, sentAs(OutcomeMsgID(a)), sentAs(OutcomeMsgID(b)), "%q and %q", a, b)
		}

		// Any value: never a panic; accepted only if canonical.
		for _, v := range []string{a, b} {
			id, err := ParseHeaderID(v)
			if err != nil {
				require.ErrorIs(t, err, ErrInvalidHeaderID)
				continue
			}
			require.Equal(t, v, HeaderID(id), "ParseHeaderID(%q) = %q", v, id)
		}
	})
}
