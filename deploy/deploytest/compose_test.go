package deploytest

import (
	"net"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
	"go.yaml.in/yaml/v3"
)

// composeFile is the part of a compose file the tests read.
type composeFile struct {
	Name     string                    `yaml:"name"`
	Services map[string]composeService `yaml:"services"`
	Volumes  map[string]any            `yaml:"volumes"`
}

type composeService struct {
	Image       string      `yaml:"image"`
	PullPolicy  string      `yaml:"pull_policy"`
	Build       *buildSpec  `yaml:"build"`
	Command     stringList  `yaml:"command"`
	Entrypoint  stringList  `yaml:"entrypoint"`
	Environment envMap      `yaml:"environment"`
	DependsOn   dependsOn   `yaml:"depends_on"`
	Healthcheck *healthSpec `yaml:"healthcheck"`
	Deploy      *struct {
		Replicas *int `yaml:"replicas"`
	} `yaml:"deploy"`
	Volumes  []string `yaml:"volumes"`
	Profiles []string `yaml:"profiles"`
	Restart  string   `yaml:"restart"`
}

type buildSpec struct {
	Context    string `yaml:"context"`
	Dockerfile string `yaml:"dockerfile"`
	Target     string `yaml:"target"`
}

type healthSpec struct {
	Test stringList `yaml:"test"`
}

// stringList is a compose command, entrypoint or test: a list, or a string split on spaces.
type stringList []string

func (l *stringList) UnmarshalYAML(n *yaml.Node) error {
	if n.Kind == yaml.ScalarNode {
		*l = strings.Fields(n.Value)
		return nil
	}
	var s []string
	if err := n.Decode(&s); err != nil {
		return err
	}
	*l = s
	return nil
}

// envMap is a compose environment: a mapping, or a list of NAME=value.
type envMap map[string]string

func (e *envMap) UnmarshalYAML(n *yaml.Node) error {
	m := map[string]string{}
	if n.Kind == yaml.SequenceNode {
		var list []string
		if err := n.Decode(&list); err != nil {
			return err
		}
		for _, kv := range list {
			k, v, _ := strings.Cut(kv, "=")
			m[k] = v
		}
	} else if err := n.Decode(&m); err != nil {
		return err
	}
	*e = m
	return nil
}

// dependsOn is a compose depends_on: a list of services, or services with conditions.
type dependsOn map[string]string // service -> condition ("" for the list form)

func (d *dependsOn) UnmarshalYAML(n *yaml.Node) error {
	m := map[string]string{}
	if n.Kind == yaml.SequenceNode {
		var list []string
		if err := n.Decode(&list); err != nil {
			return err
		}
		for _, s := range list {
			m[s] = ""
		}
	} else {
		var full map[string]struct {
			Condition string `yaml:"condition"`
		}
		if err := n.Decode(&full); err != nil {
			return err
		}
		for s, c := range full {
			m[s] = c.Condition
		}
	}
	*d = m
	return nil
}

func loadCompose(t *testing.T) composeFile {
	t.Helper()
	var c composeFile
	require.NoError(t, yaml.Unmarshal(readFile(t, "docker-compose.yml"), &c), "docker-compose.yml")
	require.NotEmpty(t, c.Services)
	return c
}

// replicas is how many containers a service runs.
func (s composeService) replicas() int {
	if s.Deploy != nil && s.Deploy.Replicas != nil {
		return *s.Deploy.Replicas
	}
	return 1
}

// program names the Baton program a service runs (its image's Dockerfile target), or "" for
// other images (postgres, nats, ...).
func (c composeFile) program(t *testing.T, name string) string {
	t.Helper()
	s := c.Services[name]
	if s.Build != nil {
		return s.Build.Target
	}
	for _, other := range keys(c.Services) {
		if o := c.Services[other]; o.Build != nil && o.Image == s.Image {
			return o.Build.Target
		}
	}
	return ""
}

// batonEnv returns the BATON_* variables a service sets.
func batonEnv(env map[string]string) []string {
	var names []string
	for _, k := range keys(env) {
		if strings.HasPrefix(k, "BATON_") {
			names = append(names, k)
		}
	}
	return names
}

