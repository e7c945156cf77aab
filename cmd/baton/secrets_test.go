package main

import (
	"context"
	"io"
	"net"
	"net/http"
	"net/url"
	"os"
	"os/exec"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/nats-io/nats-server/v2/server"
	"github.com/stretchr/testify/require"

	"github.com/batonhq/baton/internal/opsserver"
	"github.com/batonhq/baton/internal/testsvc"
	"github.com/batonhq/baton/internal/throwaway"
	"github.com/batonhq/baton/migrations"
)

// Passwords and tokens of the secrets test. Each holds '=' (which makes a URL without a scheme
// look like key=value pairs), and its pieces between '=' are long enough to be told apart
// from other output, so that a piece leaking on its own is caught too.
const (
	goodPW    = "G00dPw=Corr3ct=="   // the password of role app and of NATS user app
	goodToken = "G00dT0ken=Acc3pted" // the token of the token NATS server
	wrongPW   = "Wr0ngPw=Refus3d"    // a password the servers refuse
	wrongTok  = "Wr0ngT0k=="         // a token the server refuses
	oddPW     = "Odd@Pw:w/th%sl=sh"  // needs percent-encoding in a URL
)

// secretServers are the servers the secrets test runs the programs against: a PostgreSQL
// cluster that asks role app for a password, a NATS server that asks user app for one, and a
// NATS server that asks for a token; closed is a host:port nothing listens on.
type secretServers struct {
	pgPort    int
	dbName    string // a migrated database of the password cluster, owned by app
	trustURL  string // a migrated database with no password (the shared test cluster)
	natsPW    string // host:port of the NATS server with user app
	natsToken string // host:port of the NATS server with a token
	plainNATS string // nats:// URL of a NATS server with no credentials
	closed    string
}

func startSecretServers(t *testing.T) *secretServers {
	t.Helper()
	ctx, cancel := context.WithTimeout(t.Context(), 2*time.Minute)
	defer cancel()
	// On TCP: the URLs below name a host and port, as users write them.
	pg, err := testsvc.StartPostgresWith(ctx, throwaway.PostgresOptions{TCP: true, HBA: []string{
		"host all app 127.0.0.1/32 scram-sha-256",
		"host replication app 127.0.0.1/32 scram-sha-256",
	}})
	require.NoError(t, err)
	t.Cleanup(func() { require.NoError(t, pg.Close()) })
	admin, err := pgx.Connect(ctx, pg.URL("postgres"))
	require.NoError(t, err)
	defer func() { _ = admin.Close(context.WithoutCancel(ctx)) }()
	_, err = admin.Exec(ctx, "CREATE ROLE app LOGIN REPLICATION PASSWORD "+quoteLiteral(goodPW))
	require.NoError(t, err)
	_, err = admin.Exec(ctx, "CREATE DATABASE appdb OWNER app")
	require.NoError(t, err)
	appConn, err := pgx.Connect(ctx, pg.URL("appdb"))
	require.NoError(t, err)
	_, err = migrations.Up(ctx, appConn)
	_ = appConn.Close(ctx)
	require.NoError(t, err)
	_, err = admin.Exec(ctx, "ALTER SCHEMA public OWNER TO app")
	require.NoError(t, err)
	// migrations ran as postgres; app owns what Baton's commands create later (slot, streams).
	_, err = admin.Exec(ctx, "ALTER ROLE app SUPERUSER")
	require.NoError(t, err)

	s := &secretServers{pgPort: pg.Port, dbName: "appdb", trustURL: testsvc.NewDatabase(t).URL,
		plainNATS: testsvc.StartNATS(t).URL()}
	s.natsPW = startAuthNATS(t, &server.Options{Username: "app", Password: goodPW})
	s.natsToken = startAuthNATS(t, &server.Options{Authorization: goodToken})

	s.closed = testsvc.RefusingAddr(t)
	return s
}

func quoteLiteral(s string) string { return "'" + strings.ReplaceAll(s, "'", "''") + "'" }

