package natsconn

import (
	"errors"
	"fmt"
	"io"
	"net/url"
	"os"
	"strings"

	"github.com/nats-io/jwt/v2"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nkeys"
)

// Names of the environment variables the settings come from.
const (
	EnvURL     = "BATON_NATS_URL"
	EnvURLFile = "BATON_NATS_URL_FILE"
	EnvCreds   = "BATON_NATS_CREDS" //nolint:gosec // G101: the name of a variable that holds a path
	EnvNKey    = "BATON_NATS_NKEY"
	EnvCA      = "BATON_NATS_CA"
	EnvCert    = "BATON_NATS_CERT"
	EnvKey     = "BATON_NATS_KEY"
)

// Settings say where the NATS servers are and how to log in. The zero value (with a URL)
// connects in plain text without credentials, or with those in the URL. Paths are read by
// Options, not when Settings is built.
type Settings struct {
	// URL is one server URL or several, comma-separated (nats://, tls://, ws://, wss://). A
	// user:password@ or token@ in it logs in with those. BATON_NATS_URL. Default: none.
	URL string
	// Creds is the path of a .creds file (a user JWT and its nkey seed, as nsc and
	// jwt.FormatUserConfig write them), for servers in operator (JWT) mode. BATON_NATS_CREDS.
	// Default: none.
	Creds string
	// NKey is the path of a file holding a user nkey seed ("SU…"), for servers that list
	// nkey users. BATON_NATS_NKEY. Default: none.
	NKey string
	// CA is the path of PEM CA certificates that verify the server, in place of the system's.
	// BATON_NATS_CA. Default: the system's roots.
	CA string
	// Cert and Key are the paths of a PEM client certificate and its private key, for servers
	// that verify clients. Both or neither. BATON_NATS_CERT, BATON_NATS_KEY. Default: none.
	Cert, Key string
}

// Secure reports whether any login or TLS setting besides the URL is set.
func (s Settings) Secure() bool {
	return s.Creds != "" || s.NKey != "" || s.CA != "" || s.Cert != "" || s.Key != ""
}

// Environ returns the settings as BATON_NATS_* assignments (URL included, empty ones left
// out), for the environment of a child process.
func (s Settings) Environ() []string {
	var env []string
	for _, v := range []struct{ name, value string }{
		{EnvURL, s.URL}, {EnvCreds, s.Creds}, {EnvNKey, s.NKey}, {EnvCA, s.CA}, {EnvCert, s.Cert}, {EnvKey, s.Key},
	} {
		if v.value != "" {
			env = append(env, v.name+"="+v.value)
		}
	}
	return env
}

// Options returns the nats.go options that log in and encrypt as s says. It reads and checks
// every file now, so that a wrong path fails at startup: each error names the variable and
// the path, never what the file holds. Without Creds, NKey, CA, Cert and Key it returns no
// options. Options does not set nats.IgnoreAuthErrorAbort (see the package doc).
func (s Settings) Options() ([]nats.Option, error) {
	var opts []nats.Option
	var errs []error
	bad := func(name, path string, err error) {
		errs = append(errs, fmt.Errorf("%s (%s): %w", name, path, err))
	}
	if s.Creds != "" && s.NKey != "" {
		errs = append(errs, fmt.Errorf("%s and %s are both set: a .creds file holds its own nkey seed, set one", EnvCreds, EnvNKey))
	}
	if (s.Cert == "") != (s.Key == "") {
		errs = append(errs, fmt.Errorf("%s and %s go together: set both (a client certificate and its key) or neither", EnvCert, EnvKey))
	}
	if s.Creds != "" {
		if err := checkCreds(s.Creds); err != nil {
			bad(EnvCreds, s.Creds, err)
		} else {
			opts = append(opts, nats.UserCredentials(s.Creds))
		}
	}
	if s.NKey != "" {
		if err := checkSeedFile(s.NKey); err != nil {
			bad(EnvNKey, s.NKey, err)
		} else if opt, err := nats.NkeyOptionFromSeed(s.NKey); err != nil {
			bad(EnvNKey, s.NKey, err)
		} else {
			opts = append(opts, opt)
		}
	}
	// nats.RootCAs and nats.ClientCert load their files when applied and again at every
	// connection attempt; applying them to scratch options here is the startup check.
	if s.CA != "" {
		opt := nats.RootCAs(s.CA)
		if err := tryOption(opt); err != nil {
			bad(EnvCA, s.CA, err)
		} else {
			opts = append(opts, opt)
		}
	}
	if s.Cert != "" && s.Key != "" {
		opt := nats.ClientCert(s.Cert, s.Key)
		if err := tryOption(opt); err != nil {
			errs = append(errs, fmt.Errorf("%s (%s) and %s (%s): %w", EnvCert, s.Cert, EnvKey, s.Key, err))
		} else {
			opts = append(opts, opt)
		}
	}
	if err := errors.Join(errs...); err != nil {
		return nil, err
	}
	return opts, nil
}