// servicesRunning returns the services running program (and, for baton, the subcommand),
// and how many containers they run together.
func (c composeFile) servicesRunning(t *testing.T, program, command string) (names []string, containers int) {
	t.Helper()
	for _, name := range keys(c.Services) {
		s := c.Services[name]
		if len(s.Profiles) > 0 || c.program(t, name) != program {
			continue
		}
		if command != "" && (len(s.Command) == 0 || s.Command[0] != command) {
			continue
		}
		names = append(names, name)
		containers += s.replicas()
	}
	return names, containers
}

func TestComposeServices(t *testing.T) {
	t.Parallel()
	c := loadCompose(t)
	for _, name := range []string{"postgres", "nats", "migrate", "subscriber"} {
		require.Contains(t, c.Services, name)
	}
	relays, n := c.servicesRunning(t, progBaton, "relay")
	require.GreaterOrEqual(t, n, 2, "two relays, active and standby (services %v)", relays)
	agents, n := c.servicesRunning(t, progEchoagent, "")
	require.GreaterOrEqual(t, n, 2, "two echo agents (services %v)", agents)
	require.Equal(t, progSubscriber, c.program(t, "subscriber"))

	// Every service depends on services that exist, and what needs the schema waits for it.
	for _, name := range keys(c.Services) {
		for dep, cond := range c.Services[name].DependsOn {
			require.Contains(t, c.Services, dep, "%s depends on %s", name, dep)
			require.Contains(t, []string{"", "service_started", "service_healthy", "service_completed_successfully"}, cond)
			if cond == "service_healthy" {
				require.NotNil(t, c.Services[dep].Healthcheck, "%s waits for %s to be healthy, which has no healthcheck", name, dep)
			}
		}
	}
	require.True(t, dependsOnTransitively(c, "migrate", "postgres", "service_healthy"), "migrate must wait for Postgres")
	require.Equal(t, []string{"migrate"}, []string(c.Services["migrate"].Command))
	for _, name := range append(relays, agents...) {
		require.True(t, dependsOnTransitively(c, name, "migrate", "service_completed_successfully"),
			"%s must start after migrate completed", name)
		require.True(t, dependsOnTransitively(c, name, "nats", "service_healthy"), "%s must wait for NATS", name)
	}
}

// dependsOnTransitively reports whether service name waits, directly or through other
// services, for dep with the condition.
func dependsOnTransitively(c composeFile, name, dep, condition string) bool {
	seen := map[string]bool{}
	var walk func(string) bool
	walk = func(s string) bool {
		if seen[s] {
			return false
		}
		seen[s] = true
		for d, cond := range c.Services[s].DependsOn {
			if (d == dep && cond == condition) || walk(d) {
				return true
			}
		}
		return false
	}
	return walk(name)
}

func TestComposePostgres(t *testing.T) {
	t.Parallel()
	s := loadCompose(t).Services["postgres"]
	image, tag, _ := strings.Cut(s.Image, ":")
	require.Equal(t, "postgres", image)
	version, _, _ := strings.Cut(tag, "-")
	majorText, _, _ := strings.Cut(version, ".")
	major, err := strconv.Atoi(majorText)
	require.NoError(t, err, "pin the postgres version: %s", s.Image)
	require.GreaterOrEqual(t, major, 15, "Baton needs PostgreSQL 15 or newer")
	settings := map[string]string{}
	for i, a := range s.Command {
		if a == "-c" && i+1 < len(s.Command) {
			k, v, _ := strings.Cut(s.Command[i+1], "=")
			settings[k] = v
		}
	}
	require.Equal(t, "logical", settings["wal_level"])
	require.NotEmpty(t, settings["max_slot_wal_keep_size"], "a stopped relay's slot must not fill the disk")
	require.NotEqual(t, "-1", settings["max_slot_wal_keep_size"])
	require.NotNil(t, s.Healthcheck)
	require.Contains(t, s.Healthcheck.Test, "pg_isready")
}

// natsConfigRE finds sync_interval: always inside the jetstream block of a NATS config.
var natsConfigRE = regexp.MustCompile(`(?s)jetstream\s*[:=]?\s*\{[^}]*\bsync_interval\s*[:=]\s*"?always"?`)

