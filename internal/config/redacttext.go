package config

import (
	"encoding/base64"
	"regexp"
	"strings"
)

// RedactText masks secrets inside free-form text such as an error message, before it is
// stored or logged. Unlike Redact it does not know where a connection string starts or
// ends, so it looks for the shapes secrets take in text and replaces each by xxxxx:
//
//   - the password in the userinfo of any URL (scheme://user:secret@host →
//     scheme://user:xxxxx@host), or the whole userinfo when it has no password, since that
//     is a token (scheme://token@host → scheme://xxxxx@host). The userinfo runs up to the
//     last '@' before whitespace, a quote, '/', '?' or '#';
//   - the password of a URL without its scheme (user:secret@host → user:xxxxx@host), where
//     the user name starts the text or follows whitespace, a quote, an opening bracket, '=',
//     ',' or ';'. Without a ':' it is an e-mail address, or a token that cannot be told from
//     one, and is left alone;
//   - the value of query parameters and key=value, key: value and "key":"value" pairs
//     whose key (case-insensitive) contains password, passwd, pwd, secret, token, api_key,
//     apikey, api-key, access_key, auth, credential, signature or private_key, or is sig.
//     A quoted value is masked up to its closing quote; an unquoted one, or one whose quote
//     is never closed, up to whitespace, '&', ',', ';', a quote or a closing bracket. A
//     value that starts with an authentication scheme (Authorization: Bearer abc) keeps the
//     scheme;
//   - the credentials after Bearer (unless the next word is prose such as "token") and
//     after Basic (when they decode to user:password);
//   - well-known key shapes anywhere: OpenAI (sk-…), AWS access key ids (AKIA…, ASIA…),
//     GitHub (ghp_…, gho_…, ghu_…, ghs_…, ghr_…, github_pat_…) and Slack (xoxb-… and the
//     like) tokens, whose prefix is kept (sk-xxxxx).
//
// It errs on the side of masking: "fetch token: context canceled" becomes
// "fetch token: xxxxx canceled". A few keys that name a failure rather than hold a value
// (unauthorized, authentication, oauth2, …) are left alone. RedactText never fails, runs in
// time linear in len(s) (regular expressions compiled once, RE2: no backtracking), and
// returns valid UTF-8 when s is valid UTF-8.
func RedactText(s string) string {
	var spans [][2]int
	spans = urlUserinfoSpans(s, spans)
	spans = bareUserinfoSpans(s, spans)
	spans = secretPairSpans(s, spans)
	spans = authSchemeSpans(s, spans)
	spans = keyShapeSpans(s, spans)
	return maskSpans(s, spans)
}

// urlUserinfoPattern matches scheme://userinfo@; group 1 is the userinfo. Being greedy, it
// ends at the last '@' before the authority ends.
var urlUserinfoPattern = regexp.MustCompile("[A-Za-z][A-Za-z0-9+.-]*://([^\\s/?#\"'`<>]*)@")

// urlUserinfoSpans appends the password of every URL userinfo in s to spans, or the whole
// userinfo when it holds no ':' (a token).
func urlUserinfoSpans(s string, spans [][2]int) [][2]int {
	if !strings.Contains(s, "://") {
		return spans // most error text holds no URL: skip the slower pattern
	}
	for _, m := range urlUserinfoPattern.FindAllStringSubmatchIndex(s, -1) {
		start, end := m[2], m[3]
		if colon := strings.IndexByte(s[start:end], ':'); colon >= 0 {
			spans = append(spans, [2]int{start + colon + 1, end})
		} else if start < end {
			spans = append(spans, [2]int{start, end})
		}
	}
	return spans
}

// bareUserinfoPattern matches user:password@ with no scheme before it; group 1 is the
// password. Being greedy, it ends at the last '@' before whitespace, a quote, '/', '?' or '#'.
var bareUserinfoPattern = regexp.MustCompile("(?:^|[\\s\"'`(<\\[=,;])[A-Za-z0-9._~%+-]+:([^\\s/?#\"'`<>]*)@")