// Connect connects to s.URL with s's options followed by opts. Its errors name the servers
// (without credentials) and the login it used; a login the server refused wraps
// nats.ErrAuthorization (or nats.ErrAuthExpired, ErrAuthRevoked, ErrAccountAuthExpired).
func (s Settings) Connect(opts ...nats.Option) (*nats.Conn, error) {
	if s.URL == "" {
		return nil, fmt.Errorf("%s is not set", EnvURL)
	}
	sec, err := s.Options()
	if err != nil {
		return nil, err
	}
	nc, err := nats.Connect(s.URL, append(sec, opts...)...)
	if err != nil {
		var ue *url.Error
		if errors.As(err, &ue) { // its text quotes the URL, password included
			return nil, fmt.Errorf("connect to NATS at %s: a server URL does not parse", Servers(s.URL))
		}
		if IsAuthError(err) {
			return nil, fmt.Errorf("NATS at %s refused the login (%s): %w", Servers(s.URL), s.Login(), err)
		}
		return nil, fmt.Errorf("connect to NATS at %s (%s): %w", Servers(s.URL), s.Login(), err)
	}
	return nc, nil
}

// IsAuthError reports whether err is a NATS server refusing a login: nats.ErrAuthorization,
// ErrAuthExpired, ErrAuthRevoked or ErrAccountAuthExpired.
func IsAuthError(err error) bool {
	return errors.Is(err, nats.ErrAuthorization) || errors.Is(err, nats.ErrAuthExpired) ||
		errors.Is(err, nats.ErrAuthRevoked) || errors.Is(err, nats.ErrAccountAuthExpired)
}

// Login describes how s logs in and encrypts, for errors and logs: which settings (variable
// and path) it uses, and whether the URL carries a user and password or a token, never the
// secrets themselves.
func (s Settings) Login() string {
	var parts []string
	switch {
	case s.Creds != "":
		parts = append(parts, "user JWT from "+EnvCreds+" "+s.Creds)
	case s.NKey != "":
		parts = append(parts, "nkey from "+EnvNKey+" "+s.NKey)
	}
	switch urlLogin(s.URL) {
	case loginPassword:
		parts = append(parts, "user and password from the URL")
	case loginToken:
		parts = append(parts, "token from the URL")
	}
	if len(parts) == 0 && s.Cert == "" {
		parts = append(parts, "no credentials")
	}
	if s.Cert != "" {
		parts = append(parts, "client certificate "+EnvCert+" "+s.Cert)
	}
	if s.CA != "" {
		parts = append(parts, "server verified with "+EnvCA+" "+s.CA)
	}
	return strings.Join(parts, ", ")
}

type login int

const (
	loginNone login = iota
	loginPassword
	loginToken
)

// urlLogin reports what the first URL of a server list that carries a login carries.
func urlLogin(servers string) login {
	for _, raw := range strings.Split(servers, ",") {
		u, err := parseServer(raw)
		if err != nil || u.User == nil {
			continue
		}
		if _, ok := u.User.Password(); ok {
			return loginPassword
		}
		return loginToken
	}
	return loginNone
}

// Servers returns a comma-separated server list as scheme://host:port entries, without what
// the URLs carry besides (user, password, token), for errors and logs. An entry that does not
// parse shows as "(invalid URL)".
func Servers(servers string) string {
	var out []string
	for _, raw := range strings.Split(servers, ",") {
		u, err := parseServer(raw)
		if err != nil || u.Host == "" {
			out = append(out, "(invalid URL)")
			continue
		}
		out = append(out, u.Scheme+"://"+u.Host)
	}
	return strings.Join(out, ",")
}