func TestComposeNATS(t *testing.T) {
	t.Parallel()
	s := loadCompose(t).Services["nats"]
	require.True(t, strings.HasPrefix(s.Image, "nats:"), s.Image)
	require.NotNil(t, s.Healthcheck)
	// The config file is mounted from deploy/nats and named by the command.
	var mounted bool
	for _, v := range s.Volumes {
		src, dst, _ := strings.Cut(v, ":")
		dst, _, _ = strings.Cut(dst, ":")
		if !strings.HasPrefix(src, "./deploy/nats/") {
			continue
		}
		require.Contains(t, s.Command, dst, "the command must load the mounted config %s", dst)
		conf := string(readFile(t, strings.TrimPrefix(src, "./")))
		require.Regexp(t, natsConfigRE, conf, "%s: JetStream must sync every write (sync_interval: always)", src)
		mounted = true
	}
	require.True(t, mounted, "the NATS config under deploy/nats is mounted")
}

// rolesSQLMount is how the compose file mounts roles.sql into the services that apply it.
const rolesSQLMount = "./deploy/postgres/roles.sql:/etc/baton/roles.sql:ro"

// TestComposePrograms checks every Baton service: its image target exists in the Dockerfile,
// its command, flags and BATON_* variables exist in the program, and it logs in to Postgres
// with the role of its job, once roles.sql gave that role its privileges.
func TestComposePrograms(t *testing.T) {
	t.Parallel()
	c := loadCompose(t)
	targets := dockerTargets(t)
	roles := rolesInRolesSQL(t)

	// The services applying roles.sql: each sets a password for every role it creates. One runs
	// before migrate (which logs in as the migrator roles.sql creates), one after it (the
	// privileges on the tables the migrations create).
	var grantsBefore, grantsAfter []string
	for _, name := range keys(c.Services) {
		r := c.Services[name]
		if !slices.Contains(r.Volumes, rolesSQLMount) {
			continue
		}
		script := strings.Join(r.Entrypoint, " ")
		require.Contains(t, script, "-f /etc/baton/roles.sql", name)
		for _, role := range roles {
			require.Contains(t, script, "ALTER ROLE "+role+" PASSWORD", "%s sets a password for %s", name, role)
		}
		if dependsOnTransitively(c, "migrate", name, "service_completed_successfully") {
			grantsBefore = append(grantsBefore, name)
		}
		if dependsOnTransitively(c, name, "migrate", "service_completed_successfully") {
			grantsAfter = append(grantsAfter, name)
		}
	}
	require.NotEmpty(t, grantsBefore, "migrate logs in as baton_migrator: roles.sql must create it before")
	require.NotEmpty(t, grantsAfter, "roles.sql must run after migrate, to grant on the tables it creates")
	for _, name := range keys(c.Services) {
		s := c.Services[name]
		prog := c.program(t, name)
		if prog == "" {
			require.Empty(t, batonEnv(s.Environment), "%s sets BATON_* variables but runs no Baton image", name)
			continue
		}
		t.Run(name, func(t *testing.T) {
			require.Contains(t, targets, prog, "deploy/Dockerfile has no target %s", prog)
			if s.Build != nil {
				require.Equal(t, "deploy/Dockerfile", s.Build.Dockerfile)
				require.Equal(t, ".", s.Build.Context)
			} else {
				require.Equal(t, "never", s.PullPolicy, "%s uses an image another service builds: it must not be pulled", name)
			}
			require.Empty(t, s.Entrypoint, "the image's entrypoint is the program")
			checkInvocation(t, invocation{
				where:   "docker-compose.yml service " + name,
				program: prog,
				args:    s.Command,
				env:     batonEnv(s.Environment),
			})
			if dbURL := s.Environment["BATON_DATABASE_URL"]; dbURL != "" {
				u, err := url.Parse(dbURL)
				require.NoError(t, err)
				user := u.User.Username()
				switch {
				case prog == progBaton && len(s.Command) > 0 && s.Command[0] == "relay":
					require.Equal(t, "baton_relay", user, "%s logs in as the relay role", name)
				case prog == progEchoagent:
					require.Equal(t, "baton_worker", user, "%s logs in as the worker role", name)
				case prog == progBaton && len(s.Command) > 0 && s.Command[0] == "migrate":
					require.Equal(t, "baton_migrator", user, "%s logs in as the migrator role", name)
				case prog == progBaton && len(s.Command) > 0 && s.Command[0] == "console":
					require.Equal(t, "baton_console", user, "%s logs in as the console role", name)
				default:
					require.Contains(t, roles, user, "%s logs in as a role of roles.sql", name)
				}
				if user != "baton_migrator" {
					require.True(t, slices.ContainsFunc(grantsAfter, func(g string) bool {
						return dependsOnTransitively(c, name, g, "service_completed_successfully")
					}), "%s logs in as %s: it must wait for roles.sql to run after migrate (%v)", name, user, grantsAfter)
				}
			}
			if s.Healthcheck != nil {
				checkHealthcheck(t, name, s)
			}
		})
	}
}

