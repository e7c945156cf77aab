package testsvc

import (
	"context"
	"net"
	"net/url"
	"strconv"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/nats-io/nats.go"
	"github.com/stretchr/testify/require"
)

// proxyBundle is a test database with a proxy in front of it.
type proxyBundle struct {
	db    *Database
	proxy *Proxy
}

func setupProxy(t *testing.T) *proxyBundle {
	t.Helper()
	db := NewDatabase(t)
	cfg, err := pgx.ParseConfig(db.URL)
	require.NoError(t, err)
	target := postgresTarget(cfg.Host, cfg.Port)
	return &proxyBundle{db: db, proxy: StartProxy(t, target)}
}

// connect opens a connection to the test database through the proxy, closed when the test
// ends.
func (b *proxyBundle) connect(ctx context.Context, t *testing.T) (*pgx.Conn, error) {
	t.Helper()
	cfg, err := pgx.ParseConfig(b.db.URL)
	require.NoError(t, err)
	cfg.Host, cfg.Port, cfg.Fallbacks = "127.0.0.1", uint16(b.proxy.Port()), nil
	conn, err := pgx.ConnectConfig(ctx, cfg)
	if err != nil {
		return nil, err
	}
	t.Cleanup(func() { _ = conn.Close(context.Background()) })
	return conn, nil
}

func (b *proxyBundle) mustConnect(t *testing.T) *pgx.Conn {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	conn, err := b.connect(ctx, t)
	require.NoError(t, err)
	return conn
}

// requireConns waits until p has n open connections.
func requireConns(t *testing.T, p *Proxy, n int) {
	t.Helper()
	require.Eventually(t, func() bool { return p.Conns() == n }, 10*time.Second, 5*time.Millisecond,
		"want %d open connections", n)
}

func selectOne(ctx context.Context, conn *pgx.Conn) error {
	var one int
	return conn.QueryRow(ctx, "SELECT 1").Scan(&one)
}

func TestProxyForwardsPostgres(t *testing.T) {
	t.Parallel()
	b := setupProxy(t)
	require.Equal(t, "127.0.0.1:"+strconv.Itoa(b.proxy.Port()), b.proxy.Addr())
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()

	conn := b.mustConnect(t)
	var sum int
	require.NoError(t, conn.QueryRow(ctx, "SELECT $1::int + $2::int", 40, 2).Scan(&sum))
	require.Equal(t, 42, sum)
	require.Equal(t, 1, b.proxy.Conns())

	require.NoError(t, conn.Close(ctx))
	requireConns(t, b.proxy, 0) // a connection the client closed is closed on the server side too
}

func TestProxyForwardsNATS(t *testing.T) {
	t.Parallel()
	n := StartNATS(t)
	u, err := url.Parse(n.URL())
	require.NoError(t, err)
	p := StartProxy(t, u.Host)
	nc, err := nats.Connect("nats://"+p.Addr(), nats.NoReconnect())
	require.NoError(t, err)
	defer nc.Close()

	sub, err := nc.SubscribeSync("proxy.test")
	require.NoError(t, err)
	require.NoError(t, nc.Publish("proxy.test", []byte("hello")))
	msg, err := sub.NextMsg(10 * time.Second)
	require.NoError(t, err)
	require.Equal(t, "hello", string(msg.Data))
	require.Equal(t, 1, p.Conns())
}

func TestProxyResetAll(t *testing.T) {
	t.Parallel()
	b := setupProxy(t)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	conn := b.mustConnect(t)
	require.NoError(t, selectOne(ctx, conn))

	b.proxy.ResetAll()
	require.Zero(t, b.proxy.Conns())
	require.Error(t, selectOne(ctx, conn), "a query on a reset connection must fail")

	fresh := b.mustConnect(t)
	require.NoError(t, selectOne(ctx, fresh), "the proxy must accept new connections after a reset")
	// pgx sent a cancel request for the failed query on a connection of its own, which the
	// server closes soon.
	requireConns(t, b.proxy, 1)
}

