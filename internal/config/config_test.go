package config

import (
	"bytes"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"strings"
	"testing"
	"time"

	"github.com/caarlos0/env/v11"
	"github.com/stretchr/testify/require"
)

// clearEnv sets every variable to empty, which Load treats as unset, so the tests do not see
// the caller's environment.
func clearEnv(t *testing.T) {
	t.Helper()
	for _, v := range variables {
		t.Setenv(v.env, "")
	}
}

func defaults() Config {
	return Config{SubjectPrefix: "agent", Slot: "baton", Publication: "baton", Schema: "public", PprofAllowRemote: "false", FatalLinger: "2m", LogLevel: "info", LogFormat: "text",
		StreamReplicas: "1", StreamMaxAge: "168h", StreamMaxBytes: "1GiB", StreamMaxMsgs: "1000000", StreamDuplicates: "2m"}
}

func TestLoad(t *testing.T) {
	tests := []struct {
		name string
		env  map[string]string
		want func(*Config) // applied to defaults(); nil when an error is expected
		errs []string      // substrings the error must contain
	}{
		{name: "defaults", want: func(*Config) {}},
		{
			name: "everything set",
			env: map[string]string{
				EnvDatabaseURL:   "postgres://baton:pw@db:5432/baton?sslmode=disable",
				EnvNATSURL:       "nats://n1:4222,nats://n2:4222",
				EnvSubjectPrefix: "acme.agent-1",
				EnvSlot:          "baton_2",
				EnvPublication:   "_baton2",
				EnvMetricsAddr:   ":9090",
				EnvPprofAddr:     "127.0.0.1:6060",
				EnvFatalLinger:   "30s",
				EnvLogLevel:      "DEBUG",
				EnvLogFormat:     "json",
			},
			want: func(c *Config) {
				c.DatabaseURL = "postgres://baton:pw@db:5432/baton?sslmode=disable"
				c.NATSURL = "nats://n1:4222,nats://n2:4222"
				c.SubjectPrefix = "acme.agent-1"
				c.Slot = "baton_2"
				c.Publication = "_baton2"
				c.MetricsAddr = ":9090"
				c.PprofAddr = "127.0.0.1:6060"
				c.FatalLinger = "30s"
				c.LogLevel = "DEBUG"
				c.LogFormat = "json"
			},
		},
		{name: "key=value database URL", env: map[string]string{EnvDatabaseURL: "host=db dbname=baton password='a b'"},
			want: func(c *Config) { c.DatabaseURL = "host=db dbname=baton password='a b'" }},
		{name: "postgresql scheme", env: map[string]string{EnvDatabaseURL: "postgresql:///baton?host=/run/postgresql"},
			want: func(c *Config) { c.DatabaseURL = "postgresql:///baton?host=/run/postgresql" }},
		{name: "NATS URL without scheme", env: map[string]string{EnvNATSURL: "127.0.0.1:4222"},
			want: func(c *Config) { c.NATSURL = "127.0.0.1:4222" }},
		{name: "NATS TLS and websocket", env: map[string]string{EnvNATSURL: "tls://a:4222, wss://b:443"},
			want: func(c *Config) { c.NATSURL = "tls://a:4222, wss://b:443" }},
		{name: "slot of 63", env: map[string]string{EnvSlot: strings.Repeat("s", 63)},
			want: func(c *Config) { c.Slot = strings.Repeat("s", 63) }},
		{name: "metrics on a host", env: map[string]string{EnvMetricsAddr: "127.0.0.1:0"},
			want: func(c *Config) { c.MetricsAddr = "127.0.0.1:0" }},
		{name: "warn level", env: map[string]string{EnvLogLevel: "warn"},
			want: func(c *Config) { c.LogLevel = "warn" }},
		{name: "no linger", env: map[string]string{EnvFatalLinger: "0"},
			want: func(c *Config) { c.FatalLinger = "0" }},
		{name: "linger in hours", env: map[string]string{EnvFatalLinger: "1h30m"},
			want: func(c *Config) { c.FatalLinger = "1h30m" }},

		{name: "slot with capitals", env: map[string]string{EnvSlot: "Baton"},
			errs: []string{`BATON_SLOT: must match ^[a-z0-9_]{1,63}$ (got "Baton")`}},
		{name: "slot of 64", env: map[string]string{EnvSlot: strings.Repeat("s", 64)}, errs: []string{"BATON_SLOT: must match"}},
		{name: "slot with dash", env: map[string]string{EnvSlot: "baton-1"}, errs: []string{"BATON_SLOT: must match"}},
		{name: "publication starting with digit", env: map[string]string{EnvPublication: "1baton"},
			errs: []string{"BATON_PUBLICATION: must match ^[a-z_][a-z0-9_]{0,62}$"}},
		{name: "publication quoted", env: map[string]string{EnvPublication: `"Baton"`}, errs: []string{"BATON_PUBLICATION: must match"}},
		{name: "prefix wildcard", env: map[string]string{EnvSubjectPrefix: "agent.*"},
			errs: []string{`BATON_SUBJECT_PREFIX: must be dot-separated tokens of [A-Za-z0-9_-], no wildcards (got "agent.*")`}},
		{name: "prefix full wildcard", env: map[string]string{EnvSubjectPrefix: "agent.>"}, errs: []string{"BATON_SUBJECT_PREFIX"}},
		{name: "prefix empty token", env: map[string]string{EnvSubjectPrefix: "agent..x"}, errs: []string{"BATON_SUBJECT_PREFIX"}},
		{name: "prefix leading dot", env: map[string]string{EnvSubjectPrefix: ".agent"}, errs: []string{"BATON_SUBJECT_PREFIX"}},
		{name: "prefix with space", env: map[string]string{EnvSubjectPrefix: "my agent"}, errs: []string{"BATON_SUBJECT_PREFIX"}},
		{name: "metrics without port", env: map[string]string{EnvMetricsAddr: "localhost"},
			errs: []string{`BATON_METRICS_ADDR: must be host:port or :port (got "localhost")`}},
		{name: "metrics port out of range", env: map[string]string{EnvMetricsAddr: ":99999"}, errs: []string{"BATON_METRICS_ADDR: port must be"}},
		{name: "pprof without port", env: map[string]string{EnvPprofAddr: "localhost"},
			errs: []string{`BATON_PPROF_ADDR: must be host:port or :port (got "localhost")`}},
		{name: "linger not a duration", env: map[string]string{EnvFatalLinger: "2 minutes"},
			errs: []string{`BATON_FATAL_LINGER: must be a duration such as 2m or 30s (got "2 minutes")`}},
		{name: "linger without unit", env: map[string]string{EnvFatalLinger: "120"}, errs: []string{"BATON_FATAL_LINGER: must be a duration"}},
		{name: "negative linger", env: map[string]string{EnvFatalLinger: "-1s"},
			errs: []string{`BATON_FATAL_LINGER: must not be negative (got "-1s")`}},
		{name: "unknown level", env: map[string]string{EnvLogLevel: "loud"},
			errs: []string{`BATON_LOG_LEVEL: must be debug, info, warn or error (got "loud")`}},
		{name: "unknown format", env: map[string]string{EnvLogFormat: "logfmt"},
			errs: []string{`BATON_LOG_FORMAT: must be text or json (got "logfmt")`}},
		{name: "database URL of another scheme", env: map[string]string{EnvDatabaseURL: "mysql://u@h/db"},
			errs: []string{"BATON_DATABASE_URL: URL must start with postgres:// or postgresql://"}},
		{name: "database URL not a connection string", env: map[string]string{EnvDatabaseURL: "localhost"},
			errs: []string{"BATON_DATABASE_URL: must be a postgres:// URL or key=value pairs"}},
		{name: "database key=value unterminated", env: map[string]string{EnvDatabaseURL: "host=db password='open"},
			errs: []string{"BATON_DATABASE_URL: must be"}},
		{name: "NATS URL of another scheme", env: map[string]string{EnvNATSURL: "http://n:4222"},
			errs: []string{`BATON_NATS_URL: scheme must be nats, tls, ws or wss (got "http")`}},
		{name: "NATS URL without host", env: map[string]string{EnvNATSURL: "nats://:4222"}, errs: []string{"BATON_NATS_URL: URL has no host"}},
		{name: "NATS list with empty entry", env: map[string]string{EnvNATSURL: "nats://a:4222,,nats://b:4222"},
			errs: []string{"BATON_NATS_URL: empty entry"}},
		{
			name: "every problem is reported",
			env:  map[string]string{EnvSlot: "A", EnvPublication: "B", EnvLogFormat: "xml"},
			errs: []string{"BATON_SLOT:", "BATON_PUBLICATION:", "BATON_LOG_FORMAT:"},
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			clearEnv(t)
			for k, v := range tt.env {
				t.Setenv(k, v)
			}
			got, err := Load()
			if tt.want == nil {
				require.Error(t, err)
				for _, s := range tt.errs {
					require.Contains(t, err.Error(), s)
				}
				return
			}
			require.NoError(t, err)
			want := defaults()
			tt.want(&want)
			require.Equal(t, want, got)
		})
	}
}