// checkHealthcheck checks a Baton service's health check: the image's probe, on the port of
// BATON_METRICS_ADDR.
func checkHealthcheck(t *testing.T, name string, s composeService) {
	t.Helper()
	test := s.Healthcheck.Test
	require.GreaterOrEqual(t, len(test), 3, "%s: healthcheck %v", name, test)
	require.Equal(t, "CMD", test[0], "%s: the images have no shell: use CMD", name)
	require.Equal(t, "/usr/local/bin/healthcheck", test[1])
	u, err := url.Parse(test[len(test)-1])
	require.NoError(t, err)
	require.Contains(t, []string{"/healthz", "/readyz"}, u.Path)
	_, port, err := net.SplitHostPort(s.Environment["BATON_METRICS_ADDR"])
	require.NoError(t, err, "%s: a healthcheck needs BATON_METRICS_ADDR", name)
	require.Equal(t, port, u.Port(), "%s: healthcheck port", name)
}

// rolesRE finds the roles roles.sql creates.
var rolesRE = regexp.MustCompile(`CREATE ROLE (baton_[a-z_]+)`)

func rolesInRolesSQL(t *testing.T) []string {
	t.Helper()
	var roles []string
	for _, m := range rolesRE.FindAllStringSubmatch(string(readFile(t, "deploy", "postgres", "roles.sql")), -1) {
		roles = append(roles, m[1])
	}
	slices.Sort(roles)
	require.Equal(t, []string{"baton_app", "baton_console", "baton_migrator", "baton_relay", "baton_worker"}, roles)
	return roles
}

func TestComposeFiles(t *testing.T) {
	t.Parallel()
	c := loadCompose(t)
	for _, name := range keys(c.Services) {
		for _, v := range c.Services[name].Volumes {
			src, _, _ := strings.Cut(v, ":")
			if strings.HasPrefix(src, "./") {
				_, err := os.Stat(path(src))
				require.NoError(t, err, "%s mounts %s", name, src)
				continue
			}
			require.Contains(t, c.Volumes, src, "%s uses volume %s, which is not declared", name, src)
		}
	}
}

// stageRE matches the stages of deploy/Dockerfile: FROM base [AS name].
var stageRE = regexp.MustCompile(`(?mi)^FROM\s+(\S+)(?:\s+AS\s+(\S+))?\s*$`)

// dockerTargets returns the stage names of deploy/Dockerfile, in order.
func dockerTargets(t *testing.T) []string {
	t.Helper()
	var names []string
	for _, m := range stageRE.FindAllStringSubmatch(string(readFile(t, "deploy", "Dockerfile")), -1) {
		names = append(names, m[2])
	}
	return names
}

