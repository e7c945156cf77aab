package config

import (
	"flag"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
)

func writeFile(t *testing.T, name, data string) string {
	t.Helper()
	p := filepath.Join(t.TempDir(), name)
	require.NoError(t, os.WriteFile(p, []byte(data), 0o600))
	return p
}

// The URLs may come from files: Load reads them, removes one trailing newline, and the value
// is then validated and redacted like one from the variable.
func TestURLsFromFiles(t *testing.T) {
	clearEnv(t)
	t.Setenv(EnvDatabaseURLFile, writeFile(t, "db", "postgres://baton:db-s3cret@db:5432/baton\n"))
	t.Setenv(EnvNATSURLFile, writeFile(t, "nats", "nats://baton:nats-s3cret@n1:4222,nats://n2:4222\n"))
	c, err := Load()
	require.NoError(t, err)
	require.Equal(t, "postgres://baton:db-s3cret@db:5432/baton", c.DatabaseURL)
	require.Equal(t, "nats://baton:nats-s3cret@n1:4222,nats://n2:4222", c.NATSURL)
	require.NoError(t, c.Resolve(), "resolving twice keeps the values")
	require.Equal(t, "nats://baton:nats-s3cret@n1:4222,nats://n2:4222", c.NATSURL)
	for _, s := range []string{c.String(), c.GoString()} {
		require.NotContains(t, s, "s3cret")
	}

	bad := writeFile(t, "bad", "http://n1:4222\n")
	t.Setenv(EnvNATSURLFile, bad)
	_, err = Load()
	require.ErrorContains(t, err, EnvNATSURLFile+" ("+bad+"): scheme must be",
		"a URL from a file is validated like one from the variable, and the error names the file")
}

// A URL and its file both set, or a file that cannot be read, stop Load with an error naming
// the variables and the path and never the contents.
func TestURLFileErrors(t *testing.T) {
	secret := writeFile(t, "db", "postgres://baton:db-s3cret@db:5432/baton")
	missing := filepath.Join(t.TempDir(), "missing")
	// Was: the second line reached the error ("not a valid URL: ...password=s3cret"), which
	// named BATON_DATABASE_URL, not the file.
	twoLines := writeFile(t, "two", "postgres://baton@db/baton\npassword=s3cret\n")
	badURL := writeFile(t, "badurl", "postgres://baton:db-s3cret@db:port/baton\n")
	badNATS := writeFile(t, "badnats", "nats://baton:s3cret@:4222\n")
	for _, tc := range []struct {
		name string
		env  map[string]string
		want []string
	}{
		{"both database", map[string]string{EnvDatabaseURL: "postgres://db/x", EnvDatabaseURLFile: secret},
			[]string{"BATON_DATABASE_URL and BATON_DATABASE_URL_FILE are both set"}},
		{"both NATS", map[string]string{EnvNATSURL: "nats://n:4222", EnvNATSURLFile: secret},
			[]string{"BATON_NATS_URL and BATON_NATS_URL_FILE are both set"}},
		{"missing", map[string]string{EnvDatabaseURLFile: missing}, []string{EnvDatabaseURLFile, missing, "no such file"}},
		{"a directory", map[string]string{EnvNATSURLFile: filepath.Dir(missing)}, []string{EnvNATSURLFile, filepath.Dir(missing)}},
		{"two lines", map[string]string{EnvDatabaseURLFile: twoLines},
			[]string{EnvDatabaseURLFile + " (" + twoLines + "): holds more than one line"}},
		{"an invalid database URL", map[string]string{EnvDatabaseURLFile: badURL},
			[]string{EnvDatabaseURLFile + " (" + badURL + "): not a valid URL (contents not shown)"}},
		{"a NATS URL without host", map[string]string{EnvNATSURLFile: badNATS},
			[]string{EnvNATSURLFile + " (" + badNATS + "): URL has no host (contents not shown)"}},
	} {
		t.Run(tc.name, func(t *testing.T) { requireLoadRefused(t, tc.env, tc.want, "s3cret") })
	}
}