func TestInvalidURLErrorsHideThePassword(t *testing.T) {
	for _, tt := range []struct{ env, value string }{
		{EnvDatabaseURL, "postgres://u:s3cret@db:port/x"},
		{EnvDatabaseURL, "postgres://u:s3cret/x@db:5432/x?%zz"},
		{EnvNATSURL, "nats://u:s3cret@n:port"},
		{EnvNATSURL, "nats://s3cret@n:4222,http://x"},
	} {
		t.Run(tt.value, func(t *testing.T) {
			clearEnv(t)
			t.Setenv(tt.env, tt.value)
			_, err := Load()
			require.Error(t, err)
			require.Contains(t, err.Error(), tt.env)
			require.NotContains(t, err.Error(), "s3cret")
		})
	}
}

// The struct tags repeat the variable names; this keeps them and the table in step.
func TestTagsMatchVariables(t *testing.T) {
	params, err := env.GetFieldParams(&Config{})
	require.NoError(t, err)
	var keys []string
	for _, p := range params {
		keys = append(keys, p.Key)
	}
	var names []string
	for _, v := range variables {
		names = append(names, v.env)
	}
	require.Equal(t, names, keys)
	for _, v := range variables {
		c := Config{}
		*v.field(&c) = "marker"
		require.Contains(t, c.String(), "marker", "field of %s", v.env)
	}
}

