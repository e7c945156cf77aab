package console

import (
	"errors"
	"fmt"
	"log/slog"
	"net"
	"strings"
	"time"

	"github.com/caarlos0/env/v11"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go"

	"github.com/batonhq/baton/natsconn"
)

// Names of the console's own environment variables; the database, NATS and schema settings are
// the other commands' (internal/config).
const (
	EnvAddr         = "BATON_CONSOLE_ADDR"
	EnvUser         = "BATON_CONSOLE_USER"
	EnvPassword     = "BATON_CONSOLE_PASSWORD"      //nolint:gosec // G101: the name of a variable, not a password
	EnvPasswordFile = "BATON_CONSOLE_PASSWORD_FILE" //nolint:gosec // G101: the name of a variable that holds a path
)

// Defaults of Config and Settings.
const (
	// DefaultAddr is where the console listens: loopback only.
	DefaultAddr = "127.0.0.1:8080"
	// DefaultPollInterval is how often a watched conversation's rows are read.
	DefaultPollInterval = 250 * time.Millisecond
	// DefaultMaxStreams caps the Server-Sent Events streams open at once.
	DefaultMaxStreams = 64
	// DefaultMaxStreamsPerClient caps the streams one client (remote IP address) holds at once.
	DefaultMaxStreamsPerClient = 8
	// DefaultMaxBodyBytes caps a request body.
	DefaultMaxBodyBytes = 64 << 10
	// DefaultMaxContentBytes caps a message's content (the producer's MaxContentBytes).
	DefaultMaxContentBytes = 32 << 10
	// DefaultRequestTimeout bounds the database work of one API request.
	DefaultRequestTimeout = 10 * time.Second
	// DefaultStreamReadTimeout bounds one read of an event stream's poll.
	DefaultStreamReadTimeout = 5 * time.Second
	// DefaultMaxStreamAge is how long an event stream lives before the server ends it (the
	// browser reconnects within a second and gets every state again).
	DefaultMaxStreamAge = 5 * time.Minute
)

// Settings are the console's own settings, from the environment (BATON_CONSOLE_*); flags may
// override them before Resolve.
type Settings struct {
	// Addr is the host:port the console listens on. Default: DefaultAddr (127.0.0.1:8080).
	Addr string `env:"BATON_CONSOLE_ADDR" envDefault:"127.0.0.1:8080"`
	// User and Password turn on HTTP basic auth when both are set. Default: none (no auth,
	// allowed only on a loopback address).
	User     string `env:"BATON_CONSOLE_USER"`
	Password string `env:"BATON_CONSOLE_PASSWORD"`
	// PasswordFile is the path of a file holding Password (one trailing newline removed).
	// Setting both is an error. Default: none.
	PasswordFile string `env:"BATON_CONSOLE_PASSWORD_FILE"`
	// MaxStreamsPerClient is Config.MaxStreamsPerClient, set by the flag
	// --max-streams-per-client (no environment variable, as for the global cap). Default: 0,
	// which Config takes as DefaultMaxStreamsPerClient (8).
	MaxStreamsPerClient int
}

// LogValue never logs the password.
func (s Settings) LogValue() slog.Value {
	return slog.GroupValue(slog.String("addr", s.Addr), slog.String("user", s.User),
		slog.Bool("password_set", s.Password != ""), slog.String("password_file", s.PasswordFile),
		slog.Int("max_streams_per_client", s.MaxStreamsPerClient))
}

// String never prints the password.
func (s Settings) String() string {
	return fmt.Sprintf("{Addr:%s User:%s PasswordSet:%t PasswordFile:%s MaxStreamsPerClient:%d}",
		s.Addr, s.User, s.Password != "", s.PasswordFile, s.MaxStreamsPerClient)
}

// SettingsFromEnv reads the settings from the environment.
func SettingsFromEnv() (Settings, error) {
	s, err := env.ParseAs[Settings]()
	if err != nil {
		return Settings{}, fmt.Errorf("read console settings from the environment: %w", err)
	}
	return s, nil
}

// ErrInsecure is the refusal to listen on a non-loopback address without auth.
var ErrInsecure = errors.New("refusing to serve the console on a non-loopback address without authentication")