// Flags override the environment: --nats-url wins over BATON_NATS_URL_FILE and
// --nats-url-file over BATON_NATS_URL; both flags at once are refused, naming the flags.
func TestURLFileFlags(t *testing.T) {
	file := writeFile(t, "nats", "nats://from-file:4222\n")
	for _, tc := range []struct {
		name    string
		env     map[string]string
		args    []string
		want    string
		wantErr string
	}{
		{"flag over env file", map[string]string{EnvNATSURLFile: file}, []string{"--nats-url", "nats://from-flag:4222"}, "nats://from-flag:4222", ""},
		{"file flag over env", map[string]string{EnvNATSURL: "nats://from-env:4222"}, []string{"--nats-url-file", file}, "nats://from-file:4222", ""},
		{"both flags", nil, []string{"--nats-url", "nats://from-flag:4222", "--nats-url-file", file}, "",
			"--nats-url and --nats-url-file are both set"},
		{"missing file flag", nil, []string{"--nats-url-file", file + ".missing"}, "", "--nats-url-file (" + file + ".missing)"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			clearEnv(t)
			for k, v := range tc.env {
				t.Setenv(k, v)
			}
			c, err := FromEnv()
			require.NoError(t, err)
			fs := flag.NewFlagSet("test", flag.ContinueOnError)
			c.BindFlags(fs, EnvNATSURL)
			require.NoError(t, fs.Parse(tc.args))
			err = c.Resolve()
			if tc.wantErr != "" {
				require.ErrorContains(t, err, tc.wantErr)
				return
			}
			require.NoError(t, err)
			require.Equal(t, tc.want, c.NATSURL)
		})
	}
}

// Binding BATON_NATS_URL binds its file and the NATS login and TLS flags with it, and
// BATON_DATABASE_URL its file; naming a companion as well is no double definition.
func TestBindFlagsBringsCompanions(t *testing.T) {
	c := defaults()
	fs := flag.NewFlagSet("test", flag.ContinueOnError)
	c.BindFlags(fs, EnvDatabaseURL, EnvNATSURL, EnvNATSCA)
	for _, name := range []string{"database-url", "database-url-file", "nats-url", "nats-url-file", "nats-creds",
		"nats-nkey", "nats-ca", "nats-cert", "nats-key"} {
		require.NotNil(t, fs.Lookup(name), name)
	}
	require.NoError(t, fs.Parse([]string{"--nats-url", "tls://n:4222", "--nats-ca", "/ca.pem", "--nats-creds", "/u.creds"}))
	require.Equal(t, "/ca.pem", c.NATS().CA)
	require.Equal(t, "/u.creds", c.NATS().Creds)
	require.Equal(t, "tls://n:4222", c.NATS().URL)
}

// The NATS login and TLS files are checked at Resolve, so a command stops at startup with
// the variable and the path; settings that do not go together, or that have no NATS URL to
// apply to, are configuration errors.
func TestNATSSecuritySettingsChecked(t *testing.T) {
	missing := filepath.Join(t.TempDir(), "missing.pem")
	junk := writeFile(t, "junk.pem", "junk-contents")
	for _, tc := range []struct {
		name string
		env  map[string]string
		want []string
	}{
		{"CA missing", map[string]string{EnvNATSURL: "tls://n:4222", EnvNATSCA: missing}, []string{EnvNATSCA, missing}},
		{"creds missing", map[string]string{EnvNATSURL: "nats://n:4222", EnvNATSCreds: missing}, []string{EnvNATSCreds, missing}},
		{"nkey junk", map[string]string{EnvNATSURL: "nats://n:4222", EnvNATSNKey: junk}, []string{EnvNATSNKey, junk}},
		{"cert without key", map[string]string{EnvNATSURL: "tls://n:4222", EnvNATSCert: junk}, []string{EnvNATSCert, EnvNATSKey, "go together"}},
		{"key without cert", map[string]string{EnvNATSURL: "tls://n:4222", EnvNATSKey: junk}, []string{EnvNATSCert, EnvNATSKey, "go together"}},
		{"no URL", map[string]string{EnvNATSCA: junk}, []string{"need " + EnvNATSURL}},
	} {
		t.Run(tc.name, func(t *testing.T) { requireLoadRefused(t, tc.env, tc.want, "junk-contents") })
	}
}

// The paths show in logs and in String (they are not secrets); the URL stays redacted.
func TestNATSSettingsLogged(t *testing.T) {
	c := defaults()
	c.NATSURL, c.NATSCA, c.NATSCreds = "nats://u:nats-s3cret@n:4222", "/ca.pem", "/u.creds"
	s := c.String()
	require.True(t, strings.Contains(s, "NATSCA:/ca.pem") && strings.Contains(s, "NATSCreds:/u.creds"), s)
	require.NotContains(t, s, "nats-s3cret")
}

// requireLoadRefused sets env alone and requires Load to fail with an error holding every
// string of want and never secret (a file's contents).
func requireLoadRefused(t *testing.T, env map[string]string, want []string, secret string) {
	t.Helper()
	clearEnv(t)
	for k, v := range env {
		t.Setenv(k, v)
	}
	_, err := Load()
	require.Error(t, err)
	for _, w := range want {
		require.ErrorContains(t, err, w)
	}
	require.NotContains(t, err.Error(), secret)
}
