package config

import (
	"encoding/base64"
	"fmt"
	"strings"
	"testing"
	"unicode/utf8"

	"github.com/stretchr/testify/require"
)

func TestRedactTextMasks(t *testing.T) {
	tests := []struct{ name, in, want string }{
		{"url password in an http error",
			`Get "https://user:pw@api.example.com/v1?api_key=abc123": dial tcp 10.0.0.1:443: connect: connection refused`,
			`Get "https://user:xxxxx@api.example.com/v1?api_key=xxxxx": dial tcp 10.0.0.1:443: connect: connection refused`},
		{"url token", "nats: dial nats://s3cretT0ken@n1:4222: i/o timeout", "nats: dial nats://xxxxx@n1:4222: i/o timeout"},
		{"url password holding @", "connect postgres://baton:p@ss@db:5432/x failed", "connect postgres://baton:xxxxx@db:5432/x failed"},
		{"url empty password", "postgres://baton:@db/x", "postgres://baton:xxxxx@db/x"},
		{"two urls", "nats://a:one@n1:4222, tls://two@n2:4222", "nats://a:xxxxx@n1:4222, tls://xxxxx@n2:4222"},
		{"url in parentheses", "(see https://u:pw@h/p)", "(see https://u:xxxxx@h/p)"},
		{"url without scheme", "connect app:pa=ss@127.0.0.1:5432/db: refused", "connect app:xxxxx@127.0.0.1:5432/db: refused"},
		{"url without scheme first", "u:t0ken==@n1:4222,n2:4222", "u:xxxxx@n1:4222,n2:4222"},
		{"url without scheme quoted, password holding @", `dial "u:p@ss@h:1"`, `dial "u:xxxxx@h:1"`},
		{"url without scheme after =", "BATON_NATS_URL=u:s3cret@n", "BATON_NATS_URL=u:xxxxx@n"},
		{"pq password pair", "pq: password authentication failed for user \"baton\" (host=db password=hunter2 dbname=x)",
			"pq: password authentication failed for user \"baton\" (host=db password=xxxxx dbname=x)"},
		{"quoted conninfo password", "host=db password='a b c' user=u", "host=db password='xxxxx' user=u"},
		{"query parameters", "/v1/items?limit=5&access_token=abc.def-1&sig=XyZ%2B&page=2",
			"/v1/items?limit=5&access_token=xxxxx&sig=xxxxx&page=2"},
		{"json pair", `{"user":"u","client_secret": "s3 cret","n":1}`, `{"user":"u","client_secret": "xxxxx","n":1}`},
		{"json escaped quote", `{"password":"a\"b c"}`, `{"password":"xxxxx"}`},
		{"go quoted value", `config: invalid value token="t0k en"`, `config: invalid value token="xxxxx"`},
		{"header pair", "X-Api-Key: abc123 rejected", "X-Api-Key: xxxxx rejected"},
		{"yaml pair", "password:hunter2", "password:xxxxx"},
		{"upper-case key", "PGPASSWORD=hunter2 psql", "PGPASSWORD=xxxxx psql"},
		{"key variants", "passwd=a pwd=b apikey=c api-key=d ACCESS_KEY=e private_key=f credentials=g aws_signature=h auth=i",
			"passwd=xxxxx pwd=xxxxx apikey=xxxxx api-key=xxxxx ACCESS_KEY=xxxxx private_key=xxxxx credentials=xxxxx aws_signature=xxxxx auth=xxxxx"},
		{"value ends at separators", "token=a,b;secret=c;x=1 [pwd=d] (pwd=e) {pwd=f}",
			"token=xxxxx,b;secret=xxxxx;x=1 [pwd=xxxxx] (pwd=xxxxx) {pwd=xxxxx}"},
		{"pair inside a non-secret key's value", "unauthorized: password=hunter2", "unauthorized: password=xxxxx"},
		{"authorization bearer", "Authorization: Bearer eyJhbGciOi.eyJzdWIi.sig-_", "Authorization: Bearer xxxxx"},
		{"lower-case bearer", "got 401 for bearer abc123", "got 401 for bearer xxxxx"},
		{"authorization basic", "Authorization: Basic dXNlcjpwYXNz", "Authorization: Basic xxxxx"},
		{"lone basic", "sent basic dXNlcjpwYXNzd29yZA== upstream", "sent basic xxxxx upstream"},
		{"authorization token", "Authorization: token 0123abcd", "Authorization: token xxxxx"},
		{"openai key", "401: Incorrect API key provided: sk-proj-abcdefghijklmnop1234.",
			"401: Incorrect API key provided: sk-xxxxx."},
		{"aws key id", "aws: access key AKIAIOSFODNN7EXAMPLE is not valid", "aws: access key AKIAxxxxx is not valid"},
		{"key id as a token value", "InvalidClientTokenId: AKIAIOSFODNN7EXAMPLE", "InvalidClientTokenId: xxxxx"},
		{"github tokens", "ghp_0123456789abcdefABCDEF0123456789abcd gho_0123456789abcdefAB github_pat_11ABCDEFG0123456789_abcdef",
			"ghp_xxxxx gho_xxxxx github_pat_xxxxx"},
		{"slack token", "slack: invalid_auth for xoxb-1234-5678-abcdEFGH", "slack: invalid_auth for xoxb-xxxxx"},
		{"multi-byte text around a secret", "échec: mot de passe password=hünter2 refusé ✗",
			"échec: mot de passe password=xxxxx refusé ✗"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			require.Equal(t, tt.want, RedactText(tt.in))
		})
	}
}