// The fault DropNextResponse stands for: the server commits, the connection is lost before
// the client reads the answer. The client sees an error, yet the row is there.
func TestProxyDropNextResponse(t *testing.T) {
	t.Parallel()
	b := setupProxy(t)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	_, err := b.db.Pool.Exec(ctx, "CREATE TABLE proxy_drop (v int)")
	require.NoError(t, err)
	conn := b.mustConnect(t)
	require.NoError(t, selectOne(ctx, conn))

	fired := b.proxy.DropNextResponse()
	require.Equal(t, fired, b.proxy.DropNextResponse(), "arming twice arms one fault")
	select {
	case <-fired:
		t.Fatal("the fault fired before the client sent anything")
	default:
	}
	// Without arguments pgx sends the statement in one round trip (simple protocol), so the
	// answer lost is the INSERT's own.
	_, err = conn.Exec(ctx, "INSERT INTO proxy_drop VALUES (1)")
	require.Error(t, err, "the client must not hear the answer")
	select {
	case <-fired:
	case <-time.After(10 * time.Second):
		t.Fatal("the fault did not fire")
	}
	require.True(t, conn.IsClosed())
	requireConns(t, b.proxy, 0)
	require.Equal(t, []int{1}, Query[int](t, b.db, "SELECT v FROM proxy_drop"), "the server committed the row")

	// The fault is one-shot.
	again := b.mustConnect(t)
	_, err = again.Exec(ctx, "INSERT INTO proxy_drop VALUES (2)")
	require.NoError(t, err)
	require.Equal(t, []int{1, 2}, Query[int](t, b.db, "SELECT v FROM proxy_drop ORDER BY v"))
}

func TestProxyFreeze(t *testing.T) {
	t.Parallel()
	b := setupProxy(t)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	conn := b.mustConnect(t)
	require.NoError(t, selectOne(ctx, conn))

	b.proxy.Freeze()
	short, cancelShort := context.WithTimeout(ctx, 300*time.Millisecond)
	defer cancelShort()
	err := selectOne(short, conn)
	require.ErrorIs(t, err, context.DeadlineExceeded, "a frozen proxy must neither answer nor refuse")
	// pgx gave up on the connection, but the proxy neither hears it (it forwards nothing)
	// nor closes it.
	require.GreaterOrEqual(t, b.proxy.Conns(), 1, "freezing closes nothing")
	short, cancelShort = context.WithTimeout(ctx, 300*time.Millisecond)
	defer cancelShort()
	_, err = b.connect(short, t)
	require.ErrorIs(t, err, context.DeadlineExceeded, "a new connection is frozen too")

	b.proxy.Unfreeze()
	fresh := b.mustConnect(t)
	require.NoError(t, selectOne(ctx, fresh))
}

func TestProxyLatency(t *testing.T) {
	t.Parallel()
	b := setupProxy(t)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	conn := b.mustConnect(t)
	require.NoError(t, selectOne(ctx, conn))

	const latency = 100 * time.Millisecond
	b.proxy.SetLatency(latency)
	start := time.Now()
	require.NoError(t, selectOne(ctx, conn))
	require.GreaterOrEqual(t, time.Since(start), latency)

	b.proxy.SetLatency(0)
	require.NoError(t, selectOne(ctx, conn))
}

// Stopping the proxy closes its connections, which the client sees at once, and its
// goroutines end (TestMain checks that none leaks).
func TestProxyStopClosesConnections(t *testing.T) {
	t.Parallel()
	db := NewDatabase(t)
	cfg, err := pgx.ParseConfig(db.URL)
	require.NoError(t, err)
	target := postgresTarget(cfg.Host, cfg.Port)

	var p *Proxy
	t.Run("proxy", func(t *testing.T) {
		p = StartProxy(t, target)
		b := &proxyBundle{db: db, proxy: p}
		b.mustConnect(t)
		b.proxy.Freeze() // a frozen connection must not hold the stop up
		require.Equal(t, 1, p.Conns())
	})
	require.Zero(t, p.Conns())
	dialer := net.Dialer{Timeout: time.Second}
	_, err = dialer.DialContext(t.Context(), "tcp", p.Addr())
	require.Error(t, err, "a stopped proxy must not accept connections")
}
