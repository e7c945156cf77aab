package config

import (
	"net/url"
	"regexp"
	"sort"
	"strings"
)

// mask replaces a secret in redacted output.
const mask = "xxxxx"

var schemePattern = regexp.MustCompile(`^[A-Za-z][A-Za-z0-9+.-]*://`)

// Redact returns a connection string with its secrets masked, for logs and error messages.
// It understands
//
//   - URLs (postgres://, postgresql://, nats://, tls://, ws://, wss://): a password in the
//     userinfo becomes xxxxx (user:pass@ → user:xxxxx@), and so does the value of every query
//     parameter whose name ends in "password" (password=, sslpassword=), and of options=
//     when it sets a server setting named like a password (options=-c app.password=...);
//   - NATS server lists (comma-separated, with or without scheme), where a user without a
//     password is a token and is masked whole (nats://s3cret@host → nats://xxxxx@host);
//   - PostgreSQL key=value strings (host=db password='a b'), where the value of every key
//     ending in "password" is masked, and that of options as in URLs.
//
// It errs on the side of masking: the userinfo is everything up to the last '@', so a
// password holding '/', '?', ':', '=' or '@' is still masked, and a key=value string it cannot
// parse is masked from the point where parsing failed. A string with no scheme, no white
// space, an '@' and an '=' (user:pa=ss@host, token==@host, password=a@b) reads as a URL and
// as key=value pairs: what either reading calls a secret is masked.
func Redact(s string) string {
	switch {
	case s == "":
		return ""
	case hasPostgresScheme(s):
		return maskSpans(s, urlSpans(s, 0, false, nil))
	case schemePattern.MatchString(s) || !strings.Contains(s, "="):
		return maskSpans(s, serverListSpans(s))
	case !strings.ContainsFunc(s, isSpaceRune) && strings.Contains(s, "@"):
		return maskSpans(s, append(serverListSpans(s), keyValueSpans(s)...))
	default:
		return maskSpans(s, keyValueSpans(s))
	}
}

func hasPostgresScheme(s string) bool {
	l := strings.ToLower(s)
	return strings.HasPrefix(l, "postgres://") || strings.HasPrefix(l, "postgresql://")
}

// serverListSpans returns the byte ranges of s to mask when s is a comma-separated list of
// NATS server URLs.
func serverListSpans(s string) [][2]int {
	var spans [][2]int
	off := 0
	pieces := strings.Split(s, ",")
	for i, p := range pieces {
		// A password with an unescaped comma splits one URL into pieces: a piece that is
		// not a valid URL, or that comes before a piece holding an '@' with no scheme of
		// its own, may be the start of one (nats://u:000,111@host), so hide all of it but
		// the scheme.
		tailFollows := i+1 < len(pieces) && strings.Contains(pieces[i+1], "@") && !strings.Contains(pieces[i+1], "://")
		if !strings.Contains(p, "@") && (tailFollows || !parses(p)) {
			start := off
			if scheme, _, ok := strings.Cut(p, "://"); ok {
				start += len(scheme) + len("://")
			}
			spans = append(spans, [2]int{start, off + len(p)})
		} else {
			spans = urlSpans(p, off, true, spans)
		}
		off += len(p) + 1
	}
	return spans
}

func parses(p string) bool {
	p = strings.TrimSpace(p)
	if !strings.Contains(p, "://") {
		p = "nats://" + p
	}
	_, err := url.Parse(p)
	return err == nil
}

// urlSpans appends to spans the byte ranges, shifted by off, of the userinfo password (or, with
// userIsSecret, of a user without password: a NATS token) and of the secret query parameters
// of the URL s. The scheme is optional.
//
// The userinfo ends at the last '@' and the query starts at the first '?'. When a '?' comes
// before that '@', either the password holds a '?' or a query value holds an '@'; both
// readings are masked.
func urlSpans(s string, off int, userIsSecret bool, spans [][2]int) [][2]int {
	if scheme, _, ok := strings.Cut(s, "://"); ok {
		off += len(scheme) + len("://")
		s = s[len(scheme)+len("://"):]
	}
	if at := strings.LastIndexByte(s, '@'); at >= 0 {
		if colon := strings.IndexByte(s[:at], ':'); colon >= 0 {
			spans = append(spans, [2]int{off + colon + 1, off + at})
		} else if userIsSecret {
			spans = append(spans, [2]int{off, off + at})
		}
	}
	if q := strings.IndexByte(s, '?'); q >= 0 {
		i := off + q + 1
		for _, pair := range strings.Split(s[q+1:], "&") {
			key, value, hasValue := strings.Cut(pair, "=")
			if k, err := url.QueryUnescape(key); err == nil {
				key = k
			}
			if hasValue && (isSecretKey(key) || isSecretOptions(key, value)) {
				spans = append(spans, [2]int{i + len(pair) - len(value), i + len(pair)})
			}
			i += len(pair) + 1
		}
	}
	return spans
}