func TestFlagsOverrideEnvironment(t *testing.T) {
	clearEnv(t)
	t.Setenv(EnvDatabaseURL, "postgres://from-env:envpass@db/x")
	t.Setenv(EnvSlot, "env_slot")
	c, err := FromEnv()
	require.NoError(t, err)
	fs := flag.NewFlagSet("test", flag.ContinueOnError)
	c.BindFlags(fs, EnvDatabaseURL, EnvSlot, EnvLogLevel)
	require.NoError(t, fs.Parse([]string{"--slot", "flag_slot", "--log-level=debug"}))
	require.NoError(t, c.Validate())
	require.Equal(t, "postgres://from-env:envpass@db/x", c.DatabaseURL, "unset flags keep the environment's value")
	require.Equal(t, "flag_slot", c.Slot)
	require.Equal(t, slog.LevelDebug, c.Level())

	var usage bytes.Buffer
	fs.SetOutput(&usage)
	fs.PrintDefaults()
	require.Contains(t, usage.String(), "-database-url url")
	require.Contains(t, usage.String(), "[env BATON_DATABASE_URL]")
	require.NotContains(t, usage.String(), "envpass", "usage must not show a password from the environment")
}

// Go's profiles show memory contents, secrets among them: the pprof listener stays on loopback
// unless BATON_PPROF_ALLOW_REMOTE (or --pprof-allow-remote, alone) says otherwise, as the console
// refuses a non-loopback address without auth.
func TestPprofAddrStaysOnLoopback(t *testing.T) {
	for _, tc := range []struct {
		addr, allow string
		args        []string
		err         string
	}{
		{addr: "127.0.0.1:6060"},
		{addr: "[::1]:6060"},
		{addr: "localhost:6060"},
		{addr: "0.0.0.0:6060", err: `BATON_PPROF_ADDR: "0.0.0.0:6060" is not a loopback address`},
		{addr: ":6060", err: `BATON_PPROF_ADDR: ":6060" is not a loopback address`},
		{addr: "10.1.2.3:6060", err: "set BATON_PPROF_ALLOW_REMOTE=true (--pprof-allow-remote)"},
		{addr: "0.0.0.0:6060", allow: "true"},
		{addr: "0.0.0.0:6060", args: []string{"--pprof-allow-remote"}},
		{addr: "0.0.0.0:6060", allow: "true", args: []string{"--pprof-allow-remote=false"}, err: "is not a loopback address"},
		{addr: "127.0.0.1:6060", allow: "yes please", err: `BATON_PPROF_ALLOW_REMOTE: must be true or false (got "yes please")`},
	} {
		t.Run(tc.addr+" "+tc.allow+" "+strings.Join(tc.args, " "), func(t *testing.T) {
			clearEnv(t)
			t.Setenv(EnvPprofAddr, tc.addr)
			if tc.allow != "" {
				t.Setenv(EnvPprofAllowRemote, tc.allow)
			}
			c, err := FromEnv()
			require.NoError(t, err)
			fs := flag.NewFlagSet("test", flag.ContinueOnError)
			c.BindFlags(fs, EnvPprofAddr)
			require.NoError(t, fs.Parse(tc.args))
			err = c.Validate()
			if tc.err == "" {
				require.NoError(t, err)
				return
			}
			require.ErrorContains(t, err, tc.err)
		})
	}
}