func TestDockerfile(t *testing.T) {
	t.Parallel()
	df := string(readFile(t, "deploy", "Dockerfile"))
	stages := stageRE.FindAllStringSubmatch(df, -1)
	require.NotEmpty(t, stages)
	targets := dockerTargets(t)
	for _, want := range []string{progBaton, progEchoagent, progSubscriber} {
		require.Contains(t, targets, want)
	}
	require.Equal(t, progBaton, targets[len(targets)-1], "baton is the default (last) target")

	// Static binaries, no toolchain download, and only the module proxy as a network source.
	require.Contains(t, df, "CGO_ENABLED=0")
	require.Contains(t, df, "GOTOOLCHAIN=local")
	for _, line := range strings.Split(df, "\n") {
		if !strings.HasPrefix(strings.TrimSpace(line), "RUN ") {
			continue
		}
		for _, bad := range []string{"curl", "wget", "apk ", "apt-get", "git clone", "go install", "go get"} {
			require.NotContains(t, line, bad, "the build fetches nothing but modules: %s", line)
		}
	}

	// Each program's build stage builds the package that exists in the module, and its
	// runtime stage runs as a non-root user on a static base.
	for _, prog := range []string{progBaton, progEchoagent, progSubscriber, progHealthcheck} {
		pkg := "./" + programPackages[prog]
		require.Regexp(t, regexp.MustCompile(`(?m)^RUN go build .*-o /out/`+prog+` `+regexp.QuoteMeta(pkg)+`$`), df)
		if prog != progSubscriber || programExists(prog) {
			_, err := os.Stat(path(programPackages[prog], "main.go"))
			require.NoError(t, err)
		}
	}
	base := map[string]string{} // stage -> what it is built FROM
	for _, m := range stages {
		base[m[2]] = m[1]
	}
	root := func(stage string) string {
		for base[stage] != "" && slices.Contains(targets, base[stage]) {
			stage = base[stage]
		}
		return base[stage]
	}
	for _, prog := range []string{progBaton, progEchoagent, progSubscriber} {
		b := root(prog)
		require.True(t, strings.HasPrefix(b, "gcr.io/distroless/static") || b == "scratch", "%s runs on %s", prog, b)
		require.True(t, strings.HasSuffix(b, ":nonroot") || b == "scratch", "%s: distroless nonroot", prog)
	}
	users := regexp.MustCompile(`(?m)^USER\s+(\S+)`).FindAllStringSubmatch(df, -1)
	require.NotEmpty(t, users)
	for _, u := range users {
		uid, _, _ := strings.Cut(u[1], ":")
		n, err := strconv.Atoi(uid)
		require.NoError(t, err, "USER %s: numeric, so Kubernetes runAsNonRoot can verify it", u[1])
		require.NotZero(t, n)
	}
	// The ignore file keeps the context small but must not drop the probe's source.
	ignore := string(readFile(t, "deploy", "Dockerfile.dockerignore"))
	require.Contains(t, ignore, "!deploy/healthcheck")
	require.Contains(t, ignore, ".git")
}

func TestBatonUsageParsed(t *testing.T) {
	t.Parallel()
	cmds := batonCommands(t)
	// The relay reads every variable a deploy file sets for it; so does migrate its URL.
	require.True(t, cmds["relay"].env["BATON_NATS_URL"])
	require.True(t, cmds["migrate"].env["BATON_DATABASE_URL"])
	require.False(t, cmds["migrate"].env["BATON_NATS_URL"])
}

// The images link no NATS server: each program is built the way deploy/Dockerfile builds it
// (its go build line's tags), and `go version -m` must list no nats-server module. baton links
// one only for the embedded server of `baton demo` and `baton bench`, which the image's build
// tag leaves out; a build without the tag does link it, so the check can fail.
func TestImagesLinkNoNATSServer(t *testing.T) {
	t.Parallel()
	df := string(readFile(t, "deploy", "Dockerfile"))
	goBin, err := exec.LookPath("go")
	require.NoError(t, err, "the go command builds the programs")
	build := func(out string, args ...string) string {
		t.Helper()
		cmd := exec.Command(goBin, append([]string{"build", "-o", out}, args...)...)
		cmd.Dir = root
		b, err := cmd.CombinedOutput()
		require.NoError(t, err, "go build %v: %s", args, b)
		b, err = exec.Command(goBin, "version", "-m", out).CombinedOutput()
		require.NoError(t, err, "%s", b)
		return string(b)
	}
	dir := t.TempDir()
	for _, prog := range []string{progBaton, progEchoagent, progSubscriber} {
		if prog == progSubscriber && !programExists(prog) {
			continue
		}
		line := regexp.MustCompile(`(?m)^RUN go build (.*)-o /out/` + prog + ` `).FindStringSubmatch(df)
		require.NotNil(t, line, "deploy/Dockerfile builds no %s", prog)
		var args []string
		if m := regexp.MustCompile(`-tags (\S+)`).FindStringSubmatch(line[1]); m != nil {
			args = append(args, "-tags", m[1])
		}
		info := build(filepath.Join(dir, prog), append(args, "./"+programPackages[prog])...)
		require.NotContains(t, info, "github.com/nats-io/nats-server", "the %s image links a NATS server", prog)
	}
	require.Contains(t, build(filepath.Join(dir, "baton-demo"), "./"+programPackages[progBaton]),
		"github.com/nats-io/nats-server", "without the tag baton links the demo's server, so the check above can fail")
}
