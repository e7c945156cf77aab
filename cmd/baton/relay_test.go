package main

import (
	"bytes"
	"context"
	"encoding/json"
	"net/url"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/stretchr/testify/require"

	"github.com/batonhq/baton/internal/config"
	"github.com/batonhq/baton/internal/testsvc"
	"github.com/batonhq/baton/relay"
)

// The command validates BATON_SLOT and BATON_PUBLICATION before it builds the relay: both must
// accept exactly the same names, or a name the command accepted fails later in relay.New.
func TestSlotAndPublicationRulesAgreeWithTheRelay(t *testing.T) {
	t.Parallel()
	names := []string{"baton", "baton_0", "_x", "1abc", "0", "9_slot", "Bad", "a-b", "a.b", "a b", "é",
		strings.Repeat("a", 63), strings.Repeat("a", 64), "1" + strings.Repeat("a", 62)}
	for _, name := range names {
		for _, v := range []struct {
			env string
			set func(*config.Config, *relay.Config)
		}{
			{config.EnvSlot, func(c *config.Config, r *relay.Config) { c.Slot, r.Slot = name, name }},
			{config.EnvPublication, func(c *config.Config, r *relay.Config) { c.Publication, r.Publication = name, name }},
		} {
			cli := config.Config{SubjectPrefix: "agent", Slot: "baton", Publication: "baton", FatalLinger: "2m", LogLevel: "info", LogFormat: "text"}
			lib := relay.Config{DatabaseURL: "postgres://localhost/db", NATS: new(nats.Conn)}
			v.set(&cli, &lib)
			cliErr := cli.Validate()
			_, libErr := relay.New(lib)
			cliRefuses := cliErr != nil && strings.Contains(cliErr.Error(), v.env)
			require.Equal(t, cliRefuses, libErr != nil, "%s=%q: command says %v, relay.New says %v", v.env, name, cliErr, libErr)
		}
	}
}

// A database URL Postgres refuses for good, or that does not parse, ends `baton relay` at once
// with exit 1 and one ERROR record in the configured log format that names the problem and
// never the password; nothing is printed raw besides.
func TestRelayRefusedDatabaseIsLoggedOnce(t *testing.T) {
	t.Parallel()
	db := testsvc.NewDatabase(t)
	ns := testsvc.StartNATS(t)
	missing, err := url.Parse(db.URL)
	require.NoError(t, err)
	missing.Path = "/" + db.Name + "_missing"
	secret, ok := missing.User.Password()
	if !ok { // the throwaway cluster trusts every connection and ignores a password
		secret = "pg-s3cret"
		missing.User = url.UserPassword(missing.User.Username(), secret)
	}
	for _, tc := range []struct {
		name, url, secret, says string
	}{
		{"database does not exist", missing.String(), secret, `database \"` + db.Name + `_missing\" does not exist`},
		{"unparseable", "postgres://baton:s3cret@127.0.0.1:1/baton?sslmode=bogus", "s3cret", "parse database url"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			// Bounded well below forever: a relay that retried would still run when ctx ends.
			ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
			defer cancel()
			var stdout, stderr bytes.Buffer
			code := run(ctx, []string{"relay", "--database-url", tc.url, "--nats-url", ns.URL(),
				"--slot", db.Name, "--log-format", "json", "--log-level", "debug"}, &stdout, &stderr)
			require.NoError(t, ctx.Err(), "the relay kept retrying:\n%s", stderr.String())
			require.Equal(t, 1, code, stderr.String())
			require.NotContains(t, stdout.String()+stderr.String(), tc.secret)
			var errs []string
			for line := range strings.SplitSeq(strings.TrimSpace(stderr.String()), "\n") {
				var rec map[string]any
				require.NoError(t, json.Unmarshal([]byte(line), &rec), "not a JSON record: %s", line)
				if rec["level"] == "ERROR" {
					errs = append(errs, line)
				}
			}
			require.Len(t, errs, 1, stderr.String())
			require.Contains(t, errs[0], "relay setup")
			require.Contains(t, errs[0], tc.says)
			require.Contains(t, errs[0], `"exit_in":"0s"`)
		})
	}
}