// startAuthNATS starts a NATS server with JetStream that asks for the credentials in opts, and
// returns its host:port.
func startAuthNATS(t *testing.T, opts *server.Options) string {
	t.Helper()
	opts.Host, opts.Port = "127.0.0.1", -1
	opts.JetStream, opts.StoreDir = true, t.TempDir()
	opts.NoSigs, opts.NoLog = true, true
	srv, err := server.NewServer(opts)
	require.NoError(t, err)
	go srv.Start()
	require.True(t, srv.ReadyForConnections(30*time.Second), "nats server not ready")
	t.Cleanup(func() { srv.Shutdown(); srv.WaitForShutdown() })
	return srv.Addr().String()
}

// secretForms returns the strings that must never appear in output for secret: itself, its
// percent-encoded and percent-decoded forms, and each of its pieces between '=' of 5 bytes or
// more (a piece leaks on its own when a URL is read as key=value pairs).
func secretForms(secret string) []string {
	forms := []string{secret, url.QueryEscape(secret), url.PathEscape(secret),
		strings.TrimPrefix(url.UserPassword("", secret).String(), ":")}
	if dec, err := url.PathUnescape(secret); err == nil {
		forms = append(forms, dec)
	}
	for _, piece := range strings.Split(secret, "=") {
		if len(piece) >= 5 {
			forms = append(forms, piece)
		}
	}
	return forms
}

// program is one run of a program of this module with a configuration.
type program struct {
	name string   // for the failure message
	bin  string   // path of the built program
	args []string // arguments
	env  []string // BATON_* variables
	// until, when set, is output after which the program has shown what it does with the
	// URLs and is stopped with SIGTERM (relays and workers retry a server that is away for
	// ever, by design). Without it the program must exit on its own.
	until string
	// metrics says the program serves metrics on a port the system picks
	// (BATON_METRICS_ADDR=127.0.0.1:0, in env) and logs where (opsserver.MetricsListening):
	// once until shows, what it serves there (/metrics, /healthz, /readyz) counts as output too.
	metrics bool
}

// runLimit bounds each run: a program given bad credentials or an unreachable server must
// say so and exit (or show until) well within it.
const runLimit = 45 * time.Second

// runProgram runs p and returns everything it wrote to stdout and stderr. It fails the test
// (with t.Errorf: it runs in goroutines of the test) when p neither exited nor printed p.until
// within runLimit.
func runProgram(t *testing.T, p program) string {
	t.Helper()
	cmd := exec.Command(p.bin, p.args...) // stopped by signals below, SIGTERM first
	cmd.Env = append(testEnv(), p.env...)
	var out testsvc.Buffer
	cmd.Stdout, cmd.Stderr = &out, &out
	if err := cmd.Start(); err != nil { // in a goroutine of the test: no FailNow
		t.Errorf("%s: %v", p.name, err)
		return ""
	}
	exited := make(chan struct{})
	go func() { _ = cmd.Wait(); close(exited) }()
	stop := func() {
		_ = cmd.Process.Signal(syscall.SIGTERM)
		select {
		case <-exited:
		case <-time.After(30 * time.Second):
			_ = cmd.Process.Kill()
			<-exited
			t.Errorf("%s: still running 30s after SIGTERM", p.name)
		}
	}
	deadline := time.After(runLimit)
	tick := time.NewTicker(20 * time.Millisecond)
	defer tick.Stop()
	for {
		select {
		case <-exited:
			return out.String()
		case <-tick.C:
			if p.until != "" && strings.Contains(out.String(), p.until) {
				served := scrape(t, p, &out)
				stop()
				return out.String() + served
			}
		case <-deadline:
			stop()
			t.Errorf("%s: neither exited nor printed %q within %s (a hang is a finding); output:\n%s",
				p.name, p.until, runLimit, out.String())
			return out.String()
		}
	}
}

