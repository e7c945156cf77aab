package testsvc

import (
	"fmt"
	"net"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/nats-io/jwt/v2"
	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nkeys"

	"github.com/batonhq/baton/natsconn"
)

// NATSAuth is a way a NATS server makes its clients log in.
type NATSAuth string

// The logins StartSecureNATS sets up.
const (
	NATSUserPassword NATSAuth = "user-password" // a user with a password, in the URL
	NATSToken        NATSAuth = "token"         // a token, in the URL
	NATSNKey         NATSAuth = "nkey"          // an nkey user; the seed in a file
	NATSJWT          NATSAuth = "jwt"           // operator mode, a memory resolver; a .creds file
	NATSTLS          NATSAuth = "tls"           // TLS from a CA of the test's, client certificates verified
)

// NATSAuths lists every NATSAuth.
var NATSAuths = []NATSAuth{NATSUserPassword, NATSToken, NATSNKey, NATSJWT, NATSTLS}

// SecureNATS is a NATS server with JetStream, in this process, that lets in only the clients
// that log in the way its NATSAuth says.
type SecureNATS struct {
	// Good logs in.
	Good natsconn.Settings
	// Bad is refused: a wrong password or token, an nkey or a JWT the server does not know, a
	// client certificate from another CA.
	Bad natsconn.Settings
	// Dir holds the files the settings name.
	Dir string

	srv  *server.Server
	opts *server.Options
}

// StartSecureNATS starts a server that requires auth, with the keys, certificates and files
// its clients need written to a temp dir, and stops it when the test ends.
func StartSecureNATS(t testing.TB, auth NATSAuth) *SecureNATS {
	t.Helper()
	dir := t.TempDir()
	n := &SecureNATS{Dir: dir}
	opts := &server.Options{
		ServerName: "baton-secure-" + string(auth),
		Host:       "127.0.0.1",
		Port:       -1,
		JetStream:  true,
		StoreDir:   filepath.Join(dir, "store"),
		NoSigs:     true,
		NoLog:      os.Getenv("SECURE_NATS_DEBUG") == "",
	}
	write := func(name string, data []byte) string {
		p := filepath.Join(dir, name)
		if err := os.WriteFile(p, data, 0o600); err != nil {
			t.Fatalf("write %s: %v", name, err)
		}
		return p
	}
	scheme, good, bad := "nats://", "", ""
	switch auth {
	case NATSUserPassword:
		opts.Users = []*server.User{{Username: "baton", Password: "pw-s3cret"}}
		good, bad = "baton:pw-s3cret@", "baton:wrong-password@"
	case NATSToken:
		opts.Authorization = "tok-s3cret"
		good, bad = "tok-s3cret@", "wrong-token@"
	case NATSNKey:
		user, seed := newNKey(t, nkeys.CreateUser)
		_, otherSeed := newNKey(t, nkeys.CreateUser)
		opts.Nkeys = []*server.NkeyUser{{Nkey: user}}
		n.Good.NKey = write("user.nk", append(seed, '\n'))
		n.Bad.NKey = write("stranger.nk", otherSeed)
	case NATSJWT:
		n.Good.Creds, n.Bad.Creds = operatorMode(t, opts, write)
	case NATSTLS:
		ca, other := NewCA(t, "baton test CA"), NewCA(t, "another CA")
		srvCert, srvKey := ca.ServerCert(t)
		cliCert, cliKey := ca.ClientCert(t, "baton client")
		strCert, strKey := other.ClientCert(t, "stranger")
		caFile := ca.CertFile
		tc, err := server.GenTLSConfig(&server.TLSConfigOpts{
			CertFile: write("server.pem", srvCert), KeyFile: write("server-key.pem", srvKey),
			CaFile: caFile, Verify: true,
		})
		if err != nil {
			t.Fatalf("server TLS config: %v", err)
		}
		opts.TLS, opts.TLSVerify, opts.TLSConfig, opts.TLSTimeout = true, true, tc, 5
		scheme = "tls://"
		n.Good = natsconn.Settings{CA: caFile, Cert: write("client.pem", cliCert), Key: write("client-key.pem", cliKey)}
		n.Bad = natsconn.Settings{CA: caFile, Cert: write("stranger.pem", strCert), Key: write("stranger-key.pem", strKey)}
	default:
		t.Fatalf("StartSecureNATS: unknown auth %q", auth)
	}
	srv, err := server.NewServer(opts)
	if err != nil {
		t.Fatalf("nats server (%s): %v", auth, err)
	}
	if os.Getenv("SECURE_NATS_DEBUG") != "" {
		srv.ConfigureLogger()
	}
	go srv.Start()
	t.Cleanup(func() {
		srv.Shutdown()
		srv.WaitForShutdown()
	})
	if !srv.ReadyForConnections(30 * time.Second) {
		t.Fatalf("nats server (%s) not ready after 30s", auth)
	}
	n.srv, n.opts = srv, opts
	hostPort := fmt.Sprintf("127.0.0.1:%d", srv.Addr().(*net.TCPAddr).Port)
	n.Good.URL, n.Bad.URL = scheme+good+hostPort, scheme+bad+hostPort
	return n
}

