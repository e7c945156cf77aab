// Package config reads Baton's configuration from the environment (BATON_*) and lets
// command-line flags override it.
//
// Load parses and validates in one step. Commands that accept flags call FromEnv, bind the
// flags they offer with BindFlags, parse them, then call Validate and Require for the values
// they need. Every error names the variable (or the flag) it is about.
//
// Connection strings carry passwords. Redact masks them, and Config's LogValue and String use
// it, so a Config can be logged or printed without leaking a secret. They may also come from
// files (BATON_DATABASE_URL_FILE, BATON_NATS_URL_FILE), read by Resolve once the flags are
// parsed. The NATS login and TLS settings (BATON_NATS_CREDS, _NKEY, _CA, _CERT, _KEY) become
// nats.go options in package natsconn, which every Baton process connects through (NATS).
package config

import (
	"cmp"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"math"
	"net"
	"net/url"
	"strconv"
	"strings"
	"time"

	"github.com/caarlos0/env/v11"

	"github.com/batonhq/baton/internal/pgname"
	"github.com/batonhq/baton/natsconn"
	"github.com/batonhq/baton/wire"
)

// Names of the environment variables Baton reads.
const (
	EnvDatabaseURL     = "BATON_DATABASE_URL"
	EnvDatabaseURLFile = "BATON_DATABASE_URL_FILE"
	EnvNATSURL         = natsconn.EnvURL
	EnvNATSURLFile     = natsconn.EnvURLFile
	EnvNATSCreds       = natsconn.EnvCreds
	EnvNATSNKey        = natsconn.EnvNKey
	EnvNATSCA          = natsconn.EnvCA
	EnvNATSCert        = natsconn.EnvCert
	EnvNATSKey         = natsconn.EnvKey
	EnvSubjectPrefix   = "BATON_SUBJECT_PREFIX"
	EnvSlot            = "BATON_SLOT"
	EnvPublication     = "BATON_PUBLICATION"
	EnvSchema          = "BATON_SCHEMA"
	EnvMetricsAddr     = "BATON_METRICS_ADDR"
	EnvPprofAddr       = "BATON_PPROF_ADDR"
	// EnvPprofAllowRemote lets BATON_PPROF_ADDR be an address other than loopback.
	EnvPprofAllowRemote = "BATON_PPROF_ALLOW_REMOTE"
	EnvFatalLinger      = "BATON_FATAL_LINGER"
	EnvLogLevel         = "BATON_LOG_LEVEL"
	EnvLogFormat        = "BATON_LOG_FORMAT"
	EnvStreamReplicas   = "BATON_STREAM_REPLICAS"
	EnvStreamMaxAge     = "BATON_STREAM_MAX_AGE"
	EnvStreamMaxBytes   = "BATON_STREAM_MAX_BYTES"
	EnvStreamMaxMsgs    = "BATON_STREAM_MAX_MSGS"
	EnvStreamDuplicate  = "BATON_STREAM_DUPLICATES"
)

// DefaultFatalLinger is FatalLinger's default, as a duration.
const DefaultFatalLinger = 2 * time.Minute

// Log formats accepted by BATON_LOG_FORMAT.
const (
	LogFormatText = "text"
	LogFormatJSON = "json"
)

