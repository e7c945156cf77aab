package main

import (
	"strings"
	"testing"

	"github.com/nats-io/nats.go"
	"github.com/stretchr/testify/require"

	"github.com/batonhq/baton/internal/config"
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
			cli := config.Config{SubjectPrefix: "agent", Slot: "baton", Publication: "baton", LogLevel: "info", LogFormat: "text"}
			lib := relay.Config{DatabaseURL: "postgres://localhost/db", NATS: new(nats.Conn)}
			v.set(&cli, &lib)
			cliErr := cli.Validate()
			_, libErr := relay.New(lib)
			cliRefuses := cliErr != nil && strings.Contains(cliErr.Error(), v.env)
			require.Equal(t, cliRefuses, libErr != nil, "%s=%q: command says %v, relay.New says %v", v.env, name, cliErr, libErr)
		}
	}
}