func TestErrorsNameTheFlagThatSetTheValue(t *testing.T) {
	clearEnv(t)
	t.Setenv(EnvLogFormat, "xml")
	c, err := FromEnv()
	require.NoError(t, err)
	fs := flag.NewFlagSet("test", flag.ContinueOnError)
	c.BindFlags(fs, EnvSlot, EnvLogFormat)
	require.NoError(t, fs.Parse([]string{"--slot", "Bad"}))
	err = c.Validate()
	require.ErrorContains(t, err, `--slot: must match`)
	require.ErrorContains(t, err, `BATON_LOG_FORMAT: must be text or json`)
}

func TestRequire(t *testing.T) {
	c := defaults()
	require.NoError(t, c.Require(EnvSlot))
	err := c.Require(EnvDatabaseURL, EnvNATSURL)
	require.ErrorContains(t, err, "BATON_DATABASE_URL is not set")
	require.ErrorContains(t, err, "BATON_NATS_URL is not set")

	fs := flag.NewFlagSet("test", flag.ContinueOnError)
	c.BindFlags(fs, EnvDatabaseURL)
	require.EqualError(t, c.Require(EnvDatabaseURL), "BATON_DATABASE_URL is not set: set it or pass --database-url")
	c.DatabaseURL = "postgres:///x"
	require.NoError(t, c.Require(EnvDatabaseURL))
}

func TestFlagName(t *testing.T) {
	require.Equal(t, "database-url", FlagName(EnvDatabaseURL))
	require.Equal(t, "subject-prefix", FlagName(EnvSubjectPrefix))
	require.Equal(t, "slot", FlagName(EnvSlot))
}

func TestSecretsNeverReachOutput(t *testing.T) {
	c := defaults()
	c.DatabaseURL = "postgres://baton:pgs3cret@db:5432/baton?sslpassword=keys3cret"
	c.NATSURL = "nats://natstok3n@n1:4222,nats://user:natss3cret@n2:4222"
	secrets := []string{"pgs3cret", "keys3cret", "natstok3n", "natss3cret"}

	var logs bytes.Buffer
	for _, h := range []slog.Handler{slog.NewTextHandler(&logs, nil), slog.NewJSONHandler(&logs, nil)} {
		slog.New(h).Info("starting", "config", c)
	}
	outputs := map[string]string{
		"logs": logs.String(),
		"%v":   fmt.Sprintf("%v", c),
		"%+v":  fmt.Sprintf("%+v", c),
		"%#v":  fmt.Sprintf("%#v", c),
		"%s":   fmt.Sprintf("%s", c), //nolint:staticcheck // S1025: what the %s verb prints is the point
	}
	for name, out := range outputs {
		for _, s := range secrets {
			require.NotContains(t, out, s, name)
		}
		require.Contains(t, out, "baton:xxxxx@db:5432", name)
	}
	require.Contains(t, logs.String(), "config.database_url=")
	require.Contains(t, logs.String(), `"nats_url":"nats://xxxxx@n1:4222,nats://user:xxxxx@n2:4222"`)
}

func TestLinger(t *testing.T) {
	clearEnv(t)
	c, err := FromEnv()
	require.NoError(t, err)
	require.Equal(t, DefaultFatalLinger, c.Linger(), "the variable's default is DefaultFatalLinger")
	require.Equal(t, 90*time.Second, Config{FatalLinger: "90s"}.Linger())
	require.Equal(t, time.Duration(0), Config{FatalLinger: "0s"}.Linger())
	require.Equal(t, DefaultFatalLinger, Config{FatalLinger: "soon"}.Linger())
}

func TestLogger(t *testing.T) {
	var buf bytes.Buffer
	c := defaults()
	c.LogFormat, c.LogLevel = LogFormatJSON, "warn"
	l := c.Logger(&buf)
	l.Info("hidden")
	l.Warn("shown", "version", 1)
	require.NotContains(t, buf.String(), "hidden")
	require.Contains(t, buf.String(), `"msg":"shown","version":1`)

	buf.Reset()
	c.LogFormat, c.LogLevel = LogFormatText, "debug"
	c.Logger(&buf).Debug("shown")
	require.Contains(t, buf.String(), "level=DEBUG msg=shown")

	require.Equal(t, slog.LevelInfo, Config{LogLevel: "nonsense"}.Level())
	_ = Config{}.Logger(io.Discard) // zero Config still gives a usable logger
}