// ClientConnected reports whether a client named name is connected.
func (n *SecureNATS) ClientConnected(name string) bool {
	cz, err := n.srv.Connz(&server.ConnzOptions{})
	if err != nil {
		return false
	}
	for _, c := range cz.Conns {
		if c.Name == name {
			return true
		}
	}
	return false
}

// ChangePassword restarts a NATSUserPassword server on its port and store with another
// password, so that the clients logged in with the old one are disconnected and refused from
// then on. (A configuration reload in this process would do the same, but nats-server 2.15's
// reload races with accepting a client, which the race detector reports.)
func (n *SecureNATS) ChangePassword(t testing.TB) {
	t.Helper()
	if len(n.opts.Users) != 1 {
		t.Fatal("ChangePassword: not a user and password server")
	}
	opts := n.opts.Clone()
	opts.Users = []*server.User{{Username: n.opts.Users[0].Username, Password: "pw-changed"}}
	opts.Port = n.srv.Addr().(*net.TCPAddr).Port
	n.srv.Shutdown()
	n.srv.WaitForShutdown()
	srv, err := server.NewServer(opts)
	if err != nil {
		t.Fatalf("nats server with another password: %v", err)
	}
	go srv.Start()
	t.Cleanup(func() {
		srv.Shutdown()
		srv.WaitForShutdown()
	})
	if !srv.ReadyForConnections(30 * time.Second) {
		t.Fatal("nats server with another password not ready after 30s")
	}
	n.srv, n.opts = srv, opts
}

// operatorMode configures opts for operator (JWT) mode with a memory resolver and one account
// with JetStream, and writes two .creds files: a user of that account, and a user signed by
// an account the server does not know.
func operatorMode(t testing.TB, opts *server.Options, write func(string, []byte) string) (good, bad string) {
	t.Helper()
	must := func(err error) {
		t.Helper()
		if err != nil {
			t.Fatalf("operator mode: %v", err)
		}
	}
	op, err := nkeys.CreateOperator()
	must(err)
	opPub, err := op.PublicKey()
	must(err)
	opJWT, err := jwt.NewOperatorClaims(opPub).Encode(op)
	must(err)
	opClaims, err := jwt.DecodeOperatorClaims(opJWT)
	must(err)

	account := func(jetStream bool) (nkeys.KeyPair, string) {
		acc, err := nkeys.CreateAccount()
		must(err)
		pub, err := acc.PublicKey()
		must(err)
		ac := jwt.NewAccountClaims(pub)
		if jetStream { // never on the system account
			ac.Limits.JetStreamLimits = jwt.JetStreamLimits{MemoryStorage: -1, DiskStorage: -1, Streams: -1, Consumer: -1}
		}
		accJWT, err := ac.Encode(op)
		must(err)
		return acc, accJWT
	}
	creds := func(acc nkeys.KeyPair, name string) string {
		user, err := nkeys.CreateUser()
		must(err)
		pub, err := user.PublicKey()
		must(err)
		seed, err := user.Seed()
		must(err)
		userJWT, err := jwt.NewUserClaims(pub).Encode(acc)
		must(err)
		file, err := jwt.FormatUserConfig(userJWT, seed)
		must(err)
		return write(name, file)
	}
	acc, accJWT := account(true)
	sys, sysJWT := account(false)
	accPub, err := acc.PublicKey()
	must(err)
	sysPub, err := sys.PublicKey()
	must(err)
	resolver := &server.MemAccResolver{}
	must(resolver.Store(accPub, accJWT))
	must(resolver.Store(sysPub, sysJWT))
	opts.TrustedOperators = []*jwt.OperatorClaims{opClaims}
	opts.AccountResolver = resolver
	opts.SystemAccount = sysPub

	stranger, _ := account(true) // signed by the operator but never given to the resolver
	return creds(acc, "user.creds"), creds(stranger, "stranger.creds")
}

func newNKey(t testing.TB, create func() (nkeys.KeyPair, error)) (pub string, seed []byte) {
	t.Helper()
	kp, err := create()
	if err != nil {
		t.Fatalf("nkey: %v", err)
	}
	pub, err = kp.PublicKey()
	if err != nil {
		t.Fatalf("nkey: %v", err)
	}
	seed, err = kp.Seed()
	if err != nil {
		t.Fatalf("nkey: %v", err)
	}
	return pub, seed
}