// maskSpans replaces each of the byte ranges of s, merged where they overlap, by mask.
func maskSpans(s string, spans [][2]int) string {
	if len(spans) == 0 {
		return s
	}
	sort.Slice(spans, func(i, j int) bool { return spans[i][0] < spans[j][0] })
	var b strings.Builder
	last := 0
	for i := 0; i < len(spans); {
		start, end := spans[i][0], spans[i][1]
		for i++; i < len(spans) && spans[i][0] <= end; i++ {
			end = max(end, spans[i][1])
		}
		b.WriteString(s[last:start])
		b.WriteString(mask)
		last = end
	}
	b.WriteString(s[last:])
	return b.String()
}

// isSecretKey reports whether a connection parameter holds a password (password,
// sslpassword).
func isSecretKey(key string) bool {
	return strings.HasSuffix(strings.ToLower(strings.TrimSpace(key)), "password")
}

// isSecretOptions reports whether a connection parameter is options (the server settings
// sent at connection start, -c name=value ...) and sets one whose name holds "password"
// (options='-c app.password=...'): its value is masked whole, since where one setting ends
// depends on quoting that differs between the two forms of connection strings.
func isSecretOptions(key, value string) bool {
	if !strings.EqualFold(strings.TrimSpace(key), "options") {
		return false
	}
	if v, err := url.QueryUnescape(value); err == nil {
		value = v
	}
	return strings.Contains(strings.ToLower(value), "password")
}

// keyValueSpans returns the byte ranges of s to mask when s is a PostgreSQL key=value
// connection string: the secret values, and what cannot be parsed from the point where
// parsing failed.
func keyValueSpans(s string) [][2]int {
	pairs, failAt := scanKeyValues(s)
	var spans [][2]int
	for _, p := range pairs {
		if isSecretKey(p.key) || isSecretOptions(p.key, s[p.start:p.end]) {
			spans = append(spans, [2]int{p.start, p.end})
		}
	}
	if failAt >= 0 {
		spans = append(spans, [2]int{failAt, len(s)})
	}
	return spans
}

// kvPair is one key=value of a connection string; start and end delimit the value in the
// string, quotes included.
type kvPair struct {
	key        string
	start, end int
}

// scanKeyValues splits a PostgreSQL key=value connection string the way libpq does: pairs
// separated by whitespace, optional whitespace around '=', values either single-quoted
// (backslash escapes ' and \) or unquoted up to the next whitespace (backslash escapes the
// next byte). A key is a word of letters, digits, '_' and '.' (a libpq keyword, or the name
// of a server setting such as search_path or app.tenant): anything else there is a URL
// without its scheme (user:pa=ss@host) or a typo, not a connection string, and the driver
// would send it to the server as a setting's name, which the server's error then quotes. It
// returns the pairs it read and, when the string does not parse, the offset of the pair that
// failed (-1 when it parsed and holds at least one pair).
func scanKeyValues(s string) (pairs []kvPair, failAt int) {
	i := 0
	skipSpace := func() {
		for i < len(s) && isSpace(s[i]) {
			i++
		}
	}
	for {
		skipSpace()
		if i == len(s) {
			if len(pairs) == 0 {
				return nil, 0
			}
			return pairs, -1
		}
		keyStart := i
		for i < len(s) && s[i] != '=' && !isSpace(s[i]) {
			i++
		}
		key := s[keyStart:i]
		skipSpace()
		if !isKeyword(key) || i == len(s) || s[i] != '=' {
			return pairs, keyStart
		}
		i++ // '='
		skipSpace()
		start := i
		if i < len(s) && s[i] == '\'' {
			i++
			closed := false
			for i < len(s) && !closed {
				switch s[i] {
				case '\\':
					i += 2
				case '\'':
					i++
					closed = true
				default:
					i++
				}
			}
			if !closed {
				return pairs, keyStart
			}
		} else {
			for i < len(s) && !isSpace(s[i]) {
				if s[i] == '\\' {
					i++
				}
				i++
			}
			i = min(i, len(s))
		}
		pairs = append(pairs, kvPair{key: key, start: start, end: i})
	}
}

// isKeyword reports whether key may be the key of a key=value connection string.
func isKeyword(key string) bool {
	if key == "" {
		return false
	}
	for i := 0; i < len(key); i++ {
		c := key[i]
		if !(c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9' || c == '_' || c == '.') {
			return false
		}
	}
	return true
}

func isSpaceRune(r rune) bool {
	return r == ' ' || r == '\t' || r == '\n' || r == '\r' || r == '\f' || r == '\v'
}

func isSpace(c byte) bool {
	return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\f' || c == '\v'
}
