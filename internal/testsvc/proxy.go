package testsvc

import (
	"context"
	"errors"
	"net"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

// proxyDialTimeout bounds how long the proxy waits for the target to accept a connection,
// and so how long stopping the proxy can take while a dial is under way.
const proxyDialTimeout = 5 * time.Second

// Proxy is a TCP proxy a test puts between a client and a real server (PostgreSQL, NATS) to
// inject network faults: it forwards the real bytes, and can reset connections, lose a
// response, freeze like a half-open peer or add latency. Its methods are safe for concurrent
// use.
type Proxy struct {
	target string
	ln     net.Listener
	done   chan struct{} // closed when the proxy stops
	wg     sync.WaitGroup
	// latency is the delay of every forwarded chunk, in nanoseconds.
	latency   atomic.Int64
	replyRate atomic.Int64 // bytes a second from the servers, 0 for no limit
	// fromClients counts the bytes read from clients, forwarded or held; toServers, those
	// written to the servers.
	fromClients, toServers atomic.Int64
	toClients              atomic.Int64 // bytes written to the clients

	mu     sync.Mutex
	links  map[*link]struct{}
	closed bool
	// thaw is non-nil while the proxy is frozen, and closed by Unfreeze; thawReplies likewise
	// while only the server-to-client direction is (FreezeReplies).
	thaw, thawReplies chan struct{}
	// drop is non-nil while a DropNextResponse fault is armed, and closed when it fires.
	drop chan struct{}
}

// link is one client connection and the connection the proxy opened to the target for it.
type link struct {
	client, server net.Conn
	once           sync.Once
	done           chan struct{} // closed by close
}

// close closes both sides; it is safe to call more than once.
func (l *link) close() {
	l.once.Do(func() {
		close(l.done)
		_ = l.client.Close()
		_ = l.server.Close()
	})
}

// StartProxy listens on 127.0.0.1:0 and forwards every accepted connection to target
// ("host:port", or the path of a Unix socket: a throwaway Postgres listens on one); it stops (closing every connection) in t.Cleanup. When the target refuses a
// connection, the proxy closes the client's, as a server that is down would look.
func StartProxy(t testing.TB, target string) *Proxy {
	t.Helper()
	var lc net.ListenConfig
	ln, err := lc.Listen(t.Context(), "tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatalf("proxy to %s: listen: %v", target, err)
	}
	p := &Proxy{target: target, ln: ln, done: make(chan struct{}), links: map[*link]struct{}{}}
	p.wg.Go(p.acceptLoop)
	t.Cleanup(p.close)
	return p
}

// Addr returns the address clients connect to, "127.0.0.1:port".
func (p *Proxy) Addr() string { return p.ln.Addr().String() }

// Port returns the port clients connect to.
func (p *Proxy) Port() int { return p.ln.Addr().(*net.TCPAddr).Port }

// Conns reports how many connections are open. Clients open some of their own: pgx sends
// the cancel request for a query that failed mid-flight on a new, short-lived connection.
func (p *Proxy) Conns() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	n := 0
	for l := range p.links {
		select {
		case <-l.done: // closed; its goroutines are finishing
		default:
			n++
		}
	}
	return n
}

// ResetAll closes every open connection (both sides) now; new connections still work.
func (p *Proxy) ResetAll() {
	for _, l := range p.snapshot() {
		l.close()
	}
}

// DropNextResponse arms a one-shot fault: the next bytes that any connection receives from
// the server after this call are discarded and that connection is closed on both sides, so
// the server did the work but the client never hears the answer (e.g. a COMMIT that
// happened while the connection was lost). It returns a channel closed when the fault fired.
// Calling it again before the fault fired returns the same channel.
//
// "After this call" means the first read from any server that returns after the call, on
// any connection: a pool that pings a connection before handing it out (pgxpool does after
// a second idle) loses the answer to the ping, not to the query.
func (p *Proxy) DropNextResponse() <-chan struct{} {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.drop == nil {
		p.drop = make(chan struct{})
	}
	return p.drop
}

// Freeze stops forwarding in both directions without closing anything (a half-open peer:
// bytes sent are neither delivered nor refused) until Unfreeze; connections stay open, and
// new ones are accepted but frozen too.
func (p *Proxy) Freeze() {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.thaw == nil {
		p.thaw = make(chan struct{})
	}
}

// FreezeReplies stops forwarding from the server to the client only, until Unfreeze: the
// server gets what the client sends and does the work, and the client hears nothing back (its
// PubAcks or query results held in the path).
func (p *Proxy) FreezeReplies() {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.thawReplies == nil {
		p.thawReplies = make(chan struct{})
	}
}

// Unfreeze resumes forwarding after Freeze or FreezeReplies; what was held back is delivered.
func (p *Proxy) Unfreeze() {
	p.mu.Lock()
	defer p.mu.Unlock()
	for _, ch := range []*chan struct{}{&p.thaw, &p.thawReplies} {
		if *ch != nil {
			close(*ch)
			*ch = nil
		}
	}
}

// FromClients returns how many bytes the proxy has read from its clients, forwarded or held
// (while frozen): a client's writes reach it even when nothing reaches the server.
func (p *Proxy) FromClients() int64 { return p.fromClients.Load() }