// bareUserinfoSpans appends the password of every user:password@ without a scheme in s to
// spans.
func bareUserinfoSpans(s string, spans [][2]int) [][2]int {
	if !strings.Contains(s, "@") {
		return spans // most error text holds no userinfo: skip the slower pattern
	}
	for _, m := range bareUserinfoPattern.FindAllStringSubmatchIndex(s, -1) {
		spans = append(spans, [2]int{m[2], m[3]})
	}
	return spans
}

// secretKeyPattern matches the key and separator of a key=value, key: value or
// "key":"value" pair whose key names a secret; group 1 is the key. The value is read by
// valueScanner: a regular expression that matched it too would have to read values holding
// pairs of their own twice, which is quadratic.
var secretKeyPattern = regexp.MustCompile(`(?i)` +
	"[\"'`]?" +
	`([\w.-]*(?:password|passwd|pwd|secret|token|api_?key|api-key|access_?key|auth|credential|signature|private_?key)[\w.-]*|\bsig)` +
	"[\"'`]?" + `\s*[:=]\s*`)

// notSecretKeys are keys that secretKeyPattern matches but that name a failure or a topic
// in error text ("unauthorized: ...") rather than hold a secret.
var notSecretKeys = map[string]bool{
	"unauthorized":    true,
	"unauthenticated": true,
	"authentication":  true,
	"authenticated":   true,
	"authorized":      true,
	"oauth":           true,
	"oauth2":          true,
	"author":          true,
}

// secretPairSpans appends the value of every secret pair in s to spans.
func secretPairSpans(s string, spans [][2]int) [][2]int {
	v := valueScanner{s: s}
	for _, m := range secretKeyPattern.FindAllStringSubmatchIndex(s, -1) {
		if notSecretKeys[strings.ToLower(s[m[2]:m[3]])] {
			continue
		}
		if start, end, ok := v.valueAfterScheme(m[1]); ok && start < end {
			spans = append(spans, [2]int{start, end})
		}
	}
	return spans
}

// valueScanner reads the values of pairs in s. Values may overlap (token: password=x), so
// it remembers the last run it read of each kind: a value starting inside that run ends
// where the run ends, which keeps RedactText linear in len(s).
type valueScanner struct {
	s string
	// bare is the last run of unquoted value bytes read, [from, to).
	bare [2]int
	// quoted holds, per quote byte (" and '), the last quoted value read: its opening quote,
	// where the scan stopped, and whether it stopped at the closing quote.
	quoted [2]struct {
		open, stop int
		closed     bool
	}
}

// valueAfterScheme reads the value starting at i, skipping an authentication scheme
// (Authorization: Bearer abc) when a value follows it.
func (v *valueScanner) valueAfterScheme(i int) (start, end int, ok bool) {
	rest := v.s[i:]
	for _, scheme := range []string{"bearer", "basic", "token"} {
		if len(rest) <= len(scheme) || !strings.EqualFold(rest[:len(scheme)], scheme) {
			continue
		}
		j := i + len(scheme)
		for j < len(v.s) && isRE2Space(v.s[j]) {
			j++
		}
		if j > i+len(scheme) {
			if start, end, ok := v.value(j); ok {
				return start, end, ok
			}
		}
		break
	}
	return v.value(i)
}

// value reads the value starting at i, without its quotes. A double- or single-quoted
// value ends at its closing quote (a backslash escapes the next byte; a newline means it
// was not quoted after all); an unquoted value, or one whose quote is never closed, ends
// at whitespace, '&', ',', ';', a quote or a closing bracket.
func (v *valueScanner) value(i int) (start, end int, ok bool) {
	if i >= len(v.s) {
		return 0, 0, false
	}
	if c := v.s[i]; c == '"' || c == '\'' {
		if end, ok := v.closingQuote(i); ok {
			return i + 1, end, true
		}
		i++
	}
	return i, v.bareEnd(i), true
}

// bareEnd returns where the run of unquoted value bytes starting at i ends.
func (v *valueScanner) bareEnd(i int) int {
	if i >= v.bare[0] && i < v.bare[1] {
		return v.bare[1]
	}
	end := i
	for end < len(v.s) && !isValueEnd(v.s[end]) {
		end++
	}
	v.bare = [2]int{i, end}
	return end
}