// Config is Baton's configuration. An empty or unset variable takes the field's default.
type Config struct {
	// DatabaseURL is the PostgreSQL connection string: a postgres:// URL or key=value pairs.
	// Default: none; commands that talk to Postgres require it.
	DatabaseURL string `env:"BATON_DATABASE_URL"`
	// DatabaseURLFile is the path of a file holding DatabaseURL (one trailing newline is
	// removed), for a connection string with a password in it; Resolve reads it. Setting both
	// is an error. Default: none.
	DatabaseURLFile string `env:"BATON_DATABASE_URL_FILE"`
	// NATSURL is the NATS server URL, or several separated by commas. A user:password@ or
	// token@ in it logs in with those. Default: none; commands that talk to NATS require it.
	NATSURL string `env:"BATON_NATS_URL"`
	// NATSURLFile is the path of a file holding NATSURL, read like DatabaseURLFile. Default: none.
	NATSURLFile string `env:"BATON_NATS_URL_FILE"`
	// NATSCreds is the path of a .creds file (user JWT and nkey seed) for NATS servers in
	// operator mode. Excludes NATSNKey. Default: none.
	NATSCreds string `env:"BATON_NATS_CREDS"`
	// NATSNKey is the path of a file holding a user nkey seed. Default: none.
	NATSNKey string `env:"BATON_NATS_NKEY"`
	// NATSCA is the path of the PEM CA certificates that verify the NATS server. Default: the
	// system's roots.
	NATSCA string `env:"BATON_NATS_CA"`
	// NATSCert and NATSKey are the paths of a PEM client certificate and its key, both or
	// neither. Default: none.
	NATSCert string `env:"BATON_NATS_CERT"`
	NATSKey  string `env:"BATON_NATS_KEY"`
	// SubjectPrefix is the first part of every subject: <prefix>.turns.<conv> and
	// <prefix>.outcomes.<conv>. Dot-separated tokens of [A-Za-z0-9_-]. Default: "agent".
	SubjectPrefix string `env:"BATON_SUBJECT_PREFIX" envDefault:"agent"`
	// Slot is the logical replication slot the relay reads. Lowercase letters, digits and
	// underscores, at most 63. Default: "baton".
	Slot string `env:"BATON_SLOT" envDefault:"baton"`
	// Publication is the Postgres publication the relay streams. A lowercase SQL identifier
	// (letter or underscore first, then letters, digits, underscores), at most 63. Default: "baton".
	Publication string `env:"BATON_PUBLICATION" envDefault:"baton"`
	// Schema is the Postgres schema that holds Baton's tables and functions, created by
	// `baton migrate` when missing; choose one when Baton's generic names (messages,
	// conversations, operations) would clash with the application's. A lowercase SQL identifier,
	// not pg_*. Default: "public".
	Schema string `env:"BATON_SCHEMA" envDefault:"public"`
	// MetricsAddr is the host:port of the Prometheus /metrics listener. Default: empty (off).
	MetricsAddr string `env:"BATON_METRICS_ADDR"`
	// PprofAddr is the host:port of a listener serving Go's profiles (net/http/pprof) at
	// /debug/pprof/, apart from the metrics so that it is never exposed with them. Profiles show
	// code paths and memory contents: keep it on loopback. Default: empty (off).
	PprofAddr string `env:"BATON_PPROF_ADDR"`
	// PprofAllowRemote ("true" or "false") lets PprofAddr be an address other than loopback
	// (Validate refuses one otherwise): profiles show code paths and memory contents, secrets
	// among them. Default: "false".
	PprofAllowRemote string `env:"BATON_PPROF_ALLOW_REMOTE" envDefault:"false"`
	// FatalLinger is how long a command that stopped on an error no retry can fix keeps
	// serving /metrics, /healthz and /readyz (not ready) on MetricsAddr before it exits, so
	// that scrapes and probes see why: a Go duration (30s, 2m), 0 to exit at once. Without a
	// MetricsAddr the command exits at once. Default: "2m" (DefaultFatalLinger).
	FatalLinger string `env:"BATON_FATAL_LINGER" envDefault:"2m"`
	// LogLevel is debug, info, warn or error (slog level names, any case). Default: "info".
	LogLevel string `env:"BATON_LOG_LEVEL" envDefault:"info"`
	// LogFormat is "text" or "json". Default: "text".
	LogFormat string `env:"BATON_LOG_FORMAT" envDefault:"text"`

	// The JetStream streams the relay creates (see Streams; an existing stream keeps its own
	// limits).
	//
	// StreamReplicas is the replica count of every stream: 1, or 3 or 5 on a JetStream
	// cluster (any of 1 to 5). Default: "1".
	StreamReplicas string `env:"BATON_STREAM_REPLICAS" envDefault:"1"`
	// StreamMaxAge is how long the outcomes stream keeps an outcome: a Go duration, 0 for no
	// age limit. It never applies to the turns stream, where an age limit would drop unfinished
	// work. Default: "168h" (7 days).
	StreamMaxAge string `env:"BATON_STREAM_MAX_AGE" envDefault:"168h"`
	// StreamMaxBytes caps the size of each stream: bytes, or a number with KiB, MiB, GiB or
	// TiB; -1 for no cap. A full turns stream refuses new events (the relay waits for the
	// workers to make room); the outcomes and dead-letter streams drop their oldest.
	// Default: "1GiB".
	StreamMaxBytes string `env:"BATON_STREAM_MAX_BYTES" envDefault:"1GiB"`
	// StreamMaxMsgs caps the messages of the turns and outcomes streams, like StreamMaxBytes;
	// -1 for no cap. Default: "1000000".
	StreamMaxMsgs string `env:"BATON_STREAM_MAX_MSGS" envDefault:"1000000"`
	// StreamDuplicates is the Nats-Msg-Id deduplication window of every stream: a positive Go
	// duration, at most StreamMaxAge. Default: "2m".
	StreamDuplicates string `env:"BATON_STREAM_DUPLICATES" envDefault:"2m"`

	// flags maps a variable to the flag bound to it by BindFlags, so errors name what the
	// user actually set.
	flags map[string]*boundFlag
	// fromFile maps a variable whose value Resolve read from a file to that file, as errors
	// name it ("BATON_DATABASE_URL_FILE (/run/secrets/db)"): errors about a file's contents
	// name the file and never quote what it holds.
	fromFile map[string]string
}

