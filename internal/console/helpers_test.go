package console

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"io"
	"net"
	"net/http"
	"net/url"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go"
	"github.com/stretchr/testify/require"

	"github.com/batonhq/baton/internal/testsvc"
)

// waitFor bounds every wait of these tests.
const waitFor = 15 * time.Second

// env is a console serving one test's database (and NATS, when asked for).
type testEnv struct {
	db   *testsvc.Database
	nc   *nats.Conn
	srv  *Server
	base string // http://127.0.0.1:port
}

// setup serves a console on the test's own database; cfg's Pool defaults to the database's
// pool. The console stops when the test ends, and must stop cleanly.
func setup(t *testing.T, cfg Config, withNATS bool) *testEnv {
	t.Helper()
	e := &testEnv{db: testsvc.NewDatabase(t)}
	if cfg.Pool == nil {
		cfg.Pool = e.db.RolePool(t, testsvc.RoleConsole) // as deployed: roles.sql's console role
	}
	if withNATS {
		n := testsvc.StartNATS(t)
		nc, err := nats.Connect(n.URL())
		require.NoError(t, err)
		t.Cleanup(nc.Close)
		e.nc, cfg.NATS = nc, nc
	}
	return serve(t, e, cfg)
}

func serve(t *testing.T, e *testEnv, cfg Config) *testEnv {
	t.Helper()
	srv, err := New(cfg)
	require.NoError(t, err)
	e.srv = srv
	var lc net.ListenConfig
	ln, err := lc.Listen(context.Background(), "tcp", "127.0.0.1:0")
	require.NoError(t, err)
	e.base = "http://" + ln.Addr().String()
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 2)
	go func() { done <- srv.Serve(ctx, ln) }()
	go func() { done <- srv.Run(ctx) }()
	t.Cleanup(func() {
		cancel()
		for range 2 {
			select {
			case err := <-done:
				require.NoError(t, err)
			case <-time.After(waitFor):
				t.Fatal("console did not stop")
			}
		}
	})
	return e
}

// do sends a request and returns the status and body.
func (e *testEnv) do(t *testing.T, method, path string, body any, hdr ...string) (int, []byte) {
	t.Helper()
	var r io.Reader
	switch b := body.(type) {
	case nil:
	case []byte:
		r = bytes.NewReader(b)
	case string:
		r = strings.NewReader(b)
	case chunked:
		r = io.MultiReader(strings.NewReader(string(b))) // not a *strings.Reader: length unknown
	default:
		j, err := json.Marshal(b)
		require.NoError(t, err)
		r = bytes.NewReader(j)
	}
	ctx, cancel := context.WithTimeout(context.Background(), waitFor)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, method, e.base+path, r)
	require.NoError(t, err)
	for i := 0; i+1 < len(hdr); i += 2 {
		req.Header.Set(hdr[i], hdr[i+1])
	}
	res, err := http.DefaultClient.Do(req)
	require.NoError(t, err)
	defer func() { _ = res.Body.Close() }()
	out, err := io.ReadAll(res.Body)
	require.NoError(t, err)
	return res.StatusCode, out
}

// jsonErr requires a JSON error answer with code and returns its message.
func jsonErr(t *testing.T, code int, gotCode int, body []byte) string {
	t.Helper()
	require.Equal(t, code, gotCode, string(body))
	var e apiError
	require.NoError(t, json.Unmarshal(body, &e), string(body))
	require.NotEmpty(t, e.Error)
	return e.Error
}

func (e *testEnv) createConversation(t *testing.T, id string) {
	t.Helper()
	code, body := e.do(t, http.MethodPost, "/api/conversations", map[string]string{"id": id})
	require.Equal(t, http.StatusCreated, code, string(body))
}

func (e *testEnv) send(t *testing.T, conv, id, content string) sendResponse {
	t.Helper()
	code, body := e.do(t, http.MethodPost, "/api/conversations/"+url.PathEscape(conv)+"/messages",
		map[string]string{"id": id, "content": content})
	require.Equal(t, http.StatusOK, code, string(body))
	var res sendResponse
	require.NoError(t, json.Unmarshal(body, &res))
	return res
}

// stream is an open event stream of a conversation.
type stream struct {
	events chan messagesEvent
	cancel context.CancelFunc
	done   chan struct{}
}

// openStream opens the conversation's event stream; it is closed when the test ends.
func (e *testEnv) openStream(t *testing.T, conv string) *stream {
	t.Helper()
	return e.openStreamWith(t, http.DefaultClient, conv)
}

