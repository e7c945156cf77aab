package config

import (
	"fmt"
	"log/slog"
	"net/url"
	"os"
	"os/exec"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
)

func TestRedact(t *testing.T) {
	tests := []struct{ name, in, want string }{
		{"empty", "", ""},
		{"postgres no userinfo", "postgres://db:5432/baton?sslmode=disable", "postgres://db:5432/baton?sslmode=disable"},
		{"postgres user only", "postgres://baton@db/baton", "postgres://baton@db/baton"},
		{"postgres password", "postgres://baton:s3cret@db:5432/baton", "postgres://baton:xxxxx@db:5432/baton"},
		{"postgresql scheme", "postgresql://baton:s3cret@db/baton", "postgresql://baton:xxxxx@db/baton"},
		{"upper-case scheme", "POSTGRES://baton:s3cret@db/baton", "POSTGRES://baton:xxxxx@db/baton"},
		{"empty password", "postgres://baton:@db/baton", "postgres://baton:xxxxx@db/baton"},
		{"escaped password", "postgres://baton:s%40cr%2Fet@db/baton", "postgres://baton:xxxxx@db/baton"},
		{"password with raw @", "postgres://baton:s@cret@db/baton", "postgres://baton:xxxxx@db/baton"},
		{"password with raw / and ?", "postgres://baton:s/c?ret@db/baton", "postgres://baton:xxxxx@db/baton"},
		{"multi-host", "postgres://baton:s3cret@db1:5432,db2:5432/baton", "postgres://baton:xxxxx@db1:5432,db2:5432/baton"},
		{"query password", "postgres://db/baton?user=baton&password=s3cret&sslmode=require",
			"postgres://db/baton?user=baton&password=xxxxx&sslmode=require"},
		{"query sslpassword", "postgres://u:p@db/baton?sslpassword=s3cret", "postgres://u:xxxxx@db/baton?sslpassword=xxxxx"},
		{"query key escaped", "postgres://db/baton?pass%77ord=s3cret", "postgres://db/baton?pass%77ord=xxxxx"},
		{"query key upper-case", "postgres://db/baton?PASSWORD=s3cret", "postgres://db/baton?PASSWORD=xxxxx"},
		{"@ in a query value", "postgres://db/baton?application_name=a@b&password=s3cret",
			"postgres://db/baton?application_name=a@b&password=xxxxx"},
		{"password with raw ? and a password key", "postgres://u:s3c?a=1&password=ret@db/x", "postgres://u:xxxxx"},
		{"unix socket", "postgresql:///baton?host=/run/postgresql&password=s3cret",
			"postgresql:///baton?host=/run/postgresql&password=xxxxx"},

		{"nats no userinfo", "nats://127.0.0.1:4222", "nats://127.0.0.1:4222"},
		{"nats user and password", "nats://baton:s3cret@n:4222", "nats://baton:xxxxx@n:4222"},
		{"nats token", "nats://s3cret@n:4222", "nats://xxxxx@n:4222"},
		{"nats list", "nats://a:s3cret@n1:4222, tls://t0ken@n2:4222,nats://n3:4222",
			"nats://a:xxxxx@n1:4222, tls://xxxxx@n2:4222,nats://n3:4222"},
		{"nats without scheme", "baton:s3cret@n1:4222,n2:4222", "baton:xxxxx@n1:4222,n2:4222"},
		{"nats websocket", "wss://baton:s3cret@n:443/path", "wss://baton:xxxxx@n:443/path"},
		{"nats password with comma", "nats://baton:s3c,ret@n:4222", "nats://xxxxx,xxxxx@n:4222"},
		{"plain host", "localhost:4222", "localhost:4222"},

		{"key=value no password", "host=db dbname=baton user=baton", "host=db dbname=baton user=baton"},
		{"key=value password", "host=db password=s3cret dbname=baton", "host=db password=xxxxx dbname=baton"},
		{"key=value quoted", "host=db password='s3 cr\\'et' dbname=baton", "host=db password=xxxxx dbname=baton"},
		{"key=value spaces around =", "host = db password = s3cret", "host = db password = xxxxx"},
		{"key=value escaped space", `password=s3\ cret host=db`, "password=xxxxx host=db"},
		{"key=value sslpassword", "sslpassword=s3cret host=db", "sslpassword=xxxxx host=db"},
		{"key=value at end", "host=db password=s3cret", "host=db password=xxxxx"},
		{"key=value password empty quoted", "host=db password='' user=u", "host=db password=xxxxx user=u"},
		{"key=value unterminated quote", "host=db password='s3cret", "host=db xxxxx"},
		{"key=value missing =", "host=db password s3cret", "host=db xxxxx"},
		{"key=value after the secret breaks", "password=s3cret host", "password=xxxxx xxxxx"},
		{"key=value with URL in value", "host=db options='-c x=nats://a' password=s3cret",
			"host=db options='-c x=nats://a' password=xxxxx"},
		{"key=value server setting with a dot", "host=db app.tenant=t1 password=s3cret", "host=db app.tenant=t1 password=xxxxx"},
		// options sets server settings at connection start; one named like a password is one.
		{"key=value options setting a password", "host=db options='-c app.password=s3cret' user=u",
			"host=db options=xxxxx user=u"},
		{"key=value options unquoted", `options=-capp.password=s3cret host=db`, "options=xxxxx host=db"},
		{"query options setting a password", "postgres://u@db/baton?options=-c%20app.password%3Ds3cret&sslmode=require",
			"postgres://u@db/baton?options=xxxxx&sslmode=require"},
		{"query options escaped key", "postgres://db/baton?opt%69ons=-c+app.PASSWORD=s3cret", "postgres://db/baton?opt%69ons=xxxxx"},
		{"query options without a password", "postgres://db/baton?options=-c%20search_path%3Dx", "postgres://db/baton?options=-c%20search_path%3Dx"},
		{"key=value key that is no word", "host=db us:er=s3cret", "host=db xxxxx"},

		// No scheme, no white space, an '@' and an '=': a URL and key=value pairs at once.
		{"no scheme password holding =", "baton:pa=s3cret@db:5432/baton", "xxxxx"},
		{"no scheme nats user and password holding =", "baton:pa=s3cret@n:4222", "xxxxx"},
		{"no scheme nats token holding =", "t0ken==@n:4222", "xxxxx@n:4222"},
		{"no scheme token list", "n1:4222,t0ken==@n2:4222", "xxxxx"},
		{"password pair holding @", "password=s3c@ret", "xxxxx"},
		{"password pair holding @ before a host", "password=s3cret@x", "xxxxx"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got := Redact(tt.in)
			require.Equal(t, tt.want, got)
			for _, secret := range []string{"s3cret", "s3 cr", "cret", "t0ken", "s3c@ret", "pa=s3"} {
				if strings.Contains(tt.in, secret) {
					require.NotContains(t, got, secret)
				}
			}
		})
	}
}