type boundFlag struct {
	name string
	set  bool
	used string // the name it was set with: name, or an alias
}

// variable describes one setting: its variable, flag name and flag usage.
type variable struct {
	env   string
	usage string // flag usage; a `quoted` word names the flag's argument
	field func(*Config) *string
}

// booleans are the variables whose flags may be given alone (--pprof-allow-remote), as "true".
var booleans = map[string]bool{EnvPprofAllowRemote: true}

var variables = []variable{
	{EnvDatabaseURL, "PostgreSQL `url` (postgres://... or key=value)", func(c *Config) *string { return &c.DatabaseURL }},
	{EnvDatabaseURLFile, "`file` holding the PostgreSQL url, instead of --database-url", func(c *Config) *string { return &c.DatabaseURLFile }},
	{EnvNATSURL, "NATS server `url`s, comma-separated", func(c *Config) *string { return &c.NATSURL }},
	{EnvNATSURLFile, "`file` holding the NATS url(s), instead of --nats-url", func(c *Config) *string { return &c.NATSURLFile }},
	{EnvNATSCreds, "NATS user credentials `file` (.creds: JWT and nkey seed)", func(c *Config) *string { return &c.NATSCreds }},
	{EnvNATSNKey, "`file` holding a NATS user nkey seed", func(c *Config) *string { return &c.NATSNKey }},
	{EnvNATSCA, "PEM `file` of the CA certificates that verify the NATS server", func(c *Config) *string { return &c.NATSCA }},
	{EnvNATSCert, "PEM client certificate `file` for NATS (with --nats-key)", func(c *Config) *string { return &c.NATSCert }},
	{EnvNATSKey, "PEM private key `file` of --nats-cert", func(c *Config) *string { return &c.NATSKey }},
	{EnvSubjectPrefix, "subject `prefix` (default agent)", func(c *Config) *string { return &c.SubjectPrefix }},
	{EnvSlot, "replication slot `name` (default baton)", func(c *Config) *string { return &c.Slot }},
	{EnvPublication, "publication `name` (default baton)", func(c *Config) *string { return &c.Publication }},
	{EnvSchema, "Postgres `schema` of Baton's tables (default public)", func(c *Config) *string { return &c.Schema }},
	{EnvMetricsAddr, "metrics listen `addr`ess host:port (default off)", func(c *Config) *string { return &c.MetricsAddr }},
	{EnvPprofAddr, "Go profiles (/debug/pprof/) listen `addr`ess host:port, on loopback unless --pprof-allow-remote (default off)", func(c *Config) *string { return &c.PprofAddr }},
	{EnvPprofAllowRemote, "let --pprof-addr listen on an address other than loopback: profiles show memory contents (default false)",
		func(c *Config) *string { return &c.PprofAllowRemote }},
	{EnvFatalLinger, "after an error no retry can fix, keep serving metrics and health (not ready) for this `duration` before exiting; 0 exits at once (default 2m)",
		func(c *Config) *string { return &c.FatalLinger }},
	{EnvLogLevel, "log `level`: debug, info, warn, error (default info)", func(c *Config) *string { return &c.LogLevel }},
	{EnvLogFormat, "log `format`: text or json (default text)", func(c *Config) *string { return &c.LogFormat }},
	{EnvStreamReplicas, "replica `count` of the streams it creates, 1 to 5 (default 1)", func(c *Config) *string { return &c.StreamReplicas }},
	{EnvStreamMaxAge, "outcomes older than this `duration` leave the outcomes stream; 0: no age limit; never applies to turns (default 168h)",
		func(c *Config) *string { return &c.StreamMaxAge }},
	{EnvStreamMaxBytes, "`size` cap of each stream it creates (bytes, or with KiB, MiB, GiB, TiB; -1: none); a full turns stream\n" +
		"refuses new events until workers acknowledge, the others drop their oldest (default 1GiB)", func(c *Config) *string { return &c.StreamMaxBytes }},
	{EnvStreamMaxMsgs, "`count` cap of the turns and outcomes streams it creates, like --stream-max-bytes; -1: none (default 1000000)",
		func(c *Config) *string { return &c.StreamMaxMsgs }},
	{EnvStreamDuplicate, "JetStream duplicate window (`duration`) of the streams it creates (default 2m)",
		func(c *Config) *string { return &c.StreamDuplicates }},
}

