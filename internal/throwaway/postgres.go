// Package throwaway starts local servers that last no longer than the process that starts
// them: a PostgreSQL cluster in a temporary directory (initdb, wal_level=logical), run from the
// machine's server binaries, and a NATS server with JetStream inside this process. `baton demo`
// runs on them when it is given no servers of its own.
package throwaway

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"net/url"
	"os"
	"os/exec"
	"os/user"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5"
)

// ErrNoPostgres says how to get the PostgreSQL server binaries.
var ErrNoPostgres = errors.New("PostgreSQL server binaries (initdb, postgres) not found: " +
	"install them (Debian/Ubuntu: `apt-get install -y postgresql`) or put their directory on PATH via pg_config")

// Postgres is a throwaway PostgreSQL cluster in a temporary directory, and its server.
type Postgres struct {
	// Dir is the temporary directory: it holds the data directory (Dir/data), the server's
	// log (Dir/postgres.log) and its Unix socket, where clients connect (URL). Close removes it.
	Dir string
	// Port is the server's port: the number in its socket's name (SocketPath), and with
	// PostgresOptions.TCP the TCP port it listens on, on 127.0.0.1.
	Port int
	// TCP reports whether the server listens on 127.0.0.1:Port too (PostgresOptions.TCP).
	TCP bool

	binDir string
	cred   *syscall.Credential // non-nil when running as root: the server runs as user postgres
	mu     sync.Mutex
	cmd    *exec.Cmd // the running server; nil when it is not running
	exited chan struct{}
}

// findBinDir returns the directory holding initdb and postgres.
func findBinDir(ctx context.Context) (string, error) {
	var candidates []string
	if out, err := exec.CommandContext(ctx, "pg_config", "--bindir").Output(); err == nil {
		candidates = append(candidates, strings.TrimSpace(string(out)))
	}
	globbed, _ := filepath.Glob("/usr/lib/postgresql/*/bin")
	sort.Slice(globbed, func(i, j int) bool { return pgMajor(globbed[i]) > pgMajor(globbed[j]) })
	candidates = append(candidates, globbed...)
	if p, err := exec.LookPath("initdb"); err == nil {
		candidates = append(candidates, filepath.Dir(p))
	}
	for _, dir := range candidates {
		if isExec(filepath.Join(dir, "initdb")) && isExec(filepath.Join(dir, "postgres")) {
			return dir, nil
		}
	}
	return "", ErrNoPostgres
}

func pgMajor(binDir string) int {
	n, _ := strconv.Atoi(filepath.Base(filepath.Dir(binDir)))
	return n
}

func isExec(path string) bool {
	st, err := os.Stat(path)
	return err == nil && !st.IsDir() && st.Mode()&0o111 != 0
}

// StartPostgres runs initdb in a new temp directory and starts the server on a Unix socket in
// that directory, with no TCP listener: no port is chosen, so none can be taken by another
// process between a choice and the server's bind (or across a restart). Close stops it and
// removes the directory.
func StartPostgres(ctx context.Context) (*Postgres, error) {
	return StartPostgresWith(ctx, PostgresOptions{})
}

// PostgresOptions are the settings a cluster may start with beyond the throwaway defaults
// (trust authentication, no TLS). The zero value is StartPostgres's cluster.
type PostgresOptions struct {
	// TLS, when set, turns ssl on with this server certificate and key.
	TLS *PostgresTLS
	// HBA lines go before the trust lines initdb writes to pg_hba.conf; the first line that
	// matches a connection decides, so these can ask some roles or databases for a password
	// (local all app scram-sha-256; host ... for TCP) or for TLS (hostssl ...). Default: none.
	HBA []string
	// TCP makes the server listen on 127.0.0.1 as well as on its socket, for what a Unix
	// socket cannot carry: TLS (which turns it on) and pg_hba.conf host lines. Its port is
	// chosen at random below the system's ephemeral range (where no listener on port 0 is
	// ever given it) and bound by the server itself, another one tried when it is taken;
	// StartServer after StopServer binds the same port again, waiting while it is taken.
	TCP bool
	// Settings are postgresql.conf lines ("shared_preload_libraries = 'pg_stat_statements'")
	// written after the throwaway defaults, which they override. Default: none.
	Settings []string
}

// PostgresTLS is the server certificate of a cluster started with TLS.
type PostgresTLS struct {
	// CertPEM is the server certificate, optionally followed by its intermediates (PEM).
	CertPEM []byte
	// KeyPEM is the server certificate's private key (PEM, unencrypted). It is written
	// with mode 0600, owned by the user the server runs as, as PostgreSQL requires.
	KeyPEM []byte
}