// Resolve reads PasswordFile and checks the settings: auth is both user and password or
// neither, and a non-loopback Addr needs auth (ErrInsecure). Its errors never hold the password.
func (s *Settings) Resolve() error {
	if s.PasswordFile != "" {
		// Read like every *_FILE setting: at most 1 MiB (a device such as /dev/zero, or a
		// large file named by mistake, fails instead of filling memory), one trailing newline
		// dropped, errors naming the variable and the path, never the contents.
		pw, err := natsconn.ValueOrFile(EnvPassword, s.Password, EnvPasswordFile, s.PasswordFile)
		if err != nil {
			return err
		}
		s.Password = pw
	}
	if (s.User == "") != (s.Password == "") {
		return fmt.Errorf("basic auth needs both %s and %s (or %s)", EnvUser, EnvPassword, EnvPasswordFile)
	}
	if strings.ContainsRune(s.User, ':') {
		return fmt.Errorf("%s must not contain ':'", EnvUser)
	}
	host, _, err := net.SplitHostPort(s.Addr)
	if err != nil {
		return fmt.Errorf("%s: must be host:port (got %q)", EnvAddr, s.Addr)
	}
	if s.User == "" && !IsLoopback(host) {
		return fmt.Errorf("%w: %s is %q; listen on 127.0.0.1 or set %s and %s (or %s)",
			ErrInsecure, EnvAddr, s.Addr, EnvUser, EnvPassword, EnvPasswordFile)
	}
	return nil
}

// IsLoopback reports whether a listen host reaches this machine only: localhost or a loopback
// IP. An empty host, 0.0.0.0, :: and any other name listen on (or may resolve to) the network.
func IsLoopback(host string) bool {
	if strings.EqualFold(host, "localhost") {
		return true
	}
	ip := net.ParseIP(strings.Trim(host, "[]"))
	return ip != nil && ip.IsLoopback()
}

// Config configures a Server.
type Config struct {
	// Pool reads Baton's tables and sends through the producer; its search_path must name
	// Baton's schema. Connect it as baton_console (deploy/postgres/roles.sql). Required.
	Pool *pgxpool.Pool
	// NATS, when set, wakes a watched conversation at once when its outcome is published,
	// and adds the streams and the dead-letter count to the system view. Default: nil
	// (conversations are polled only; no streams section).
	NATS *nats.Conn
	// NATSURL is the NATS URL shown in the status (redacted by the caller). Default: "".
	NATSURL string
	// Schema, SubjectPrefix, Slot, Publication and Durable are the statusreport.Options.
	// Defaults: statusreport's (public, agent, baton, baton, baton-workers).
	Schema, SubjectPrefix, Slot, Publication, Durable string
	// User and Password turn on basic auth when User is set. Default: none.
	User, Password string
	// PollInterval is how often a watched conversation is read. Default: DefaultPollInterval.
	PollInterval time.Duration
	// MaxStreams caps the open event streams. Default: DefaultMaxStreams.
	MaxStreams int
	// MaxStreamsPerClient caps the open event streams of one client, by the IP address of the
	// connection (r.RemoteAddr; X-Forwarded-For is not trusted, so behind a reverse proxy all
	// clients are one). Each stream polls the database, so one client opening many would take
	// MaxStreams from everyone else and keep the database busy; a browser opens one per
	// visible chat tab. Zero means the default; a negative value is an error. Default:
	// DefaultMaxStreamsPerClient.
	MaxStreamsPerClient int
	// MaxBodyBytes caps request bodies. Default: DefaultMaxBodyBytes.
	MaxBodyBytes int64
	// MaxContentBytes caps message contents. Default: DefaultMaxContentBytes.
	MaxContentBytes int
	// RequestTimeout bounds the database work of one API request: a database that stops
	// answering (a half-open connection, a failover whose old address went away) makes the
	// request answer 503 instead of hanging until the client gives up. Default:
	// DefaultRequestTimeout.
	RequestTimeout time.Duration
	// MaxStreamAge ends an event stream after this long; the page's EventSource reconnects at
	// once and its first event rebuilds every state. A client that vanished without closing
	// its connection (its host gone: half-open TCP) still takes writes into the kernel's buffer
	// for a long time: this bounds how long it holds one of MaxStreams. Default:
	// DefaultMaxStreamAge.
	MaxStreamAge time.Duration
	// StreamReadTimeout bounds each read of an event stream's poll; a read that times out is
	// retried at the next poll. Default: DefaultStreamReadTimeout.
	StreamReadTimeout time.Duration
	// Logger receives the console's logs. Default: nil, discard.
	Logger *slog.Logger
}