func lookup(envName string) (variable, bool) {
	for _, v := range variables {
		if v.env == envName {
			return v, true
		}
	}
	return variable{}, false
}

// aliases are other flag names BindFlags binds to a variable, kept for older command lines.
var aliases = map[string]string{
	EnvStreamDuplicate: "dup-window",
}

// companions are the variables BindFlags binds with a variable: a URL's file, and the NATS
// login and TLS settings with the NATS URL.
var companions = map[string][]string{
	EnvDatabaseURL: {EnvDatabaseURLFile},
	EnvNATSURL:     {EnvNATSURLFile, EnvNATSCreds, EnvNATSNKey, EnvNATSCA, EnvNATSCert, EnvNATSKey},
	EnvPprofAddr:   {EnvPprofAllowRemote},
}

// FlagName returns the flag that overrides a variable: BATON_DATABASE_URL → database-url.
func FlagName(envName string) string {
	return strings.ReplaceAll(strings.ToLower(strings.TrimPrefix(envName, "BATON_")), "_", "-")
}

// Load reads the configuration from the environment, fills defaults, reads the files it
// names and validates it (Resolve).
func Load() (Config, error) {
	c, err := FromEnv()
	if err != nil {
		return Config{}, err
	}
	if err := c.Resolve(); err != nil {
		return Config{}, err
	}
	return c, nil
}

// FromEnv reads the configuration from the environment and fills defaults, without
// validating it.
func FromEnv() (Config, error) {
	c, err := env.ParseAs[Config]()
	if err != nil {
		return Config{}, fmt.Errorf("read configuration from the environment: %w", err)
	}
	return c, nil
}

// BindFlags defines on fs one flag for each named variable (see FlagName), writing into c.
// Flags override the environment. Their defaults are not printed by fs.PrintDefaults, so a
// password from the environment never appears in usage output. BATON_DATABASE_URL brings
// --database-url-file with it, and BATON_NATS_URL brings --nats-url-file and the NATS login
// and TLS flags (--nats-creds, --nats-nkey, --nats-ca, --nats-cert, --nats-key). A variable
// with an older flag name (aliases: --dup-window for BATON_STREAM_DUPLICATES) gets that flag too.
// It panics on an unknown variable name, like fs does on a flag defined twice.
func (c *Config) BindFlags(fs *flag.FlagSet, envNames ...string) {
	if c.flags == nil {
		c.flags = map[string]*boundFlag{}
	}
	var all []string
	for _, name := range envNames {
		all = append(append(all, name), companions[name]...)
	}
	for _, name := range all {
		if c.flags[name] != nil {
			continue // named and brought by a companion
		}
		v, ok := lookup(name)
		if !ok {
			panic("config: BindFlags: unknown variable " + name)
		}
		b := &boundFlag{name: FlagName(name)}
		c.flags[name] = b
		fs.Var(flagValue{p: v.field(c), bound: b, name: b.name, boolean: booleans[name]}, b.name, v.usage+" [env "+name+"]")
		if alias := aliases[name]; alias != "" {
			fs.Var(flagValue{p: v.field(c), bound: b, name: alias}, alias, "the older name of --"+b.name)
		}
	}
}

// flagValue is a flag.Value that writes into a Config field. String returns "" so that
// flag.PrintDefaults shows no default: the default comes from the environment and may
// hold a password.
type flagValue struct {
	p       *string
	bound   *boundFlag
	name    string // the flag's name: the variable's, or an alias
	boolean bool   // see booleans
}

func (f flagValue) String() string { return "" }

// IsBoolFlag lets the flag package take a boolean variable's flag alone, as "true".
func (f flagValue) IsBoolFlag() bool { return f.boolean }

func (f flagValue) Set(s string) error {
	*f.p = s
	f.bound.set, f.bound.used = true, f.name
	return nil
}

// Source names where a variable's value came from, for error messages: "--flag" when a flag
// bound by BindFlags set it, else the variable's name.
func (c Config) Source(envName string) string {
	if b := c.flags[envName]; b != nil && b.set {
		return "--" + b.used
	}
	return envName
}

// flagSet reports whether a flag bound by BindFlags set the variable.
func (c Config) flagSet(envName string) bool {
	b := c.flags[envName]
	return b != nil && b.set
}

