package natsconn_test

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/nats-io/nkeys"
	"github.com/stretchr/testify/require"

	"github.com/batonhq/baton/internal/testsvc"
	"github.com/batonhq/baton/natsconn"
)

func TestMain(m *testing.M) { os.Exit(testsvc.MainNoLeaks(m)) }

// secrets are the passwords and tokens StartSecureNATS puts in URLs: no error may show them.
var secrets = []string{"pw-s3cret", "wrong-password", "tok-s3cret", "wrong-token"}

// connectBounded runs s.Connect with the options the relay and the workers use, unlimited
// reconnects included, and fails the test if it has not returned within 20s: a refused login
// must end the first connection attempt, not retry it forever.
func connectBounded(t *testing.T, s natsconn.Settings) (*nats.Conn, error) {
	t.Helper()
	type result struct {
		nc  *nats.Conn
		err error
	}
	done := make(chan result, 1)
	go func() {
		nc, err := s.Connect(nats.Name("natsconn-test"), nats.MaxReconnects(-1), nats.ReconnectWait(50*time.Millisecond))
		done <- result{nc, err}
	}()
	select {
	case r := <-done:
		if r.nc != nil {
			t.Cleanup(r.nc.Close)
		}
		return r.nc, r.err
	case <-time.After(20 * time.Second):
		t.Fatal("Connect did not return within 20s")
		return nil, nil
	}
}

// For every way a server makes clients log in: the right settings connect (and reach
// JetStream), the URL alone (no credentials, or no client certificate) is refused, and wrong
// credentials are refused at once with an error that says NATS refused the login, names the
// servers and the setting used, and shows no secret.
func TestConnectLogsInOrIsRefused(t *testing.T) {
	t.Parallel()
	for _, auth := range testsvc.NATSAuths {
		t.Run(string(auth), func(t *testing.T) {
			t.Parallel()
			n := testsvc.StartSecureNATS(t, auth)

			nc, err := connectBounded(t, n.Good)
			require.NoError(t, err)
			js, err := jetstream.New(nc)
			require.NoError(t, err)
			_, err = js.AccountInfo(t.Context())
			require.NoError(t, err, "JetStream through the login")

			bare := natsconn.Settings{URL: natsconn.Servers(n.Good.URL)} // no credentials, no TLS settings
			_, err = connectBounded(t, bare)
			require.Error(t, err, "the server must require the login")

			_, err = connectBounded(t, n.Bad)
			require.Error(t, err)
			msg := err.Error()
			require.Contains(t, msg, natsconn.Servers(n.Bad.URL))
			for _, s := range secrets {
				require.NotContains(t, msg, s)
			}
			switch auth {
			case testsvc.NATSTLS: // the server ends the TLS handshake: no NATS-level refusal
				require.Contains(t, msg, "connect to NATS at")
				require.Contains(t, msg, natsconn.EnvCert+" "+n.Bad.Cert)
				require.Regexp(t, `tls: certificate required|tls error: connection closed by remote after TLS handshake`, msg)
			default:
				require.True(t, natsconn.IsAuthError(err), "%v", err)
				require.ErrorIs(t, err, nats.ErrAuthorization)
				require.Contains(t, msg, "refused the login")
				require.Contains(t, msg, n.Bad.Login())
			}
		})
	}
}