// scrape returns what p serves on its metrics address, or "" when it has none. The address is
// the one p logged in out; the line may come just after the output p awaited, and is waited
// for up to 10s. It runs outside the test's goroutine, so it reports with t.Errorf.
func scrape(t *testing.T, p program, out *testsvc.Buffer) string {
	t.Helper()
	if !p.metrics {
		return ""
	}
	addr, ok := "", false
	for deadline := time.Now().Add(10 * time.Second); ; {
		if addr, ok = loggedAddr(out.String(), opsserver.MetricsListening); ok || time.Now().After(deadline) {
			break
		}
		time.Sleep(20 * time.Millisecond) // the program logs the line as it binds
	}
	if !ok {
		t.Errorf("%s: did not log %q within 10s", p.name, opsserver.MetricsListening)
		return ""
	}
	var served strings.Builder
	client := &http.Client{Timeout: 5 * time.Second}
	get := func(path string) ([]byte, error) {
		req, err := http.NewRequestWithContext(t.Context(), http.MethodGet, "http://"+addr+path, nil)
		if err != nil {
			return nil, err
		}
		resp, err := client.Do(req)
		if err != nil {
			return nil, err
		}
		defer func() { _ = resp.Body.Close() }()
		return io.ReadAll(resp.Body)
	}
	// The program logs the address once it listens there: no retry for a listener not up yet.
	for _, path := range []string{"/metrics", "/healthz", "/readyz"} {
		body, err := get(path)
		if err != nil {
			t.Errorf("%s: GET %s: %v", p.name, path, err)
		}
		served.Write(body)
	}
	if !strings.Contains(served.String(), "# TYPE") {
		t.Errorf("%s: %s/metrics served no metrics", p.name, addr)
	}
	return served.String()
}

// testEnv is this process's environment without BATON_* (the tests set what they use) and
// PG* variables, plus PGHOST, PGPORT and PGUSER chosen by the caller.
func testEnv() []string {
	var env []string
	for _, kv := range os.Environ() {
		if !strings.HasPrefix(kv, "BATON_") && !strings.HasPrefix(kv, "PG") {
			env = append(env, kv)
		}
	}
	return env
}