// Resolve reads the URLs given as files (DatabaseURLFile, NATSURLFile) into DatabaseURL and
// NATSURL, then validates (Validate) and checks the NATS login and TLS files
// (natsconn.Settings.Options). Commands call it once their flags are parsed. A URL and its file both set is an
// error, unless one of them came from a flag: flags override the environment. Errors name the
// variables (or flags) and paths, never a file's contents.
func (c *Config) Resolve() error {
	var errs []error
	for _, p := range []struct {
		env, fileEnv string
		value, file  *string
	}{
		{EnvDatabaseURL, EnvDatabaseURLFile, &c.DatabaseURL, &c.DatabaseURLFile},
		{EnvNATSURL, EnvNATSURLFile, &c.NATSURL, &c.NATSURLFile},
	} {
		value, file := *p.value, *p.file
		switch valueFlag, fileFlag := c.flagSet(p.env), c.flagSet(p.fileEnv); {
		case valueFlag && !fileFlag:
			file = ""
		case fileFlag && !valueFlag:
			value = ""
		}
		v, err := natsconn.ValueOrFile(c.Source(p.env), value, c.Source(p.fileEnv), file)
		if err != nil {
			errs = append(errs, err)
			continue
		}
		if file != "" {
			src := fmt.Sprintf("%s (%s)", c.Source(p.fileEnv), file)
			if strings.ContainsAny(v, "\r\n") {
				// A second line is most likely another secret (password=...): never echoed.
				errs = append(errs, fmt.Errorf("%s: holds more than one line; it must hold the URL alone (contents not shown)", src))
				continue
			}
			if c.fromFile == nil {
				c.fromFile = map[string]string{}
			}
			c.fromFile[p.env] = src
		}
		*p.value, *p.file = v, "" // read: resolving again keeps the value
	}
	if err := errors.Join(errs...); err != nil {
		return err
	}
	_, err := c.NATS().Options()
	return errors.Join(c.Validate(), err)
}

// NATS returns the settings that connect to NATS, for natsconn: the URL and the login and
// TLS files.
func (c Config) NATS() natsconn.Settings {
	return natsconn.Settings{URL: c.NATSURL, Creds: c.NATSCreds, NKey: c.NATSNKey, CA: c.NATSCA,
		Cert: c.NATSCert, Key: c.NATSKey}
}

// Validate checks every value that is set and returns all problems found, each naming its
// variable (or the flag that set it). An empty DatabaseURL, NATSURL or MetricsAddr is
// valid: see Require.
func (c Config) Validate() error {
	var errs []error
	bad := func(envName, format string, args ...any) {
		src := c.Source(envName)
		if f, ok := c.fromFile[envName]; ok {
			src = f
		}
		errs = append(errs, fmt.Errorf("%s: "+format, append([]any{src}, args...)...))
	}
	if c.DatabaseURL != "" {
		if err := checkDatabaseURL(c.DatabaseURL, c.fromFile[EnvDatabaseURL] == ""); err != nil {
			bad(EnvDatabaseURL, "%v", err)
		}
	}
	if c.NATSURL != "" {
		if err := checkNATSURL(c.NATSURL, c.fromFile[EnvNATSURL] == ""); err != nil {
			bad(EnvNATSURL, "%v", err)
		}
	} else if c.NATS().Secure() {
		// Never applied to a server of the command's own (the demo's, the bench's): say so.
		errs = append(errs, fmt.Errorf("the NATS login and TLS settings (%s, %s, %s, %s, %s) need %s",
			EnvNATSCreds, EnvNATSNKey, EnvNATSCA, EnvNATSCert, EnvNATSKey, EnvNATSURL))
	}
	if err := wire.ValidatePrefix(c.SubjectPrefix); err != nil {
		bad(EnvSubjectPrefix, "must be dot-separated tokens of [A-Za-z0-9_-], no wildcards (got %q)", c.SubjectPrefix)
	}
	if err := pgname.Slot(c.Slot); err != nil {
		bad(EnvSlot, "%v", err)
	}
	if err := pgname.Publication(c.Publication); err != nil {
		bad(EnvPublication, "%v", err)
	}
	if err := pgname.Schema(c.Schema); err != nil {
		bad(EnvSchema, "%v", err)
	}
	if c.MetricsAddr != "" {
		if err := checkListenAddr(c.MetricsAddr); err != nil {
			bad(EnvMetricsAddr, "%v (got %q)", err, c.MetricsAddr)
		}
	}
	allowRemote, err := strconv.ParseBool(cmp.Or(c.PprofAllowRemote, "false"))
	if err != nil {
		bad(EnvPprofAllowRemote, "must be true or false (got %q)", c.PprofAllowRemote)
	}
	if c.PprofAddr != "" {
		if err := checkListenAddr(c.PprofAddr); err != nil {
			bad(EnvPprofAddr, "%v (got %q)", err, c.PprofAddr)
		} else if host, _, _ := net.SplitHostPort(c.PprofAddr); !allowRemote && !isLoopback(host) {
			bad(EnvPprofAddr, "%q is not a loopback address, and Go's profiles show memory contents (secrets among them) "+
				"to whoever reaches it: listen on 127.0.0.1, or set %s=true (--%s) if a firewall guards the port",
				c.PprofAddr, EnvPprofAllowRemote, FlagName(EnvPprofAllowRemote))
		}
	}
	if d, err := time.ParseDuration(c.FatalLinger); err != nil {
		bad(EnvFatalLinger, "must be a duration such as 2m or 30s (got %q)", c.FatalLinger)
	} else if d < 0 {
		bad(EnvFatalLinger, "must not be negative (got %q)", c.FatalLinger)
	}
	if _, err := parseLevel(c.LogLevel); err != nil {
		bad(EnvLogLevel, "must be debug, info, warn or error (got %q)", c.LogLevel)
	}
	if c.LogFormat != LogFormatText && c.LogFormat != LogFormatJSON {
		bad(EnvLogFormat, "must be %s or %s (got %q)", LogFormatText, LogFormatJSON, c.LogFormat)
	}
	errs = append(errs, c.validateStreams()...)
	return errors.Join(errs...)
}