// StartPostgresWith is StartPostgres with opts.
func StartPostgresWith(ctx context.Context, opts PostgresOptions) (*Postgres, error) {
	bin, err := findBinDir(ctx)
	if err != nil {
		return nil, err
	}
	dir, err := os.MkdirTemp("", "baton-pg-")
	if err != nil {
		return nil, fmt.Errorf("postgres temp dir: %w", err)
	}
	p := &Postgres{Dir: dir, binDir: bin, Port: socketPort, TCP: opts.TCP || opts.TLS != nil}
	if os.Geteuid() == 0 {
		// initdb and postgres refuse to run as root.
		u, err := user.Lookup("postgres")
		if err != nil {
			_ = os.RemoveAll(dir)
			return nil, fmt.Errorf("running as root needs the system user postgres to own the cluster: %w", err)
		}
		uid, uidErr := strconv.ParseUint(u.Uid, 10, 32)
		gid, gidErr := strconv.ParseUint(u.Gid, 10, 32)
		if err := errors.Join(uidErr, gidErr); err != nil {
			_ = os.RemoveAll(dir)
			return nil, fmt.Errorf("user postgres: %w", err)
		}
		p.cred = &syscall.Credential{Uid: uint32(uid), Gid: uint32(gid)}
		if err := os.Chown(dir, int(uid), int(gid)); err != nil {
			_ = os.RemoveAll(dir)
			return nil, fmt.Errorf("chown %s: %w", dir, err)
		}
	}
	initdb := p.command(ctx, filepath.Join(bin, "initdb"), "-D", p.dataDir(), "-U", "postgres",
		"--auth=trust", "--encoding=UTF8", "--locale=C", "--no-sync")
	if out, err := initdb.CombinedOutput(); err != nil {
		_ = os.RemoveAll(dir)
		return nil, fmt.Errorf("initdb: %w: %s", err, out)
	}
	// Settings go to postgresql.conf, not the command line, so ALTER SYSTEM can still change
	// them (command-line settings would override it).
	if err := appendFile(filepath.Join(p.dataDir(), "postgresql.conf"), serverSettings+strings.Join(opts.Settings, "\n")+"\n"); err != nil {
		_ = os.RemoveAll(dir)
		return nil, err
	}
	if err := p.configure(opts); err != nil {
		_ = os.RemoveAll(dir)
		return nil, err
	}
	if err := p.firstStart(ctx); err != nil {
		_ = os.RemoveAll(dir)
		return nil, err
	}
	return p, nil
}

// socketPort is the port of a server with no TCP listener: only its socket's name holds it.
const socketPort = 5432

// firstStart starts the server for the first time: with TCP, on a random port below the
// ephemeral range, trying another while the one tried is taken.
func (p *Postgres) firstStart(ctx context.Context) error {
	if !p.TCP {
		return p.startServer(ctx)
	}
	low, high := tcpPortRange()
	for try := 1; ; try++ {
		p.Port = low + rand.IntN(high-low) //nolint:gosec // G404: a port number, not a secret
		err := p.startServer(ctx)
		if !errors.Is(err, errPortTaken) || try == 20 {
			return err
		}
	}
}

// tcpPortRange returns the ports firstStart picks from: below the first port of the system's
// ephemeral range (ip_local_port_range), where the kernel never puts a listener on port 0
// nor a client's connection, and above the well-known and most registered ports.
func tcpPortRange() (low, high int) {
	low, high = 10000, 32768 // Linux's default ephemeral range starts at 32768
	if b, err := os.ReadFile("/proc/sys/net/ipv4/ip_local_port_range"); err == nil {
		if f := strings.Fields(string(b)); len(f) == 2 {
			if n, err := strconv.Atoi(f[0]); err == nil && n > low+1000 {
				high = n
			}
		}
	}
	return low, high
}

// errPortTaken is StartServer's error when another process holds the server's TCP port.
var errPortTaken = errors.New("the port is taken")

// serverSettings are what every throwaway cluster runs with: logical replication, room for
// many replication slots and connections at once, and no fsync (the cluster lives no longer
// than the process; a killed server loses nothing the OS already has).
const serverSettings = `
# baton throwaway cluster
wal_level = logical
max_replication_slots = 64
max_wal_senders = 64
max_connections = 300
shared_buffers = 128MB
fsync = off
full_page_writes = off
synchronous_commit = on
wal_sender_timeout = 60s
max_slot_wal_keep_size = 4GB
log_min_messages = warning
log_line_prefix = '%m [%p] %e %u@%d '
`

