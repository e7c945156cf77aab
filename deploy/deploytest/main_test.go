package deploytest

import (
	"bytes"
	"maps"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"sync"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/batonhq/baton/internal/testsvc"
)

func TestMain(m *testing.M) {
	os.Exit(testsvc.MainNoLeaks(m))
}

// root is the module's root directory, relative to this package.
const root = "../.."

// path returns a path under the module's root.
func path(elem ...string) string {
	return filepath.Join(append([]string{root}, elem...)...)
}

// readFile returns a file under the module's root.
func readFile(t *testing.T, elem ...string) []byte {
	t.Helper()
	b, err := os.ReadFile(path(elem...))
	require.NoError(t, err)
	return b
}

// Programs the deploy files run, by the name of their image target.
const (
	progBaton       = "baton"
	progEchoagent   = "echoagent"
	progSubscriber  = "subscriber"
	progHealthcheck = "healthcheck"
)

// programPackages are the main packages of the programs, relative to the module's root.
var programPackages = map[string]string{
	progBaton:       "cmd/baton",
	progEchoagent:   "examples/echoagent",
	progSubscriber:  "examples/subscriber",
	progHealthcheck: "deploy/healthcheck",
}

// programExists reports whether the program's package is in the module (examples/subscriber
// is written separately and may not exist yet).
func programExists(name string) bool {
	_, err := os.Stat(path(programPackages[name], "main.go"))
	return err == nil
}

// requireProgram fails the test when the program's package is missing: the deploy files
// name it, so it must exist.
func requireProgram(t *testing.T, name string) {
	t.Helper()
	if !programExists(name) {
		t.Fatalf("%s does not exist, but the deploy files run %s", programPackages[name], name)
	}
}

// binary returns the path of a built program (built once per test binary by testsvc.Binary).
func binary(t *testing.T, name string) string {
	t.Helper()
	requireProgram(t, name)
	return testsvc.Binary(t, "github.com/batonhq/baton/"+programPackages[name])
}

// cleanEnv is the environment without BATON_* variables, so a developer's configuration
// cannot change what the programs print.
func cleanEnv() []string {
	var env []string
	for _, kv := range os.Environ() {
		if !strings.HasPrefix(kv, "BATON_") {
			env = append(env, kv)
		}
	}
	return env
}

// usage is what a program (or one baton subcommand) accepts, parsed from its help output.
type usage struct {
	flags map[string]bool // flag names without dashes
	env   map[string]bool // BATON_* variables its flags are bound to
}

var (
	flagLineRE = regexp.MustCompile(`(?m)^  -([A-Za-z0-9][A-Za-z0-9_-]*)`)
	// envRE finds a flag's variables: [env X], or [env X; or Y] for a variable without a flag
	// of its own (a password is never a flag: it would show in the process list).
	envRE     = regexp.MustCompile(`\[env (BATON_[A-Z0-9_]+)(?:; or (BATON_[A-Z0-9_]+))?\]`)
	commandRE = regexp.MustCompile(`^  ([a-z][a-z0-9-]*)\s`)
)

func parseUsage(out string) usage {
	u := usage{flags: map[string]bool{}, env: map[string]bool{}}
	for _, m := range flagLineRE.FindAllStringSubmatch(out, -1) {
		u.flags[m[1]] = true
	}
	for _, m := range envRE.FindAllStringSubmatch(out, -1) {
		for _, v := range m[1:] {
			if v != "" {
				u.env[v] = true
			}
		}
	}
	return u
}

// run runs a built program and returns its combined output; it fails the test unless the
// program exits 0.
func run(t *testing.T, bin string, args ...string) string {
	t.Helper()
	cmd := exec.Command(bin, args...)
	cmd.Env = cleanEnv()
	var out bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &out
	require.NoError(t, cmd.Run(), "%s %s:\n%s", filepath.Base(bin), strings.Join(args, " "), out.String())
	return out.String()
}