// StreamLimits are the stream settings of BATON_STREAM_*, parsed (see Streams).
type StreamLimits struct {
	Replicas int
	// MaxAge is the outcomes' age limit, 0 for none.
	MaxAge time.Duration
	// MaxBytes and MaxMsgs are -1 for no cap.
	MaxBytes, MaxMsgs int64
	Duplicates        time.Duration
}

// Streams returns the stream settings, parsed. Call it on a Config that passed Validate; a
// value that does not parse is returned as its zero.
func (c Config) Streams() StreamLimits {
	var l StreamLimits
	l.Replicas, _ = strconv.Atoi(c.StreamReplicas)
	l.MaxAge, _ = time.ParseDuration(c.StreamMaxAge)
	l.MaxBytes, _ = parseSize(c.StreamMaxBytes)
	l.MaxMsgs, _ = parseCap(c.StreamMaxMsgs)
	l.Duplicates, _ = time.ParseDuration(c.StreamDuplicates)
	return l
}

// validateStreams checks the BATON_STREAM_* values.
func (c Config) validateStreams() []error {
	var errs []error
	bad := func(envName, format string, args ...any) {
		errs = append(errs, fmt.Errorf("%s: "+format, append([]any{c.Source(envName)}, args...)...))
	}
	if n, err := strconv.Atoi(c.StreamReplicas); err != nil || n < 1 || n > 5 {
		bad(EnvStreamReplicas, "must be a number from 1 to 5 (got %q)", c.StreamReplicas)
	}
	maxAge, err := time.ParseDuration(c.StreamMaxAge)
	if err != nil || maxAge < 0 {
		bad(EnvStreamMaxAge, "must be a duration such as 168h or 30m, 0 for no age limit (got %q)", c.StreamMaxAge)
	}
	if _, err := parseSize(c.StreamMaxBytes); err != nil {
		bad(EnvStreamMaxBytes, "%v (got %q)", err, c.StreamMaxBytes)
	}
	if _, err := parseCap(c.StreamMaxMsgs); err != nil {
		bad(EnvStreamMaxMsgs, "%v (got %q)", err, c.StreamMaxMsgs)
	}
	switch dup, err := time.ParseDuration(c.StreamDuplicates); {
	case err != nil || dup <= 0:
		bad(EnvStreamDuplicate, "must be a positive duration such as 2m (got %q)", c.StreamDuplicates)
	case maxAge > 0 && dup > maxAge:
		bad(EnvStreamDuplicate, "%s is longer than %s %s: JetStream refuses a duplicate window longer than the max age",
			c.StreamDuplicates, c.Source(EnvStreamMaxAge), c.StreamMaxAge)
	}
	return errs
}

// sizeUnits are the suffixes parseSize takes.
var sizeUnits = []struct {
	suffix string
	mult   int64
}{{"KiB", 1 << 10}, {"MiB", 1 << 20}, {"GiB", 1 << 30}, {"TiB", 1 << 40}}

// parseSize reads a size in bytes: a positive number, optionally followed by KiB, MiB, GiB
// or TiB, or -1 for no cap.
func parseSize(s string) (int64, error) {
	mult := int64(1)
	num := s
	for _, u := range sizeUnits {
		if n, ok := strings.CutSuffix(s, u.suffix); ok {
			num, mult = strings.TrimSpace(n), u.mult
			break
		}
	}
	n, err := strconv.ParseInt(num, 10, 64)
	switch {
	case err == nil && n == -1 && mult == 1:
		return -1, nil
	case err != nil || n <= 0:
		return 0, errors.New("must be a positive number of bytes, optionally with KiB, MiB, GiB or TiB (1GiB), or -1 for no cap")
	case n > math.MaxInt64/mult:
		return 0, errors.New("is too large")
	}
	return n * mult, nil
}