// Every file setting is read at Options: a missing, unreadable or wrong file, or settings that
// do not go together, fail there, naming the variable and the path and never the contents.
func TestOptionsChecksFiles(t *testing.T) {
	t.Parallel()
	n := testsvc.StartSecureNATS(t, testsvc.NATSTLS) // a CA, a certificate and a key to point at
	dir := t.TempDir()
	write := func(name, data string) string {
		p := filepath.Join(dir, name)
		require.NoError(t, os.WriteFile(p, []byte(data), 0o600))
		return p
	}
	const junk = "not-a-secret-but-do-not-print-me"
	junkFile := write("junk", junk)
	missing := filepath.Join(dir, "missing.pem")
	acc, err := nkeys.CreateAccount()
	require.NoError(t, err)
	accSeed, err := acc.Seed()
	require.NoError(t, err)
	accountSeed := write("account.nk", string(accSeed))
	user, err := nkeys.CreateUser()
	require.NoError(t, err)
	userSeed, err := user.Seed()
	require.NoError(t, err)
	seedOnly := write("seed-only.creds", string(userSeed)) // a seed but no JWT

	for _, tc := range []struct {
		name string
		s    natsconn.Settings
		want []string
	}{
		{"creds missing", natsconn.Settings{Creds: missing}, []string{natsconn.EnvCreds, missing, "no such file"}},
		{"creds junk", natsconn.Settings{Creds: junkFile}, []string{natsconn.EnvCreds, junkFile, "no valid user JWT"}},
		{"creds without JWT", natsconn.Settings{Creds: seedOnly}, []string{natsconn.EnvCreds, seedOnly, "JWT"}},
		{"nkey missing", natsconn.Settings{NKey: missing}, []string{natsconn.EnvNKey, missing, "no such file"}},
		{"nkey junk", natsconn.Settings{NKey: junkFile}, []string{natsconn.EnvNKey, junkFile, "no nkey seed"}},
		{"nkey of an account", natsconn.Settings{NKey: accountSeed}, []string{natsconn.EnvNKey, accountSeed, "no user nkey seed"}},
		{"creds and nkey", natsconn.Settings{Creds: n.Good.Cert, NKey: n.Good.Cert}, []string{natsconn.EnvCreds, natsconn.EnvNKey, "both set"}},
		{"CA missing", natsconn.Settings{CA: missing}, []string{natsconn.EnvCA, missing, "no such file"}},
		{"CA junk", natsconn.Settings{CA: junkFile}, []string{natsconn.EnvCA, junkFile}},
		{"cert without key", natsconn.Settings{Cert: n.Good.Cert}, []string{natsconn.EnvCert, natsconn.EnvKey, "go together"}},
		{"key without cert", natsconn.Settings{Key: n.Good.Key}, []string{natsconn.EnvCert, natsconn.EnvKey, "go together"}},
		{"cert missing", natsconn.Settings{Cert: missing, Key: n.Good.Key}, []string{natsconn.EnvCert, missing}},
		{"key of another cert", natsconn.Settings{Cert: n.Good.Cert, Key: n.Bad.Key}, []string{natsconn.EnvCert, natsconn.EnvKey, n.Bad.Key}},
		{"cert junk", natsconn.Settings{Cert: junkFile, Key: n.Good.Key}, []string{natsconn.EnvCert, junkFile}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			opts, err := tc.s.Options()
			require.Error(t, err)
			require.Nil(t, opts)
			for _, w := range tc.want {
				require.Contains(t, err.Error(), w)
			}
			require.NotContains(t, err.Error(), junk)
			require.NotContains(t, err.Error(), string(userSeed))
			require.NotContains(t, err.Error(), string(accSeed))
		})
	}

	opts, err := natsconn.Settings{URL: "nats://127.0.0.1:4222"}.Options()
	require.NoError(t, err)
	require.Empty(t, opts, "no settings, no options")
	opts, err = n.Good.Options()
	require.NoError(t, err)
	require.Len(t, opts, 2, "a CA and a client certificate")
}

// ValueOrFile reads the file, removes one trailing newline and no more, and refuses both
// settings at once, an unreadable file and an empty one, naming the variable and the path.
func TestValueOrFile(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	write := func(name, data string, mode os.FileMode) string {
		p := filepath.Join(dir, name)
		require.NoError(t, os.WriteFile(p, []byte(data), mode))
		return p
	}
	const url = "nats://baton:pw-s3cret@127.0.0.1:4222"
	for _, tc := range []struct {
		name, value, path string
		want              string
		wantErr           []string
	}{
		{"neither", "", "", "", nil},
		{"value", url, "", url, nil},
		{"file", "", write("plain", url, 0o600), url, nil},
		{"one newline trimmed", "", write("nl", url+"\n", 0o600), url, nil},
		{"one CRLF trimmed", "", write("crlf", url+"\r\n", 0o600), url, nil},
		{"only one newline trimmed", "", write("nlnl", url+"\n\n", 0o600), url + "\n", nil},
		{"spaces kept", "", write("sp", " "+url+" ", 0o600), " " + url + " ", nil},
		{"both", url, write("both", url, 0o600), "", []string{"BATON_NATS_URL and BATON_NATS_URL_FILE are both set"}},
		{"missing", "", filepath.Join(dir, "nope"), "", []string{"BATON_NATS_URL_FILE", filepath.Join(dir, "nope"), "no such file"}},
		{"a directory", "", dir, "", []string{"BATON_NATS_URL_FILE", dir}},
		{"empty", "", write("empty", "\n", 0o600), "", []string{"BATON_NATS_URL_FILE", filepath.Join(dir, "empty"), "empty"}},
		// A path that names a log, an image or a device by mistake is refused, not read whole.
		{"too large", "", write("large", strings.Repeat(url+",", 1<<20/len(url)+1), 0o600), "",
			[]string{"BATON_NATS_URL_FILE", filepath.Join(dir, "large"), "larger than 1 MiB"}},
		{"a device that never ends", "", "/dev/zero", "", []string{"BATON_NATS_URL_FILE", "/dev/zero", "larger than 1 MiB"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got, err := natsconn.ValueOrFile(natsconn.EnvURL, tc.value, natsconn.EnvURLFile, tc.path)
			if tc.wantErr == nil {
				require.NoError(t, err)
				require.Equal(t, tc.want, got)
				return
			}
			require.Error(t, err)
			for _, w := range tc.wantErr {
				require.Contains(t, err.Error(), w)
			}
			require.NotContains(t, err.Error(), "pw-s3cret")
		})
	}
	if os.Geteuid() != 0 { // root reads any file
		unreadable := write("unreadable", url, 0o000)
		_, err := natsconn.ValueOrFile(natsconn.EnvURL, "", natsconn.EnvURLFile, unreadable)
		require.ErrorContains(t, err, "permission denied")
		require.ErrorContains(t, err, unreadable)
	}
}