// Passwords and tokens in database and NATS URLs, in every form a URL may take (with and
// without a scheme, percent-encoded, key=value, in the query), never reach what any program
// of this module prints: logs, errors, `baton status` text and JSON, the usage of bench and
// demo, what the relay and the worker serve as metrics, whether the server is away, refuses
// the credentials or accepts them.
func TestSecretsNeverReachOutput(t *testing.T) {
	t.Parallel()
	s := startSecretServers(t)
	baton := testsvc.Binary(t, "github.com/batonhq/baton/cmd/baton")
	echoagent := testsvc.Binary(t, "github.com/batonhq/baton/examples/echoagent")
	subscriber := testsvc.Binary(t, "github.com/batonhq/baton/examples/subscriber")

	pgHost := "127.0.0.1:" + strconv.Itoa(s.pgPort)
	closedHost, closedPort, err := net.SplitHostPort(s.closed)
	require.NoError(t, err)
	pgURLs := func(hostport, host, port string) []struct{ name, url, secret string } {
		return []struct{ name, url, secret string }{
			{"url user:pa=ss", "postgres://app:" + wrongPW + "@" + hostport + "/appdb?sslmode=disable", wrongPW},
			{"url token==", "postgresql://app:" + wrongTok + "@" + hostport + "/appdb?sslmode=disable", wrongTok},
			{"url percent-encoded", "postgres://" + url.UserPassword("app", oddPW).String() + "@" + hostport + "/appdb?sslmode=disable", oddPW},
			{"url query password", "postgres://app@" + hostport + "/appdb?sslmode=disable&password=" + url.QueryEscape(wrongPW), wrongPW},
			{"no scheme", "app:" + wrongPW + "@" + hostport + "/appdb", wrongPW},
			{"key=value quoted", "host=" + host + " port=" + port + " user=app dbname=appdb sslmode=disable password='" + wrongPW + "'", wrongPW},
			{"key=value token==", "host=" + host + " port=" + port + " user=app dbname=appdb sslmode=disable password=" + wrongTok, wrongTok},
			// Accepted by the configuration's checks, refused by the driver's parser, whose
			// errors quote the string.
			{"url invalid escape", "postgres://app:" + wrongPW + "%zz@" + hostport + "/appdb?sslmode=disable", wrongPW},
			{"url the driver refuses", "postgres://app:" + wrongPW + "@" + hostport + "/appdb?sslmode=bogus", wrongPW},
			{"key=value the driver refuses", "host=" + host + " port=" + port + " sslmode=bogus password='" + wrongPW + "'", wrongPW},
		}
	}
	natsURLs := func(pwHost, tokenHost string) []struct{ name, url, secret string } {
		return []struct{ name, url, secret string }{
			{"nats user:pa=ss", "nats://app:" + wrongPW + "@" + pwHost, wrongPW},
			{"nats token==", "nats://" + wrongTok + "@" + tokenHost, wrongTok},
			{"nats percent-encoded", "nats://" + url.UserPassword("app", oddPW).String() + "@" + pwHost, oddPW},
			{"nats no scheme user:pa=ss", "app:" + wrongPW + "@" + pwHost, wrongPW},
			{"nats no scheme token==", wrongTok + "@" + tokenHost, wrongTok},
			{"nats list", "nats://" + s.closed + ",app:" + wrongPW + "@" + pwHost, wrongPW},
			{"nats invalid escape", "nats://app:" + wrongPW + "%zz@" + pwHost, wrongPW},
			{"nats password with a space", "nats://app:" + wrongPW + " x@" + pwHost, wrongPW},
		}
	}
	pgEnv := []string{"PGHOST=127.0.0.1", "PGPORT=" + strconv.Itoa(s.pgPort), "PGUSER=postgres"}

	var runs []program
	// Every command, given a database URL with a secret, against a server that is away and
	// one that refuses the password; NATS is a server with no credentials.
	for _, server := range []struct{ name, hostport, host, port string }{
		{"away", s.closed, closedHost, closedPort},
		{"refuses", pgHost, "127.0.0.1", strconv.Itoa(s.pgPort)},
	} {
		for _, u := range pgURLs(server.hostport, server.host, server.port) {
			env := slices.Concat([]string{"BATON_DATABASE_URL=" + u.url, "BATON_NATS_URL=" + s.plainNATS, "BATON_LOG_LEVEL=debug"}, pgEnv)
			name := "postgres " + server.name + " " + u.name + ": "
			runs = append(runs, batonRuns(name, baton, env, "reconnecting")...)
			runs = append(runs,
				program{name: name + "echoagent", bin: echoagent, env: env, until: "level=ERROR"},
				program{name: name + "echoagent polling", bin: echoagent, args: []string{"--source", "polling"}, env: env, until: "level=ERROR"},
			)
		}
	}
	// Every command that talks to NATS, given a NATS URL with a secret, against a server that
	// is away and one that refuses the credentials; the database works.
	for _, server := range []struct{ name, pw, token string }{
		{"away", s.closed, s.closed},
		{"refuses", s.natsPW, s.natsToken},
	} {
		for _, u := range natsURLs(server.pw, server.token) {
			env := []string{"BATON_DATABASE_URL=" + s.trustURL, "BATON_NATS_URL=" + u.url, "BATON_LOG_LEVEL=debug"}
			name := "nats " + server.name + " " + u.name + ": "
			runs = append(runs, batonRuns(name, baton, env, "reconnecting")...)
			runs = append(runs,
				program{name: name + "echoagent", bin: echoagent, env: env, until: "echoagent started"},
				program{name: name + "subscriber", bin: subscriber, env: env},
			)
		}
	}
	// Credentials the servers accept: the commands run, print their reports and logs.
	goodDB := "postgres://" + url.UserPassword("app", goodPW).String() + "@" + pgHost + "/appdb?sslmode=disable"
	goodDBKV := "host=127.0.0.1 port=" + strconv.Itoa(s.pgPort) + " user=app dbname=appdb sslmode=disable password='" + goodPW + "'"
	for _, u := range []struct{ name, db, nats string }{
		{"url and nats user", goodDB, "nats://" + url.UserPassword("app", goodPW).String() + "@" + s.natsPW},
		{"key=value and nats token without scheme", goodDBKV, goodToken + "@" + s.natsToken},
	} {
		env := []string{"BATON_DATABASE_URL=" + u.db, "BATON_NATS_URL=" + u.nats, "BATON_LOG_LEVEL=debug", "BATON_SLOT=secrets_" + strconv.Itoa(len(runs))}
		name := "accepted " + u.name + ": "
		runs = append(runs,
			program{name: name + "migrate", bin: baton, args: []string{"migrate"}, env: env},
			program{name: name + "status", bin: baton, args: []string{"status"}, env: env},
			program{name: name + "status --json", bin: baton, args: []string{"status", "--json"}, env: env},
			program{name: name + "relay", bin: baton, args: []string{"relay"}, env: slices.Concat(env, []string{"BATON_METRICS_ADDR=" + opsserver.AnyPort}),
				until: "msg=streaming", metrics: true},
			program{name: name + "echoagent", bin: echoagent, env: slices.Concat(env, []string{"BATON_METRICS_ADDR=" + opsserver.AnyPort}),
				until: "echoagent started", metrics: true},
			// The last BATON_SLOT wins: the demo's relay has a slot of its own.
			program{name: name + "demo", bin: baton, args: []string{"demo", "--messages", "1", "--conversations", "1"},
				env: slices.Concat(env, []string{"BATON_SLOT=demo_" + strconv.Itoa(len(runs))})},
			program{name: name + "subscriber", bin: subscriber, args: []string{"--durable", "secrets" + strconv.Itoa(len(runs))}, env: env,
				until: "outcomes"},
			program{name: name + "console", bin: baton, args: []string{"console", "--addr", "127.0.0.1:0"}, env: env, until: "console on"},
		)
	}

	secrets := []string{goodPW, goodToken, wrongPW, wrongTok, oddPW}
	sem := make(chan struct{}, 4) // the machine's cores are shared
	var wg sync.WaitGroup
	var mu sync.Mutex
	outputs := make([]string, len(runs))
	for i, p := range runs {
		wg.Add(1)
		go func() {
			defer wg.Done()
			sem <- struct{}{}
			defer func() { <-sem }()
			out := runProgram(t, p)
			mu.Lock()
			outputs[i] = out
			mu.Unlock()
		}()
	}
	wg.Wait()
	for i, p := range runs {
		for _, secret := range secrets {
			for _, form := range secretForms(secret) {
				if strings.Contains(outputs[i], form) {
					t.Errorf("%s (%s %s): output shows %q (from %q):\n%s", p.name, p.bin[strings.LastIndexByte(p.bin, '/')+1:],
						strings.Join(p.args, " "), form, secret, outputs[i])
				}
			}
		}
	}
}