// parseCap reads a positive count, or -1 for no cap.
func parseCap(s string) (int64, error) {
	n, err := strconv.ParseInt(s, 10, 64)
	if err != nil || n == 0 || n < -1 {
		return 0, errors.New("must be a positive number, or -1 for no cap")
	}
	return n, nil
}

// Require reports, naming each variable and its flag where one is bound, the named
// variables that are empty. Commands call it for the values they cannot do without.
func (c Config) Require(envNames ...string) error {
	var errs []error
	for _, name := range envNames {
		v, ok := lookup(name)
		if !ok {
			panic("config: Require: unknown variable " + name)
		}
		if *v.field(&c) != "" {
			continue
		}
		if b := c.flags[name]; b != nil {
			errs = append(errs, fmt.Errorf("%s is not set: set it or pass --%s", name, b.name))
		} else {
			errs = append(errs, fmt.Errorf("%s is not set", name))
		}
	}
	return errors.Join(errs...)
}

// checkDatabaseURL checks the shape of a PostgreSQL connection string. Its errors never
// quote the value, which may hold a password.
// checkDatabaseURL checks a PostgreSQL URL or key=value string; its errors show the value
// (redacted) only when echo is set: never for a value read from a file.
func checkDatabaseURL(s string, echo bool) error {
	if scheme, _, ok := strings.Cut(s, "://"); ok {
		if scheme != "postgres" && scheme != "postgresql" {
			return errors.New("URL must start with postgres:// or postgresql://")
		}
		if _, err := url.Parse(s); err != nil {
			// url.Error quotes the URL: do not wrap it.
			return fmt.Errorf("not a valid URL%s", shown(s, echo))
		}
		return nil
	}
	if _, failAt := scanKeyValues(s); failAt >= 0 {
		return errors.New("must be a postgres:// URL or key=value pairs (host=... dbname=...)")
	}
	return nil
}

// shown is ": " and the value, redacted, for an error message; "" when it must not be echoed.
func shown(s string, echo bool) string {
	if !echo {
		return " (contents not shown)"
	}
	return ": " + Redact(s)
}

var natsSchemes = map[string]bool{"nats": true, "tls": true, "ws": true, "wss": true}

// checkNATSURL checks a comma-separated list of NATS server URLs. A URL without a scheme
// is taken as nats://, as the NATS client does.
func checkNATSURL(s string, echo bool) error {
	for _, raw := range strings.Split(s, ",") {
		raw = strings.TrimSpace(raw)
		if raw == "" {
			return errors.New("empty entry in the comma-separated list")
		}
		if !strings.Contains(raw, "://") {
			raw = "nats://" + raw
		}
		u, err := url.Parse(raw)
		if err != nil {
			return fmt.Errorf("not a valid URL%s", shown(raw, echo))
		}
		if !natsSchemes[u.Scheme] {
			return fmt.Errorf("scheme must be nats, tls, ws or wss (got %q)", u.Scheme)
		}
		if u.Hostname() == "" {
			return fmt.Errorf("URL has no host%s", shown(raw, echo))
		}
	}
	return nil
}

// isLoopback reports whether a listen address's host is a loopback name or address; "" (all
// interfaces) is not.
func isLoopback(host string) bool {
	if strings.EqualFold(host, "localhost") {
		return true
	}
	ip := net.ParseIP(strings.Trim(host, "[]"))
	return ip != nil && ip.IsLoopback()
}

func checkListenAddr(s string) error {
	_, port, err := net.SplitHostPort(s)
	if err != nil {
		return errors.New("must be host:port or :port")
	}
	if n, err := strconv.Atoi(port); err != nil || n < 0 || n > 65535 {
		return errors.New("port must be a number from 0 to 65535")
	}
	return nil
}

func parseLevel(s string) (slog.Level, error) {
	var l slog.Level
	err := l.UnmarshalText([]byte(s))
	return l, err
}

// Level returns LogLevel as a slog.Level; info when LogLevel is invalid.
func (c Config) Level() slog.Level {
	l, err := parseLevel(c.LogLevel)
	if err != nil {
		return slog.LevelInfo
	}
	return l
}

// Linger returns FatalLinger as a duration; DefaultFatalLinger when FatalLinger is invalid.
func (c Config) Linger() time.Duration {
	d, err := time.ParseDuration(c.FatalLinger)
	if err != nil || d < 0 {
		return DefaultFatalLinger
	}
	return d
}

