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
//     parameter whose name ends in "password" (password=, sslpassword=);
//   - NATS server lists (comma-separated, with or without scheme), where a user without a
//     password is a token and is masked whole (nats://s3cret@host → nats://xxxxx@host);
//   - PostgreSQL key=value strings (host=db password='a b'), where the value of every key
//     ending in "password" is masked.
//
// It errs on the side of masking: the userinfo is everything up to the last '@', so a
// password holding '/', '?', ':' or '@' is still masked, and a key=value string it cannot
// parse is masked from the point where parsing failed.
func Redact(s string) string {
	switch {
	case s == "":
		return ""
	case hasPostgresScheme(s):
		return redactURL(s, false)
	case schemePattern.MatchString(s) || !strings.Contains(s, "="):
		return redactServerList(s)
	default:
		return redactKeyValues(s)
	}
}

func hasPostgresScheme(s string) bool {
	l := strings.ToLower(s)
	return strings.HasPrefix(l, "postgres://") || strings.HasPrefix(l, "postgresql://")
}

// redactServerList redacts a comma-separated list of NATS server URLs.
func redactServerList(s string) string {
	pieces := strings.Split(s, ",")
	for i, p := range pieces {
		if !strings.Contains(p, "@") && !parses(p) {
			// A password with an unescaped comma splits one URL into pieces; a piece that is
			// not a valid URL may be a fragment of one, so hide all of it but the scheme.
			scheme, _, ok := strings.Cut(p, "://")
			if ok {
				pieces[i] = scheme + "://" + mask
			} else {
				pieces[i] = mask
			}
			continue
		}
		pieces[i] = redactURL(p, true)
	}
	return strings.Join(pieces, ",")
}

func parses(p string) bool {
	p = strings.TrimSpace(p)
	if !strings.Contains(p, "://") {
		p = "nats://" + p
	}
	_, err := url.Parse(p)
	return err == nil
}

// redactURL masks the userinfo password (or, with userIsSecret, a user without password:
// a NATS token) and secret query parameters of one URL. The scheme is optional.
//
// The userinfo ends at the last '@' and the query starts at the first '?'. When a '?' comes
// before that '@', either the password holds a '?' or a query value holds an '@'; both
// readings are masked.
func redactURL(s string, userIsSecret bool) string {
	prefix, rest := "", s
	if scheme, after, ok := strings.Cut(s, "://"); ok {
		prefix, rest = scheme+"://", after
	}
	var spans [][2]int // byte ranges of rest to mask
	if at := strings.LastIndexByte(rest, '@'); at >= 0 {
		if colon := strings.IndexByte(rest[:at], ':'); colon >= 0 {
			spans = append(spans, [2]int{colon + 1, at})
		} else if userIsSecret {
			spans = append(spans, [2]int{0, at})
		}
	}
	if q := strings.IndexByte(rest, '?'); q >= 0 {
		off := q + 1
		for _, pair := range strings.Split(rest[q+1:], "&") {
			key, value, hasValue := strings.Cut(pair, "=")
			if k, err := url.QueryUnescape(key); err == nil {
				key = k
			}
			if hasValue && isSecretKey(key) {
				start := off + len(pair) - len(value)
				spans = append(spans, [2]int{start, off + len(pair)})
			}
			off += len(pair) + 1
		}
	}
	return prefix + maskSpans(rest, spans)
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

// redactKeyValues masks secret values of a PostgreSQL key=value connection string. What
// cannot be parsed is masked from the point where parsing failed.
func redactKeyValues(s string) string {
	pairs, failAt := scanKeyValues(s)
	var b strings.Builder
	last := 0
	for _, p := range pairs {
		if isSecretKey(p.key) {
			b.WriteString(s[last:p.start])
			b.WriteString(mask)
			last = p.end
		}
	}
	if failAt >= 0 {
		b.WriteString(s[last:failAt])
		b.WriteString(mask)
		return b.String()
	}
	b.WriteString(s[last:])
	return b.String()
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
// next byte). It returns the pairs it read and, when the string does not parse, the offset
// of the pair that failed (-1 when it parsed and holds at least one pair).
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
		if key == "" || i == len(s) || s[i] != '=' {
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

func isSpace(c byte) bool {
	return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\f' || c == '\v'
}
