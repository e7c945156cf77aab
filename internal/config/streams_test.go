package config

import (
	"flag"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// The stream settings have bounded defaults, parse their documented forms, and every refused
// value names its variable.
func TestStreamSettings(t *testing.T) {
	clearEnv(t)
	c, err := Load()
	require.NoError(t, err)
	require.Equal(t, StreamLimits{Replicas: 1, MaxAge: 7 * 24 * time.Hour, MaxBytes: 1 << 30, MaxMsgs: 1_000_000,
		Duplicates: 2 * time.Minute}, c.Streams(), "bounded defaults")

	for _, tc := range []struct {
		name string
		env  map[string]string
		want StreamLimits
		errs []string
	}{
		{name: "set", env: map[string]string{EnvStreamReplicas: "3", EnvStreamMaxAge: "24h", EnvStreamMaxBytes: "512MiB",
			EnvStreamMaxMsgs: "5000", EnvStreamDuplicate: "30s"},
			want: StreamLimits{Replicas: 3, MaxAge: 24 * time.Hour, MaxBytes: 512 << 20, MaxMsgs: 5000, Duplicates: 30 * time.Second}},
		{name: "no caps", env: map[string]string{EnvStreamMaxAge: "0", EnvStreamMaxBytes: "-1", EnvStreamMaxMsgs: "-1"},
			want: StreamLimits{Replicas: 1, MaxBytes: -1, MaxMsgs: -1, Duplicates: 2 * time.Minute}},
		{name: "plain bytes", env: map[string]string{EnvStreamMaxBytes: "1048576", EnvStreamDuplicate: "1h", EnvStreamMaxAge: "1h"},
			want: StreamLimits{Replicas: 1, MaxAge: time.Hour, MaxBytes: 1 << 20, MaxMsgs: 1_000_000, Duplicates: time.Hour}},
		{name: "replicas", env: map[string]string{EnvStreamReplicas: "7"}, errs: []string{"BATON_STREAM_REPLICAS: must be a number from 1 to 5"}},
		{name: "replicas zero", env: map[string]string{EnvStreamReplicas: "0"}, errs: []string{"BATON_STREAM_REPLICAS"}},
		{name: "max age", env: map[string]string{EnvStreamMaxAge: "7d"}, errs: []string{`BATON_STREAM_MAX_AGE: must be a duration such as 168h or 30m, 0 for no age limit (got "7d")`}},
		{name: "negative age", env: map[string]string{EnvStreamMaxAge: "-1h"}, errs: []string{"BATON_STREAM_MAX_AGE"}},
		{name: "bytes unit", env: map[string]string{EnvStreamMaxBytes: "1GB"}, errs: []string{`BATON_STREAM_MAX_BYTES: must be a positive number of bytes`}},
		{name: "bytes zero", env: map[string]string{EnvStreamMaxBytes: "0"}, errs: []string{"BATON_STREAM_MAX_BYTES"}},
		{name: "bytes overflow", env: map[string]string{EnvStreamMaxBytes: "9000000000TiB"}, errs: []string{"BATON_STREAM_MAX_BYTES: is too large"}},
		{name: "msgs", env: map[string]string{EnvStreamMaxMsgs: "-2"}, errs: []string{"BATON_STREAM_MAX_MSGS: must be a positive number, or -1 for no cap"}},
		{name: "duplicates", env: map[string]string{EnvStreamDuplicate: "0s"}, errs: []string{"BATON_STREAM_DUPLICATES: must be a positive duration"}},
		{name: "duplicates past max age", env: map[string]string{EnvStreamDuplicate: "2h", EnvStreamMaxAge: "1h"},
			errs: []string{"BATON_STREAM_DUPLICATES: 2h is longer than BATON_STREAM_MAX_AGE 1h"}},
		{name: "all at once", env: map[string]string{EnvStreamReplicas: "x", EnvStreamMaxMsgs: "many"},
			errs: []string{"BATON_STREAM_REPLICAS", "BATON_STREAM_MAX_MSGS"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			clearEnv(t)
			for k, v := range tc.env {
				t.Setenv(k, v)
			}
			c, err := Load()
			if tc.errs == nil {
				require.NoError(t, err)
				require.Equal(t, tc.want, c.Streams())
				return
			}
			for _, e := range tc.errs {
				require.ErrorContains(t, err, e)
			}
		})
	}
}

// Flags override the stream variables; --dup-window, the older name, sets the duplicate
// window too, and errors name the flag that was used.
func TestStreamFlags(t *testing.T) {
	clearEnv(t)
	t.Setenv(EnvStreamMaxMsgs, "10")
	t.Setenv(EnvStreamDuplicate, "1m")
	parse := func(args ...string) (Config, error) {
		c, err := FromEnv()
		require.NoError(t, err)
		fs := flag.NewFlagSet("test", flag.ContinueOnError)
		c.BindFlags(fs, EnvStreamReplicas, EnvStreamMaxAge, EnvStreamMaxBytes, EnvStreamMaxMsgs, EnvStreamDuplicate)
		require.NoError(t, fs.Parse(args))
		return c, c.Validate()
	}
	c, err := parse("--stream-max-msgs", "20", "--stream-replicas=3", "--stream-max-bytes", "2GiB", "--stream-max-age", "1h")
	require.NoError(t, err)
	require.Equal(t, StreamLimits{Replicas: 3, MaxAge: time.Hour, MaxBytes: 2 << 30, MaxMsgs: 20, Duplicates: time.Minute}, c.Streams())
	c, err = parse("--dup-window", "5s")
	require.NoError(t, err)
	require.Equal(t, 5*time.Second, c.Streams().Duplicates)
	require.EqualValues(t, 10, c.Streams().MaxMsgs, "the environment's, where no flag is given")
	_, err = parse("--dup-window", "-5s")
	require.ErrorContains(t, err, "--dup-window: must be a positive duration")
	_, err = parse("--stream-duplicates", "nope")
	require.ErrorContains(t, err, "--stream-duplicates: must be a positive duration")
}