// Logger returns a logger writing to w in LogFormat at LogLevel.
func (c Config) Logger(w io.Writer) *slog.Logger {
	opts := &slog.HandlerOptions{Level: c.Level()}
	if c.LogFormat == LogFormatJSON {
		return slog.New(slog.NewJSONHandler(w, opts))
	}
	return slog.New(slog.NewTextHandler(w, opts))
}

// LogValue logs the configuration with passwords redacted.
func (c Config) LogValue() slog.Value {
	return slog.GroupValue(
		slog.String("database_url", Redact(c.DatabaseURL)),
		slog.String("database_url_file", c.DatabaseURLFile),
		slog.String("nats_url", Redact(c.NATSURL)),
		slog.String("nats_url_file", c.NATSURLFile),
		slog.String("nats_creds", c.NATSCreds),
		slog.String("nats_nkey", c.NATSNKey),
		slog.String("nats_ca", c.NATSCA),
		slog.String("nats_cert", c.NATSCert),
		slog.String("nats_key", c.NATSKey),
		slog.String("subject_prefix", c.SubjectPrefix),
		slog.String("slot", c.Slot),
		slog.String("publication", c.Publication),
		slog.String("schema", c.Schema),
		slog.String("metrics_addr", c.MetricsAddr),
		slog.String("pprof_addr", c.PprofAddr),
		slog.String("pprof_allow_remote", c.PprofAllowRemote),
		slog.String("fatal_linger", c.FatalLinger),
		slog.String("log_level", c.LogLevel),
		slog.String("log_format", c.LogFormat),
		slog.String("stream_replicas", c.StreamReplicas),
		slog.String("stream_max_age", c.StreamMaxAge),
		slog.String("stream_max_bytes", c.StreamMaxBytes),
		slog.String("stream_max_msgs", c.StreamMaxMsgs),
		slog.String("stream_duplicates", c.StreamDuplicates),
	)
}

// String formats the configuration with passwords redacted, for %v, %+v and %s.
func (c Config) String() string {
	return fmt.Sprintf("{DatabaseURL:%s DatabaseURLFile:%s NATSURL:%s NATSURLFile:%s NATSCreds:%s NATSNKey:%s NATSCA:%s NATSCert:%s NATSKey:%s SubjectPrefix:%s Slot:%s Publication:%s Schema:%s MetricsAddr:%s PprofAddr:%s PprofAllowRemote:%s FatalLinger:%s LogLevel:%s LogFormat:%s StreamReplicas:%s StreamMaxAge:%s StreamMaxBytes:%s StreamMaxMsgs:%s StreamDuplicates:%s}",
		Redact(c.DatabaseURL), c.DatabaseURLFile, Redact(c.NATSURL), c.NATSURLFile, c.NATSCreds, c.NATSNKey, c.NATSCA, c.NATSCert, c.NATSKey, c.SubjectPrefix, c.Slot, c.Publication, c.Schema, c.MetricsAddr, c.PprofAddr, c.PprofAllowRemote, c.FatalLinger, c.LogLevel, c.LogFormat,
		c.StreamReplicas, c.StreamMaxAge, c.StreamMaxBytes, c.StreamMaxMsgs, c.StreamDuplicates)
}

// GoString formats the configuration with passwords redacted, for %#v.
func (c Config) GoString() string {
	return fmt.Sprintf("config.Config{DatabaseURL:%q, DatabaseURLFile:%q, NATSURL:%q, NATSURLFile:%q, NATSCreds:%q, NATSNKey:%q, NATSCA:%q, NATSCert:%q, NATSKey:%q, SubjectPrefix:%q, Slot:%q, Publication:%q, Schema:%q, MetricsAddr:%q, PprofAddr:%q, PprofAllowRemote:%q, FatalLinger:%q, LogLevel:%q, LogFormat:%q, StreamReplicas:%q, StreamMaxAge:%q, StreamMaxBytes:%q, StreamMaxMsgs:%q, StreamDuplicates:%q}",
		Redact(c.DatabaseURL), c.DatabaseURLFile, Redact(c.NATSURL), c.NATSURLFile, c.NATSCreds, c.NATSNKey, c.NATSCA, c.NATSCert, c.NATSKey, c.SubjectPrefix, c.Slot, c.Publication, c.Schema, c.MetricsAddr, c.PprofAddr, c.PprofAllowRemote, c.FatalLinger, c.LogLevel, c.LogFormat,
		c.StreamReplicas, c.StreamMaxAge, c.StreamMaxBytes, c.StreamMaxMsgs, c.StreamDuplicates)
}