// configure writes what opts asks for into the data directory, before the first start.
func (p *Postgres) configure(opts PostgresOptions) error {
	if len(opts.HBA) > 0 {
		path := filepath.Join(p.dataDir(), "pg_hba.conf")
		initdbLines, err := os.ReadFile(path) //nolint:gosec // G304: a file of the cluster this package created
		if err != nil {
			return fmt.Errorf("read %s: %w", path, err)
		}
		lines := "# baton throwaway cluster: options first (the first matching line decides)\n" +
			strings.Join(opts.HBA, "\n") + "\n\n"
		// The file exists, owned by the cluster's user: WriteFile keeps its owner and mode.
		if err := os.WriteFile(path, append([]byte(lines), initdbLines...), 0o600); err != nil { //nolint:gosec // G703: a file of the cluster this package created
			return fmt.Errorf("write %s: %w", path, err)
		}
	}
	if opts.TLS != nil {
		// ssl_cert_file and ssl_key_file default to server.crt and server.key in the data
		// directory. The server refuses a key that others may read or that is not its user's.
		for _, f := range []struct {
			name string
			data []byte
		}{{"server.crt", opts.TLS.CertPEM}, {"server.key", opts.TLS.KeyPEM}} {
			path := filepath.Join(p.dataDir(), f.name)
			if err := os.WriteFile(path, f.data, 0o600); err != nil {
				return fmt.Errorf("write %s: %w", path, err)
			}
			if p.cred != nil {
				if err := os.Chown(path, int(p.cred.Uid), int(p.cred.Gid)); err != nil {
					return fmt.Errorf("chown %s: %w", path, err)
				}
			}
		}
		if err := appendFile(filepath.Join(p.dataDir(), "postgresql.conf"), "ssl = on\n"); err != nil {
			return err
		}
	}
	return nil
}

func appendFile(path, text string) error {
	f, err := os.OpenFile(path, os.O_APPEND|os.O_WRONLY, 0) //nolint:gosec // G304: a file of the cluster this package created
	if err != nil {
		return fmt.Errorf("open %s: %w", path, err)
	}
	if _, err := f.WriteString(text); err != nil {
		_ = f.Close()
		return fmt.Errorf("write %s: %w", path, err)
	}
	return f.Close()
}

func (p *Postgres) dataDir() string { return filepath.Join(p.Dir, "data") }

func (p *Postgres) logPath() string { return filepath.Join(p.Dir, "postgres.log") }

// LogPath returns the server's log file. Each line starts with log_line_prefix
// '%m [%p] %e %u@%d ': time, pid, SQLSTATE, user@database.
func (p *Postgres) LogPath() string { return p.logPath() }

// command runs name, a binary from binDir, in the cluster's directory as the cluster's user.
// ctx kills it when it ends.
func (p *Postgres) command(ctx context.Context, name string, args ...string) *exec.Cmd {
	cmd := exec.CommandContext(ctx, name, args...) //nolint:gosec // G204: initdb or postgres from findBinDir
	cmd.Dir = p.Dir
	cmd.Env = append(os.Environ(), "LC_ALL=C")
	cmd.SysProcAttr = &syscall.SysProcAttr{
		Credential: p.cred,
		Setpgid:    true,
		// The server dies with this process, even when it panics or is killed.
		Pdeathsig: syscall.SIGKILL,
	}
	return cmd
}

// StartServer starts the server on the cluster's data directory and Port, and waits until it
// accepts connections; it fails when the server is running. StartPostgres starts it, and after
// StopServer it starts it again on the same socket (and port) and data. A TCP port another
// process took meanwhile is waited for, up to a minute.
func (p *Postgres) StartServer(ctx context.Context) error {
	deadline := time.Now().Add(time.Minute)
	for {
		err := p.startServer(ctx)
		if !errors.Is(err, errPortTaken) || time.Now().After(deadline) {
			return err
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("wait for port %d: %w", p.Port, ctx.Err())
		case <-time.After(100 * time.Millisecond):
		}
	}
}