func TestRedactTextLeavesOrdinaryTextAlone(t *testing.T) {
	for _, in := range []string{
		"",
		"connection refused",
		"timeout after 30s",
		"status=500",
		"dial tcp 127.0.0.1:5432: connect: connection refused",
		`pq: password authentication failed for user "baton"`,
		"FATAL: password authentication failed (SQLSTATE 28P01)",
		"invalid bearer token",
		"basic checks failed",
		"401 Unauthorized: authentication required",
		"oauth2: server response missing access_token",
		`Get "https://api.example.com/v1?limit=5": context deadline exceeded`,
		"mail ops@example.com about https://example.com/a@b",
		"ERROR: ops@example.com at 12:30 (see ops@example.com)",
		"dial tcp [::1]:5432: i/o timeout for u@h",
		"task-0123456789abcdefghij done; disk-0123456789abcdefghij full",
		"sk-short",
		"signal: killed",
		"publish agent.c1.events: nats: timeout",
		"retry 3/5 in 200ms (attempt=3, max=5)",
		"héllo wörld ✓",
	} {
		require.Equal(t, in, RedactText(in), "input %q", in)
	}
}

// secretTemplates are the ways a secret reaches error text, each with one %s and the
// shortest secret RedactText recognises there.
var secretTemplates = []struct {
	format string
	minLen int
}{
	{`Get "https://u:%s@h/p"`, 1},
	{"postgres://baton:%s@db:5432/baton?sslmode=disable", 1},
	{"nats://%s@n:4222", 1},
	{"baton:%s@db:5432/baton", 1},
	{"nats u:%s@n1:4222,n2:4222", 1},
	{"api_key=%s", 1},
	{"/v1?x=1&access_token=%s&y=2", 1},
	{"host=db password=%s dbname=x", 1},
	{"host=db password='%s' dbname=x", 1},
	{`{"client_secret":"%s"}`, 1},
	{"X-Api-Key: %s", 1},
	{"Authorization: Bearer %s", 1},
	{"sk-%s", 16},
	{"ghp_%s", 16},
}

// FuzzRedactText checks that RedactText never panics, keeps valid UTF-8 valid, and hides a
// secret of 8 or more letters and digits put into any of secretTemplates, whatever text
// surrounds it.
func FuzzRedactText(f *testing.F) {
	f.Add("connection refused", "hunter2hunter2")
	f.Add(`token="`, "abcdefgh")
	f.Add("unauthorized:", "S3cretS3cret")
	f.Add("password='", "0123456789abcdef")
	f.Add("\xff\xfe", "AAAAAAAAAAAAAAAA")
	f.Add(`password="`, "0123456789abcdefXYZ")
	f.Fuzz(func(t *testing.T, text, secret string) {
		out := RedactText(text)
		if utf8.ValidString(text) {
			require.True(t, utf8.ValidString(out), "invalid UTF-8 from %q: %q", text, out)
		}
		if len(secret) < 8 || len(text) > 1024 || strings.TrimFunc(secret, isAlphanumeric) != "" {
			return // long texts make each run slow and find nothing new
		}
		inputs := []string{
			"Authorization: Basic " + base64.StdEncoding.EncodeToString([]byte("u:"+secret)),
		}
		for _, tmpl := range secretTemplates {
			if len(secret) >= tmpl.minLen {
				inputs = append(inputs, text+" "+fmt.Sprintf(tmpl.format, secret)+" "+text)
			}
		}
		for _, in := range inputs {
			if strings.Count(in, secret) != 1 {
				continue // the secret is also part of the surrounding text
			}
			require.NotContains(t, RedactText(in), secret, "input %q", in)
		}
	})
}

func isAlphanumeric(r rune) bool {
	return r >= 'a' && r <= 'z' || r >= 'A' && r <= 'Z' || r >= '0' && r <= '9'
}

func BenchmarkRedactText(b *testing.B) {
	in := `handler: Get "https://user:pw@api.example.com/v1?api_key=abc123&limit=5": dial tcp 10.0.0.1:443: ` +
		`connect: connection refused (Authorization: Bearer eyJhbGciOi.eyJzdWIi)`
	for b.Loop() {
		RedactText(in)
	}
}

// Text holding many overlapping pairs and quotes stays linear: each value is read once.
func BenchmarkRedactTextAdversarial(b *testing.B) {
	in := strings.Repeat(`unauthorized: token="password='`, 2000)
	b.SetBytes(int64(len(in)))
	for b.Loop() {
		RedactText(in)
	}
}