// batonRuns are the runs of every baton subcommand with env: migrate, relay (stopped once
// it printed relayUntil, when it does not exit), status in text and JSON, bench relay and
// bench turns with tiny sizes, demo with the given servers, version, and a usage error.
func batonRuns(name, baton string, env []string, relayUntil string) []program {
	return []program{
		{name: name + "migrate", bin: baton, args: []string{"migrate"}, env: env},
		{name: name + "relay", bin: baton, args: []string{"relay"}, env: env, until: relayUntil},
		{name: name + "status", bin: baton, args: []string{"status", "--timeout", "20s"}, env: env},
		{name: name + "status --json", bin: baton, args: []string{"status", "--json", "--timeout", "20s"}, env: env},
		{name: name + "bench relay", bin: baton, args: []string{"bench", "relay", "--rows", "200", "--rounds", "1", "--rates", "10",
			"--latency-duration", "1s"}, env: env},
		{name: name + "bench turns", bin: baton, args: []string{"bench", "turns", "--turns", "10", "--rounds", "1"}, env: env},
		{name: name + "demo", bin: baton, args: []string{"demo", "--messages", "1", "--conversations", "1"}, env: env},
		{name: name + "console", bin: baton, args: []string{"console", "--addr", "127.0.0.1:0"}, env: env},
		{name: name + "version", bin: baton, args: []string{"version"}, env: env},
		{name: name + "usage error", bin: baton, args: []string{"status", "--no-such-flag"}, env: env},
	}
}

// loggedAddr returns the address of the first line of output, a program's log, that says
// where it listens for msg (opsserver.ListeningAddr).
func loggedAddr(output, msg string) (string, bool) {
	for line := range strings.SplitSeq(output, "\n") {
		if addr, ok := opsserver.ListeningAddr(line, msg); ok {
			return addr, true
		}
	}
	return "", false
}