// closingQuote returns the index of the quote that closes the one at open. A quote inside
// the last quoted value read of the same kind was escaped in it, so the scans agree from
// the byte after it on and share their end.
func (v *valueScanner) closingQuote(open int) (int, bool) {
	q := &v.quoted[0]
	if v.s[open] == '\'' {
		q = &v.quoted[1]
	}
	if q.stop > 0 && open > q.open && open < q.stop {
		return q.stop, q.closed
	}
	i := open + 1
	for i < len(v.s) && v.s[i] != v.s[open] && v.s[i] != '\n' {
		if v.s[i] == '\\' {
			i++
			if i < len(v.s) && v.s[i] == '\n' {
				break
			}
		}
		i++
	}
	i = min(i, len(v.s))
	q.open, q.stop, q.closed = open, i, i < len(v.s) && v.s[i] == v.s[open]
	return q.stop, q.closed
}

// isValueEnd reports whether c ends an unquoted value.
func isValueEnd(c byte) bool {
	switch c {
	case '&', ',', ';', '"', '\'', '`', ')', ']', '}', '>':
		return true
	}
	return isRE2Space(c)
}

// isRE2Space reports whether c is white space as \s means it in a regular expression.
func isRE2Space(c byte) bool {
	return c == ' ' || c == '\t' || c == '\n' || c == '\f' || c == '\r'
}

// authSchemePattern matches the credentials of an HTTP Authorization header value: group 1
// is the scheme, group 2 the credentials.
var authSchemePattern = regexp.MustCompile(`(?i)\b(bearer|basic)\s+([A-Za-z0-9._~+/-]+=*)`)

// proseAfterBearer are words that follow "bearer" in prose ("invalid bearer token") rather
// than a token.
var proseAfterBearer = map[string]bool{
	"token": true, "tokens": true, "auth": true, "authentication": true, "authorization": true,
	"credential": true, "credentials": true, "realm": true, "scheme": true, "header": true,
}

// authSchemeSpans appends the credentials after Bearer and Basic to spans.
func authSchemeSpans(s string, spans [][2]int) [][2]int {
	for _, m := range authSchemePattern.FindAllStringSubmatchIndex(s, -1) {
		cred := s[m[4]:m[5]]
		if strings.EqualFold(s[m[2]:m[3]], "basic") {
			if !isBasicCredentials(cred) {
				continue // "basic checks failed"
			}
		} else if proseAfterBearer[strings.ToLower(cred)] {
			continue
		}
		spans = append(spans, [2]int{m[4], m[5]})
	}
	return spans
}

// isBasicCredentials reports whether cred is the base64 of user:password (RFC 7617), also
// when it is cut short: it decodes the longest whole prefix and looks for the ':'.
func isBasicCredentials(cred string) bool {
	cred = strings.TrimRight(cred, "=")
	cred = cred[:len(cred)/4*4]
	for _, enc := range []*base64.Encoding{base64.RawStdEncoding, base64.RawURLEncoding} {
		if b, err := enc.DecodeString(cred); err == nil && strings.IndexByte(string(b), ':') >= 0 {
			return true
		}
	}
	return false
}

// keyShapePattern matches API keys by their well-known shape, in one pattern so that the
// text is read once. The one group that matched is the part masked, after the prefix that
// says what kind of key it was.
var keyShapePattern = regexp.MustCompile(`\b(?:` +
	`sk-([A-Za-z0-9_-]{16,})` + // OpenAI and look-alikes
	`|A[KS]IA([0-9A-Z]{16})\b` + // AWS access key id
	`|gh[opusr]_([A-Za-z0-9]{16,})` + // GitHub tokens
	`|github_pat_([A-Za-z0-9_]{16,})` + // GitHub fine-grained tokens
	`|xox[baprs]-([A-Za-z0-9-]{10,})` + // Slack tokens
	`)`)

// keyShapeSpans appends the secret part of every well-known API key in s to spans.
func keyShapeSpans(s string, spans [][2]int) [][2]int {
	for _, m := range keyShapePattern.FindAllStringSubmatchIndex(s, -1) {
		for g := 2; g+1 < len(m); g += 2 {
			if m[g] >= 0 {
				spans = append(spans, [2]int{m[g], m[g+1]})
				break
			}
		}
	}
	return spans
}