// openStreamWith is openStream through client (one that connects from another address, say).
func (e *testEnv) openStreamWith(t *testing.T, client *http.Client, conv string) *stream {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, e.base+"/api/conversations/"+url.PathEscape(conv)+"/events", nil)
	require.NoError(t, err)
	res, err := client.Do(req)
	require.NoError(t, err)
	if res.StatusCode != http.StatusOK {
		b, _ := io.ReadAll(res.Body)
		_ = res.Body.Close()
		cancel()
		t.Fatalf("open the stream of %s: %d %s", conv, res.StatusCode, b)
	}
	require.Equal(t, "text/event-stream", res.Header.Get("Content-Type"))
	s := &stream{events: make(chan messagesEvent, 100), cancel: cancel, done: make(chan struct{})}
	go func() {
		defer close(s.done)
		defer func() { _ = res.Body.Close() }()
		sc := bufio.NewScanner(res.Body)
		sc.Buffer(make([]byte, 0, 64<<10), 4<<20)
		var event string
		for sc.Scan() {
			line := sc.Text()
			switch {
			case strings.HasPrefix(line, "event: "):
				event = strings.TrimPrefix(line, "event: ")
			case strings.HasPrefix(line, "data: ") && event == "messages":
				var ev messagesEvent
				if json.Unmarshal([]byte(strings.TrimPrefix(line, "data: ")), &ev) == nil {
					select {
					case s.events <- ev:
					case <-ctx.Done():
						return
					}
				}
			case line == "":
				event = ""
			}
		}
	}()
	t.Cleanup(s.close)
	return s
}

func (s *stream) close() {
	s.cancel()
	<-s.done
}

// states collects the states a stream shows for message id until it shows want, and returns
// them in order without repeats in a row.
func (s *stream) states(t *testing.T, id, want string) []string {
	t.Helper()
	var seen []string
	timeout := time.After(waitFor)
	for {
		select {
		case ev, ok := <-s.events:
			if !ok {
				t.Fatalf("stream ended; %s showed %v", id, seen)
			}
			for _, m := range ev.Messages {
				if m.ID != id {
					continue
				}
				if len(seen) == 0 || seen[len(seen)-1] != m.State {
					seen = append(seen, m.State)
				}
				if m.State == want {
					return seen
				}
			}
		case <-timeout:
			t.Fatalf("message %s did not reach %s; showed %v", id, want, seen)
		}
	}
}

// view waits until the stream shows message id in state want and returns that view.
func (s *stream) view(t *testing.T, id, want string) MessageView {
	t.Helper()
	timeout := time.After(waitFor)
	for {
		select {
		case ev := <-s.events:
			for _, m := range ev.Messages {
				if m.ID == id && m.State == want {
					return m
				}
			}
		case <-timeout:
			t.Fatalf("message %s did not reach %s", id, want)
		}
	}
}

// exec runs SQL as the test database's owner.
func exec(t *testing.T, pool *pgxpool.Pool, sql string, args ...any) {
	t.Helper()
	_, err := pool.Exec(context.Background(), sql, args...)
	require.NoError(t, err, sql)
}

// serveUntilStopped serves a console on db's pool for a test that stops it itself and checks
// how: stop ends Serve's context and returns Serve's result, failing the test when Serve takes
// longer than within to return.
func serveUntilStopped(t *testing.T, db *testsvc.Database, within time.Duration) (srv *Server, addr string, stop func() error) {
	t.Helper()
	srv, err := New(Config{Pool: db.RolePool(t, testsvc.RoleConsole)})
	require.NoError(t, err)
	var lc net.ListenConfig
	ln, err := lc.Listen(context.Background(), "tcp", "127.0.0.1:0")
	require.NoError(t, err)
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(cancel)
	done := make(chan error, 1)
	go func() { done <- srv.Serve(ctx, ln) }()
	return srv, ln.Addr().String(), func() error {
		t.Helper()
		cancel()
		select {
		case err := <-done:
			return err
		case <-time.After(within):
			t.Fatalf("Serve did not return within %v of its context's end", within)
			return nil
		}
	}
}

// clientFrom is an HTTP client whose connections come from the loopback address ip (any of
// 127.0.0.0/8 on Linux): to the console, another client.
func clientFrom(t *testing.T, ip string) *http.Client {
	t.Helper()
	d := &net.Dialer{LocalAddr: &net.TCPAddr{IP: net.ParseIP(ip)}}
	tr := &http.Transport{DialContext: d.DialContext}
	t.Cleanup(tr.CloseIdleConnections)
	return &http.Client{Transport: tr}
}