// A password set through the URL encoder, whatever it holds, never survives Redact, with or
// without the URL's scheme.
func FuzzRedactURLPassword(f *testing.F) {
	f.Add("baton", "s3cret", "db:5432", "postgres")
	f.Add("u", "p@ss/w?rd:#", "n:4222", "nats")
	f.Add("", "s3cret", "[::1]:5432", "postgresql")
	f.Add("u", "pa=ss", "db", "postgres")
	f.Add("", "t0ken==", "n:4222", "nats")
	f.Fuzz(func(t *testing.T, user, password, host, scheme string) {
		if len(password) < 4 || (scheme != "postgres" && scheme != "postgresql" && scheme != "nats" && scheme != "tls") {
			t.Skip()
		}
		u := url.URL{Scheme: scheme, User: url.UserPassword(user, password), Host: host, Path: "/db"}
		raw := u.String()
		enc := strings.TrimPrefix(url.UserPassword("", password).String(), ":")
		rest := strings.Replace(raw, enc, "", 1)
		if strings.Contains(rest, enc) {
			t.Skip() // the password also appears as the user or host
		}
		// The masks are taken out before looking, so that a password of x's is not found in them.
		unmasked := func(s string) string { return strings.ReplaceAll(Redact(s), mask, "\x00") }
		require.NotContains(t, unmasked(raw), enc)
		// The same URL without its scheme, as BATON_NATS_URL takes it (and as a database URL
		// is sometimes mistyped).
		require.NotContains(t, unmasked(strings.TrimPrefix(raw, scheme+"://")), enc)
	})
}

