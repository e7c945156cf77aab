package main

import (
	"bytes"
	"context"
	"encoding/json"
	"io"
	"net/http"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/batonhq/baton/internal/config"
	"github.com/batonhq/baton/internal/opsserver"
	"github.com/batonhq/baton/internal/testsvc"
)

// SIGHUP (a closed terminal, a supervisor's reload) stops every long-running program the way
// SIGTERM does: drained and exit 0, not killed by the signal's default action.
func TestSIGHUPStopsLikeSIGTERM(t *testing.T) {
	t.Parallel()
	bins := testsvc.Binaries(t, "github.com/batonhq/baton/cmd/baton", "github.com/batonhq/baton/examples/echoagent",
		"github.com/batonhq/baton/examples/subscriber")
	db := testsvc.NewDatabase(t)
	n := testsvc.StartNATS(t)
	env := func(role testsvc.Role) []string {
		return []string{config.EnvDatabaseURL + "=" + db.RoleURL(role), config.EnvNATSURL + "=" + n.URL(), config.EnvSlot + "=" + db.Name}
	}
	relay := startChild(t, "relay", bins[0], env(testsvc.RoleRelay), "relay")
	relay.await(t, "msg=streaming")
	agent := startChild(t, "echoagent", bins[1], env(testsvc.RoleWorker))
	agent.await(t, "echoagent started")
	sub := startChild(t, "subscriber", bins[2], env(testsvc.RoleWorker), "--durable", "hup")
	sub.await(t, "subscribed to outcomes")
	for _, c := range []*child{sub, agent, relay} {
		require.NoError(t, c.cmd.Process.Signal(syscall.SIGHUP))
		require.Equal(t, 0, c.exitCode(t), "%s on SIGHUP:\n%s", c.name, c.stderr.String())
	}
}

// `baton status` that cannot reach the database could not check anything: exit 3, apart from
// 1 (checked: something needs attention); with --json it prints an object saying so, which a
// monitor parsing stdout can read, and never the password.
func TestStatusCouldNotCheck(t *testing.T) {
	t.Parallel()
	for _, asJSON := range []bool{false, true} {
		args := []string{"status", "--database-url", "postgres://watcher:s3cret-pw@127.0.0.1:1/x?connect_timeout=5"}
		if asJSON {
			args = append(args, "--json")
		}
		ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		var stdout, stderr bytes.Buffer
		code := run(ctx, args, &stdout, &stderr)
		cancel()
		require.Equal(t, 3, code, "json %v: %s%s", asJSON, stdout.String(), stderr.String())
		require.NotContains(t, stdout.String()+stderr.String(), "s3cret-pw")
		require.Contains(t, stderr.String(), "baton status: ")
		if !asJSON {
			require.Empty(t, stdout.String())
			continue
		}
		var rep struct {
			GeneratedAt time.Time `json:"generated_at"`
			OK          *bool     `json:"ok"`
			Error       string    `json:"error"`
		}
		require.NoError(t, json.Unmarshal(stdout.Bytes(), &rep), stdout.String())
		require.NotNil(t, rep.OK)
		require.False(t, *rep.OK)
		require.Contains(t, rep.Error, "127.0.0.1")
		require.False(t, rep.GeneratedAt.IsZero())
	}
}

// A worker's /readyz says whether it can work: 200 while Postgres and NATS answer, 503 naming
// NATS while NATS is away, 200 again once it is back. /healthz stays 200 throughout.
func TestWorkerReadyzFollowsNATS(t *testing.T) {
	t.Parallel()
	agentBin := testsvc.Binary(t, "github.com/batonhq/baton/examples/echoagent")
	db := testsvc.NewDatabase(t)
	n := testsvc.StartNATS(t)
	require.False(t, n.External(), "this test stops NATS: unset %s", testsvc.EnvNATSURL)
	agent := startChild(t, "echoagent", agentBin, []string{config.EnvDatabaseURL + "=" + db.RoleURL(testsvc.RoleWorker),
		config.EnvNATSURL + "=" + n.URL(), config.EnvMetricsAddr + "=" + opsserver.AnyPort})
	agent.await(t, "echoagent started")
	agent.await(t, opsserver.MetricsListening) // the line with the address the system picked
	addr, ok := loggedAddr(agent.stderr.String(), opsserver.MetricsListening)
	require.True(t, ok, "no address in the echo agent's log:\n%s", agent.stderr.String())
	probe := func(path string) (int, string) {
		resp, err := http.Get("http://" + addr + path) //nolint:noctx // a probe with the client's timeout
		if err != nil {
			return 0, err.Error()
		}
		defer func() { _ = resp.Body.Close() }()
		body, _ := io.ReadAll(resp.Body)
		return resp.StatusCode, string(body)
	}
	awaitProbe := func(path string, want int, says string) {
		t.Helper()
		deadline := time.Now().Add(30 * time.Second)
		for {
			code, body := probe(path)
			if code == want && strings.Contains(body, says) {
				return
			}
			if time.Now().After(deadline) {
				t.Fatalf("%s: got %d %q for 30s, want %d with %q", path, code, body, want, says)
			}
			time.Sleep(20 * time.Millisecond)
		}
	}
	awaitProbe("/readyz", http.StatusOK, "ok")
	n.Stop()
	awaitProbe("/readyz", http.StatusServiceUnavailable, "nats")
	awaitProbe("/healthz", http.StatusOK, "ok")
	require.NoError(t, n.Start())
	awaitProbe("/readyz", http.StatusOK, "ok")
}