// parseServer parses one server URL of a list; without a scheme it is nats://, as nats.go
// takes it.
func parseServer(raw string) (*url.URL, error) {
	raw = strings.TrimSpace(raw)
	if !strings.Contains(raw, "://") {
		raw = "nats://" + raw
	}
	return url.Parse(raw)
}

// ValueOrFile returns a setting given either directly (value, from the variable name) or in
// a file (path, from the variable fileName, the *_FILE convention of container secrets):
// the file's contents without one trailing newline. Both set is an error, and so is a file it
// cannot read or that is empty; errors name the variable and the path, never the contents.
// Neither set returns "".
func ValueOrFile(name, value, fileName, path string) (string, error) {
	switch {
	case path == "":
		return value, nil
	case value != "":
		return "", fmt.Errorf("%s and %s are both set: set one", name, fileName)
	}
	b, err := readFile(path)
	if err != nil {
		return "", fmt.Errorf("%s (%s): %w", fileName, path, err)
	}
	s := string(b)
	if t, ok := strings.CutSuffix(s, "\n"); ok {
		s = strings.TrimSuffix(t, "\r")
	}
	if s == "" {
		return "", fmt.Errorf("%s (%s): the file is empty", fileName, path)
	}
	return s, nil
}

// checkCreds reads a .creds file and checks that it holds a user JWT and a user nkey seed.
// nkeys' and jwt's errors are not wrapped: some quote what they could not parse.
func checkCreds(path string) error {
	b, err := readFile(path)
	if err != nil {
		return err
	}
	defer wipe(b)
	token, err := nkeys.ParseDecoratedJWT(b)
	if err != nil {
		return errors.New("holds no user JWT")
	}
	if _, err := jwt.DecodeUserClaims(token); err != nil {
		return errors.New("holds no valid user JWT (expected a .creds file as nsc writes it)")
	}
	return checkSeed(b)
}

// checkSeedFile reads a file holding an nkey seed and checks that it is a user's.
func checkSeedFile(path string) error {
	b, err := readFile(path)
	if err != nil {
		return err
	}
	defer wipe(b)
	return checkSeed(b)
}

func checkSeed(b []byte) error {
	kp, err := nkeys.ParseDecoratedNKey(b)
	if err != nil {
		return errors.New("holds no nkey seed")
	}
	defer kp.Wipe()
	pub, err := kp.PublicKey()
	if err != nil || !nkeys.IsValidPublicUserKey(pub) {
		return errors.New("holds no user nkey seed (SU…)")
	}
	return nil
}

// maxFileSize bounds what readFile reads: URLs, .creds files and nkey seeds are a few KiB, and
// a path naming a device (/dev/zero) or a large file by mistake must fail, not fill memory.
const maxFileSize = 1 << 20

// readFile reads path, at most maxFileSize bytes; its error never quotes the contents. A pipe
// (a shell's <(...)) is read like a file.
func readFile(path string) ([]byte, error) {
	f, err := os.Open(path) //nolint:gosec // G304: the operator names the file on purpose
	if err != nil {
		return nil, readError(err)
	}
	defer func() { _ = f.Close() }()
	b, err := io.ReadAll(io.LimitReader(f, maxFileSize+1))
	if err != nil {
		return nil, readError(err)
	}
	if len(b) > maxFileSize {
		wipe(b)
		return nil, errors.New("the file is larger than 1 MiB")
	}
	return b, nil
}

func readError(err error) error {
	var pe *os.PathError
	if errors.As(err, &pe) {
		return fmt.Errorf("cannot read: %w", pe.Err)
	}
	return errors.New("cannot read")
}

// wipe overwrites a secret read from a file once it was checked.
func wipe(b []byte) {
	for i := range b {
		b[i] = 'x'
	}
}

// tryOption applies opt to scratch options, which is when nats.go's file-based options
// read their files.
func tryOption(opt nats.Option) error {
	o := nats.GetDefaultOptions()
	return opt(&o)
}