// A key=value string with a quoted password never shows the password.
func FuzzRedactKeyValuePassword(f *testing.F) {
	f.Add("db", "s3cret")
	f.Add("db", `it's \ odd`)
	f.Fuzz(func(t *testing.T, host, password string) {
		if len(password) < 4 || strings.ContainsAny(host, " '\\=\t\n\r\f\v") || host == "" {
			t.Skip()
		}
		quoted := "'" + strings.NewReplacer(`\`, `\\`, `'`, `\'`).Replace(password) + "'"
		raw := "host=" + host + " password=" + quoted + " dbname=baton"
		if strings.Contains("host="+host+" password="+mask+" dbname=baton", password) {
			t.Skip() // the password appears in the rest of the string
		}
		require.NotContains(t, Redact(raw), password)
	})
}

// Config prints and logs its connection strings redacted in every form they may take.
func TestConfigFormatsHideSecrets(t *testing.T) {
	for _, tt := range []struct{ db, nats, secret string }{
		{"postgres://u:pa=s3cret@db/x", "nats://u:pa=s3cret@n:4222", "pa=s3cret"},
		{"u:pa=s3cret@db:5432/x", "u:pa=s3cret@n:4222", "pa=s3cret"},
		{"host=db password='pa=s3cret'", "t0ken==s3cret@n:4222", "s3cret"},
		{"host=db password=t0ken==s3cret", "nats://t0ken==s3cret@n:4222", "s3cret"},
		{"postgres://u:p%40s3cret%3D@db/x", "nats://u:p%40s3cret%3D@n", "s3cret"},
	} {
		c := Config{DatabaseURL: tt.db, NATSURL: tt.nats}
		var logged strings.Builder
		slog.New(slog.NewJSONHandler(&logged, nil)).Info("config", "config", c)
		for _, out := range []string{fmt.Sprint(c), fmt.Sprintf("%+v", c), fmt.Sprintf("%#v", c), fmt.Sprintf("%s", c), //nolint:staticcheck // S1025: each verb is tested
			fmt.Sprintf("%v", &c), logged.String()} {
			require.NotContains(t, out, tt.secret)
			require.Contains(t, out, mask)
		}
	}
}

// A Config that reaches a panic is printed through its String method: redacted. The test
// runs itself in a child process that panics.
func TestPanicWithConfigHidesSecrets(t *testing.T) {
	if os.Getenv("BATON_TEST_PANIC_WITH_CONFIG") == "1" {
		panic(Config{DatabaseURL: "postgres://u:pa=s3cret@db/x", NATSURL: "t0ken==s3cret@n:4222"})
	}
	cmd := exec.CommandContext(t.Context(), os.Args[0], "-test.run=^TestPanicWithConfigHidesSecrets$")
	cmd.Env = append(os.Environ(), "BATON_TEST_PANIC_WITH_CONFIG=1")
	out, err := cmd.CombinedOutput()
	require.Error(t, err, "the child panics")
	require.Contains(t, string(out), "panic: ")
	require.Contains(t, string(out), "postgres://u:xxxxx@db/x")
	require.NotContains(t, string(out), "s3cret")
}
