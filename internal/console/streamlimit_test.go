package console

import (
	"context"
	"net/http"
	"net/http/httptest"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"
)

// TestStreamsPerClient: one client (an IP address) holds at most MaxStreamsPerClient event
// streams (default 8): the 9th is refused with 503 and says why, while another client still
// opens one; closing a stream frees its place, and a stream that ends before streaming (an
// unknown conversation) or after gives its place back, leaving no count behind.
func TestStreamsPerClient(t *testing.T) {
	t.Parallel()
	e := setup(t, Config{}, false)
	require.Equal(t, DefaultMaxStreamsPerClient, e.srv.cfg.MaxStreamsPerClient)
	e.createConversation(t, "conv-1")

	// An unknown conversation is refused after the stream was counted: its place comes back.
	code, body := e.do(t, http.MethodGet, "/api/conversations/nope/events", nil)
	jsonErr(t, http.StatusNotFound, code, body)

	var open []*stream
	for range DefaultMaxStreamsPerClient {
		s := e.openStream(t, "conv-1")
		require.True(t, (<-s.events).Full)
		open = append(open, s)
	}
	code, body = e.do(t, http.MethodGet, "/api/conversations/conv-1/events", nil)
	require.Equal(t, "too many open event streams from this client (at most 8)", jsonErr(t, http.StatusServiceUnavailable, code, body))

	// Another client is not held back by this one (127.0.0.2 is loopback too).
	other := e.openStreamWith(t, clientFrom(t, "127.0.0.2"), "conv-1")
	require.True(t, (<-other.events).Full)

	open[0].close()
	require.Eventually(t, func() bool { return e.clientStreams("127.0.0.1") == DefaultMaxStreamsPerClient-1 }, waitFor, 10*time.Millisecond)
	again := e.openStream(t, "conv-1")
	require.True(t, (<-again.events).Full)
	code, body = e.do(t, http.MethodGet, "/api/conversations/conv-1/events", nil)
	jsonErr(t, http.StatusServiceUnavailable, code, body)

	for _, s := range append(open[1:], again, other) {
		s.close()
	}
	require.Eventually(t, func() bool {
		e.srv.mu.Lock()
		defer e.srv.mu.Unlock()
		return len(e.srv.clients) == 0 && e.srv.streams.Load() == 0
	}, waitFor, 10*time.Millisecond, "closed streams left counts behind")
}

// clientStreams is how many streams the server counts for client.
func (e *testEnv) clientStreams(client string) int {
	e.srv.mu.Lock()
	defer e.srv.mu.Unlock()
	return e.srv.clients[client]
}

// TestStreamClient: a stream counts against the connection's IP address, never a header.
func TestStreamClient(t *testing.T) {
	t.Parallel()
	for addr, want := range map[string]string{
		"127.0.0.1:51234": "127.0.0.1",
		"[::1]:8080":      "::1",
		"[fe80::1%lo]:1":  "fe80::1%lo",
		"203.0.113.9:443": "203.0.113.9",
		"not an address":  "not an address",
	} {
		r := httptest.NewRequestWithContext(context.Background(), http.MethodGet, "/api/conversations/c/events", nil)
		r.RemoteAddr = addr
		r.Header.Set("X-Forwarded-For", "198.51.100.7")
		r.Header.Set("X-Real-IP", "198.51.100.8")
		require.Equal(t, want, streamClient(r), addr)
	}
}

// TestMaxStreamsPerClientConfig: zero takes the default, a negative value is refused.
func TestMaxStreamsPerClientConfig(t *testing.T) {
	t.Parallel()
	pool, err := pgxpool.New(context.Background(), "postgres://nobody@127.0.0.1:1/none") // never connects
	require.NoError(t, err)
	defer pool.Close()
	for in, want := range map[int]int{0: DefaultMaxStreamsPerClient, 1: 1, 3: 3} {
		srv, err := New(Config{Pool: pool, MaxStreamsPerClient: in})
		require.NoError(t, err)
		require.Equal(t, want, srv.cfg.MaxStreamsPerClient, in)
	}
	_, err = New(Config{Pool: pool, MaxStreamsPerClient: -1})
	require.ErrorContains(t, err, "MaxStreamsPerClient must be positive")
}