func (p *Postgres) startServer(ctx context.Context) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.cmd != nil {
		return errors.New("postgres already running")
	}
	listen := ""
	if p.TCP {
		listen = "127.0.0.1"
	}
	// The log's size before this start: a failed bind is looked for in what it adds.
	var logStart int64
	if st, err := os.Stat(p.logPath()); err == nil {
		logStart = st.Size()
	}
	// The server writes through the descriptor it inherits, so only this process needs access.
	logf, err := os.OpenFile(p.logPath(), os.O_CREATE|os.O_APPEND|os.O_WRONLY, 0o600)
	if err != nil {
		return fmt.Errorf("postgres log: %w", err)
	}
	// The server outlives ctx, which bounds only the start: StopServer and Close end it.
	cmd := p.command(context.WithoutCancel(ctx), filepath.Join(p.binDir, "postgres"), "-D", p.dataDir(),
		"-p", strconv.Itoa(p.Port),
		"-c", "listen_addresses="+listen,
		"-c", "unix_socket_directories="+p.Dir,
	)
	cmd.Stdout, cmd.Stderr = logf, logf
	if err := cmd.Start(); err != nil {
		_ = logf.Close()
		return fmt.Errorf("start postgres: %w", err)
	}
	exited := make(chan struct{})
	go func() { _ = cmd.Wait(); _ = logf.Close(); close(exited) }()
	p.cmd, p.exited = cmd, exited

	deadline := time.Now().Add(60 * time.Second)
	for {
		cctx, cancel := context.WithTimeout(ctx, 2*time.Second)
		conn, err := pgx.Connect(cctx, p.URL("postgres"))
		cancel()
		if err == nil {
			_ = conn.Close(ctx)
			return nil
		}
		select {
		case <-exited:
			p.cmd = nil
			if p.TCP && p.bindFailed(logStart) {
				return fmt.Errorf("postgres on port %d: %w", p.Port, errPortTaken)
			}
			return fmt.Errorf("postgres exited during start-up: %s", p.logTail())
		case <-ctx.Done():
			_ = syscall.Kill(-cmd.Process.Pid, syscall.SIGKILL) // never leave a half-started server
			<-exited
			p.cmd = nil
			return fmt.Errorf("wait for postgres: %w", ctx.Err())
		case <-time.After(25 * time.Millisecond):
		}
		if time.Now().After(deadline) {
			_ = syscall.Kill(-cmd.Process.Pid, syscall.SIGKILL)
			<-exited
			p.cmd = nil
			return fmt.Errorf("postgres not ready after 60s: %w; log: %s", err, p.logTail())
		}
	}
}

// bindFailed reports whether the server's log, from offset on, says that its TCP port was
// taken ("could not bind IPv4 address ...: Address already in use").
func (p *Postgres) bindFailed(offset int64) bool {
	b, err := os.ReadFile(p.logPath())
	if err != nil || int64(len(b)) < offset {
		return false
	}
	return bytes.Contains(b[offset:], []byte("Address already in use"))
}

func (p *Postgres) logTail() string {
	b, _ := os.ReadFile(p.logPath())
	if len(b) > 2000 {
		b = b[len(b)-2000:]
	}
	return string(bytes.TrimSpace(b))
}

// URL returns a connection string for database db, through the server's Unix socket.
func (p *Postgres) URL(db string) string {
	q := url.Values{"host": {p.Dir}, "port": {strconv.Itoa(p.Port)}, "sslmode": {"disable"}}
	return (&url.URL{Scheme: "postgres", User: url.User("postgres"), Path: "/" + db, RawQuery: q.Encode()}).String()
}

// TCPURL returns a connection string for database db over TCP, on 127.0.0.1:Port; "" when
// the server has no TCP listener (PostgresOptions.TCP).
func (p *Postgres) TCPURL(db string) string {
	if !p.TCP {
		return ""
	}
	return fmt.Sprintf("postgres://postgres@127.0.0.1:%d/%s?sslmode=disable", p.Port, db)
}

// SocketPath returns the path of the server's Unix socket, which a TCP proxy may dial.
func (p *Postgres) SocketPath() string {
	return filepath.Join(p.Dir, ".s.PGSQL."+strconv.Itoa(p.Port))
}

// StopServer stops the server with sig, PostgreSQL's choice of shutdown mode, and waits until it
// has exited (killing it after 60s); it does nothing when the server is not running. The data
// directory stays. syscall.SIGINT is a fast shutdown (sessions are disconnected, a checkpoint
// runs), syscall.SIGQUIT an immediate one (no checkpoint: the next start recovers from the WAL).
func (p *Postgres) StopServer(sig syscall.Signal) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.cmd == nil {
		return nil
	}
	if err := p.cmd.Process.Signal(sig); err != nil && !errors.Is(err, os.ErrProcessDone) {
		return fmt.Errorf("signal postgres: %w", err)
	}
	select {
	case <-p.exited:
	case <-time.After(60 * time.Second):
		_ = syscall.Kill(-p.cmd.Process.Pid, syscall.SIGKILL)
		<-p.exited
	}
	p.cmd = nil
	return nil
}

// Close stops the server (fast shutdown) and removes its directory.
func (p *Postgres) Close() error {
	err := p.StopServer(syscall.SIGINT)
	if rmErr := os.RemoveAll(p.Dir); rmErr != nil && err == nil {
		err = fmt.Errorf("remove %s: %w", p.Dir, rmErr)
	}
	return err
}
