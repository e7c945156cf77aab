package testsvc

import (
	"net"
	"net/url"
	"path/filepath"
	"strconv"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5/pgconn"
)

// ProxyPostgres starts a proxy (StartProxy) in front of the server a postgres:// URL names and
// returns it with the URL that reaches the server through it: the same user, password,
// database and settings, over TCP to the proxy. A throwaway cluster listens on a Unix socket
// (host=/dir in the URL), which the proxy dials; a server on TCP is dialled at its host:port.
func ProxyPostgres(t testing.TB, dbURL string) (*Proxy, string) {
	t.Helper()
	cfg, err := pgconn.ParseConfig(dbURL)
	if err != nil {
		t.Fatalf("proxy postgres: parse the URL: %v", err)
	}
	proxy := StartProxy(t, postgresTarget(cfg.Host, cfg.Port))
	u, err := url.Parse(dbURL)
	if err != nil || (u.Scheme != "postgres" && u.Scheme != "postgresql") {
		t.Fatalf("proxy postgres: a postgres:// URL is needed (%v)", err)
	}
	q := u.Query()
	q.Del("host")
	q.Del("port")
	u.RawQuery = q.Encode()
	u.Host = proxy.Addr()
	return proxy, u.String()
}

// postgresTarget returns what a proxy dials for a server at host and port: the socket file in
// a socket directory (a host that is a path), else host:port.
func postgresTarget(host string, port uint16) string {
	p := strconv.Itoa(int(port))
	if strings.HasPrefix(host, "/") {
		return filepath.Join(host, ".s.PGSQL."+p)
	}
	return net.JoinHostPort(host, p)
}