// ToServers returns how many bytes the proxy has written to the servers: after Unfreeze, it
// reaches FromClients once everything held was delivered.
func (p *Proxy) ToServers() int64 { return p.toServers.Load() }

// ToClients returns how many bytes the proxy has written to its clients.
func (p *Proxy) ToClients() int64 { return p.toClients.Load() }

// SetReplyRate limits what the proxy forwards from the servers to perSecond bytes a second
// (0: no limit), as a slow link would.
func (p *Proxy) SetReplyRate(perSecond int64) { p.replyRate.Store(perSecond) }

// SetLatency delays every forwarded chunk by d (0: none), in both directions.
func (p *Proxy) SetLatency(d time.Duration) { p.latency.Store(int64(d)) }

// close stops accepting, closes every connection and waits for every goroutine.
func (p *Proxy) close() {
	p.mu.Lock()
	p.closed = true
	p.mu.Unlock()
	close(p.done)
	_ = p.ln.Close()
	p.ResetAll()
	p.wg.Wait()
}

func (p *Proxy) snapshot() []*link {
	p.mu.Lock()
	defer p.mu.Unlock()
	links := make([]*link, 0, len(p.links))
	for l := range p.links {
		links = append(links, l)
	}
	return links
}

func (p *Proxy) acceptLoop() {
	for {
		client, err := p.ln.Accept()
		if err != nil {
			if errors.Is(err, net.ErrClosed) {
				return
			}
			// A transient failure (out of file descriptors): wait a little, as net/http does.
			select {
			case <-p.done:
				return
			case <-time.After(10 * time.Millisecond):
			}
			continue
		}
		p.wg.Go(func() { p.serve(client) })
	}
}

// serve dials the target for one client connection and forwards both ways until either
// side closes or the proxy stops.
func (p *Proxy) serve(client net.Conn) {
	ctx, cancel := context.WithTimeout(context.Background(), proxyDialTimeout)
	network := "tcp"
	if strings.HasPrefix(p.target, "/") {
		network = "unix"
	}
	server, err := (&net.Dialer{}).DialContext(ctx, network, p.target)
	cancel()
	if err != nil {
		_ = client.Close()
		return
	}
	l := &link{client: client, server: server, done: make(chan struct{})}
	p.mu.Lock()
	if p.closed {
		p.mu.Unlock()
		l.close()
		return
	}
	p.links[l] = struct{}{}
	p.mu.Unlock()

	var wg sync.WaitGroup
	wg.Go(func() { p.pipe(l, l.server, l.client, false) })
	wg.Go(func() { p.pipe(l, l.client, l.server, true) })
	wg.Wait()
	p.mu.Lock()
	delete(p.links, l)
	p.mu.Unlock()
}

// pipe copies chunks from src to dst until either fails or the link closes, and then
// closes the link: a connection closed on one side is closed on the other. fromServer
// marks the server-to-client direction, where DropNextResponse fires.
func (p *Proxy) pipe(l *link, dst, src net.Conn, fromServer bool) {
	defer l.close()
	buf := make([]byte, 32<<10)
	for {
		chunk := buf
		rate := p.replyRate.Load()
		if fromServer && rate > 0 {
			chunk = buf[:max(1, min(int64(len(buf)), rate/20))] // about 20 writes a second
		}
		n, err := src.Read(chunk)
		if n > 0 && fromServer && rate > 0 {
			select {
			case <-time.After(time.Duration(int64(n) * int64(time.Second) / rate)):
			case <-l.done:
				return
			case <-p.done:
				return
			}
		}
		if n > 0 && !fromServer {
			p.fromClients.Add(int64(n))
		}
		if n > 0 {
			if fromServer {
				if fired := p.takeDrop(); fired != nil {
					l.close()
					close(fired)
					return
				}
			}
			if !p.hold(l, fromServer) {
				return
			}
			if _, err := dst.Write(buf[:n]); err != nil {
				return
			}
			if fromServer {
				p.toClients.Add(int64(n))
			} else {
				p.toServers.Add(int64(n))
			}
		}
		if err != nil {
			return
		}
	}
}

// takeDrop disarms a DropNextResponse fault and returns its channel, or nil when none was
// armed.
func (p *Proxy) takeDrop() chan struct{} {
	p.mu.Lock()
	defer p.mu.Unlock()
	fired := p.drop
	p.drop = nil
	return fired
}

// hold delays a chunk by the latency, then for as long as the proxy is frozen (in the chunk's
// direction: fromServer for the server's). It reports false when the link closed or the proxy
// stopped meanwhile.
func (p *Proxy) hold(l *link, fromServer bool) bool {
	if d := time.Duration(p.latency.Load()); d > 0 {
		timer := time.NewTimer(d)
		defer timer.Stop()
		select {
		case <-timer.C:
		case <-l.done:
			return false
		case <-p.done:
			return false
		}
	}
	for {
		p.mu.Lock()
		thaw := p.thaw
		if thaw == nil && fromServer {
			thaw = p.thawReplies
		}
		p.mu.Unlock()
		if thaw == nil {
			return true
		}
		select {
		case <-thaw:
		case <-l.done:
			return false
		case <-p.done:
			return false
		}
	}
}