// Servers and Login describe a connection without its secrets.
func TestServersAndLoginShowNoSecret(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		s           natsconn.Settings
		servers     string
		login       string
		mustNotShow string
	}{
		{natsconn.Settings{URL: "nats://baton:pw-s3cret@a:4222,tls://b:4223"}, "nats://a:4222,tls://b:4223", "user and password from the URL", "pw-s3cret"},
		{natsconn.Settings{URL: "tok-s3cret@a:4222"}, "nats://a:4222", "token from the URL", "tok-s3cret"},
		{natsconn.Settings{URL: "nats://a:4222", Creds: "/run/u.creds", CA: "/ca.pem"}, "nats://a:4222",
			"user JWT from BATON_NATS_CREDS /run/u.creds, server verified with BATON_NATS_CA /ca.pem", ""},
		{natsconn.Settings{URL: "nats://a:4222", NKey: "/u.nk", Cert: "/c.pem", Key: "/k.pem"}, "nats://a:4222",
			"nkey from BATON_NATS_NKEY /u.nk, client certificate BATON_NATS_CERT /c.pem", ""},
		{natsconn.Settings{URL: "nats://a:4222"}, "nats://a:4222", "no credentials", ""},
		{natsconn.Settings{URL: "tls://a:4222", CA: "/ca.pem", Cert: "/c.pem", Key: "/k.pem"}, "tls://a:4222",
			"client certificate BATON_NATS_CERT /c.pem, server verified with BATON_NATS_CA /ca.pem", ""},
		{natsconn.Settings{URL: "nats://a:4222,nats://b:%zz"}, "nats://a:4222,(invalid URL)", "no credentials", "%zz"},
	} {
		require.Equal(t, tc.servers, natsconn.Servers(tc.s.URL))
		require.Equal(t, tc.login, tc.s.Login())
		if tc.mustNotShow != "" {
			require.NotContains(t, natsconn.Servers(tc.s.URL)+tc.s.Login(), tc.mustNotShow)
		}
	}
}

// Environ passes the settings to a child process, leaving out the empty ones.
func TestEnviron(t *testing.T) {
	t.Parallel()
	s := natsconn.Settings{URL: "nats://a:4222", Creds: "/u.creds", CA: "/ca.pem"}
	require.Equal(t, []string{"BATON_NATS_URL=nats://a:4222", "BATON_NATS_CREDS=/u.creds", "BATON_NATS_CA=/ca.pem"}, s.Environ())
	require.True(t, s.Secure())
	require.False(t, natsconn.Settings{URL: "nats://a:4222"}.Secure())
	require.False(t, strings.Contains(strings.Join(natsconn.Settings{}.Environ(), ""), "="))
}

// A URL that does not parse is refused without quoting it: the text of url.Error would show
// the password.
func TestConnectNeverQuotesTheURL(t *testing.T) {
	t.Parallel()
	_, err := natsconn.Settings{URL: "nats://baton:pw-s3cret@127.0.0.1:%zz"}.Connect()
	require.ErrorContains(t, err, "a server URL does not parse")
	require.NotContains(t, err.Error(), "pw-s3cret")
}