// helpCache holds what batonCommands and programUsage parsed, so each program runs once.
var helpCache struct {
	mu    sync.Mutex
	baton map[string]usage
	progs map[string]usage
}

// batonCommands returns baton's subcommands and what each accepts, from `baton help` and
// `baton help <command>`.
func batonCommands(t *testing.T) map[string]usage {
	t.Helper()
	helpCache.mu.Lock()
	defer helpCache.mu.Unlock()
	if helpCache.baton != nil {
		return helpCache.baton
	}
	bin := binary(t, progBaton)
	out := run(t, bin, "help")
	_, list, ok := strings.Cut(out, "commands:\n")
	require.True(t, ok, "baton help lists no commands:\n%s", out)
	cmds := map[string]usage{}
	for _, line := range strings.Split(list, "\n") {
		if strings.TrimSpace(line) == "" {
			break
		}
		m := commandRE.FindStringSubmatch(line)
		require.NotNil(t, m, "unexpected line in baton help: %q", line)
		if m[1] == "help" {
			continue
		}
		cmds[m[1]] = parseUsage(run(t, bin, "help", m[1]))
	}
	require.Contains(t, cmds, "migrate")
	require.Contains(t, cmds, "relay")
	require.True(t, cmds["relay"].flags["dup-window"], "baton help relay lists no --dup-window: help output changed?")
	require.True(t, cmds["relay"].env["BATON_DATABASE_URL"], "baton help relay lists no BATON_DATABASE_URL: help output changed?")
	helpCache.baton = cmds
	return cmds
}

// programUsage returns what a single-command program accepts, from `<program> -h`.
func programUsage(t *testing.T, name string) usage {
	t.Helper()
	helpCache.mu.Lock()
	defer helpCache.mu.Unlock()
	if u, ok := helpCache.progs[name]; ok {
		return u
	}
	u := parseUsage(run(t, binary(t, name), "-h"))
	require.NotEmpty(t, u.flags, "%s -h lists no flags", name)
	if helpCache.progs == nil {
		helpCache.progs = map[string]usage{}
	}
	helpCache.progs[name] = u
	return u
}

// invocation is one way a deploy file runs a program: the arguments after the program's name.
type invocation struct {
	where   string // for messages: "docker-compose.yml service relay-a"
	program string
	args    []string
	env     []string // BATON_* variables set for it
}

// checkInvocation checks that the subcommand, every flag and every BATON_* variable of inv
// exist in the program it runs.
func checkInvocation(t *testing.T, inv invocation) {
	t.Helper()
	var u usage
	args := inv.args
	switch inv.program {
	case progBaton:
		cmds := batonCommands(t)
		require.NotEmpty(t, args, "%s: runs baton without a command", inv.where)
		var ok bool
		u, ok = cmds[args[0]]
		require.True(t, ok, "%s: baton has no command %q (it has %v)", inv.where, args[0], keys(cmds))
		args = args[1:]
	case progEchoagent, progSubscriber:
		requireProgram(t, inv.program)
		u = programUsage(t, inv.program)
	default:
		t.Fatalf("%s: unknown program %q", inv.where, inv.program)
	}
	what := strings.TrimSpace(inv.program + " " + strings.Join(inv.args[:len(inv.args)-len(args)], " "))
	for _, a := range args {
		if !strings.HasPrefix(a, "-") {
			continue // a flag's value
		}
		name, _, _ := strings.Cut(strings.TrimLeft(a, "-"), "=")
		require.True(t, u.flags[name], "%s: %s has no flag -%s (it has %v)", inv.where, what, name, keys(u.flags))
	}
	for _, v := range inv.env {
		require.True(t, u.env[v], "%s: %s does not read %s (it reads %v)", inv.where, what, v, keys(u.env))
	}
}

func keys[V any](m map[string]V) []string {
	return slices.Sorted(maps.Keys(m))
}
