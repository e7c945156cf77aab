package console

import (
	"context"
	"io"
	"net/http"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
)

// hostRequest sends a request with the given Host header and headers, and returns the status.
func (e *testEnv) hostRequest(t *testing.T, method, path, host, body string, hdr ...string) int {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), waitFor)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, method, e.base+path, strings.NewReader(body))
	require.NoError(t, err)
	if host != "" {
		req.Host = host
	}
	for i := 0; i+1 < len(hdr); i += 2 {
		req.Header.Set(hdr[i], hdr[i+1])
	}
	res, err := http.DefaultClient.Do(req)
	require.NoError(t, err)
	_, _ = io.Copy(io.Discard, res.Body)
	require.NoError(t, res.Body.Close())
	return res.StatusCode
}

// TestCrossSiteRequestsRefused: a page of another site open in the operator's browser can
// neither send through the console (a cross-origin POST, which a text/plain form makes without
// a CORS preflight) nor, by DNS rebinding (its own host name resolving to 127.0.0.1), read
// conversations from a console without auth.
func TestCrossSiteRequestsRefused(t *testing.T) {
	t.Parallel()
	e := setup(t, Config{}, false)
	e.createConversation(t, "xs")

	// A cross-site POST, as a browser sends it, is refused and writes nothing.
	code := e.hostRequest(t, http.MethodPost, "/api/conversations/xs/messages", "",
		`{"id":"forged","content":"hi"}`, "Content-Type", "text/plain", "Origin", "http://evil.example", "Sec-Fetch-Site", "cross-site")
	require.Equal(t, http.StatusForbidden, code)
	code = e.hostRequest(t, http.MethodPost, "/api/conversations", "",
		`{"id":"forged-conv"}`, "Content-Type", "text/plain", "Origin", "http://evil.example")
	require.Equal(t, http.StatusForbidden, code)
	var n int
	require.NoError(t, e.db.Pool.QueryRow(context.Background(),
		`SELECT (SELECT count(*) FROM messages WHERE id = 'forged') + (SELECT count(*) FROM conversations WHERE id = 'forged-conv')`).Scan(&n))
	require.Zero(t, n, "a cross-site request wrote")
	// The console's own page (same origin) sends.
	e.send(t, "xs", "same-origin", "hi")

	// DNS rebinding: another name for 127.0.0.1 in the Host header.
	for _, path := range []string{"/", "/api/conversations", "/api/conversations/xs/messages", "/api/status"} {
		require.Equal(t, http.StatusForbidden, e.hostRequest(t, http.MethodGet, path, "rebind.evil.example:8080", ""), path)
	}
	for _, host := range []string{"localhost", "LOCALHOST:8080", "127.0.0.1:8080", "[::1]:8080", "127.0.0.2"} {
		require.Equal(t, http.StatusOK, e.hostRequest(t, http.MethodGet, "/api/conversations", host, ""), host)
	}

	// With auth, the console may be reached by any name (the browser sends the credentials
	// only to the origin they were given for).
	a := setup(t, Config{User: "ops", Password: "pw"}, false)
	require.Equal(t, http.StatusOK, a.hostRequest(t, http.MethodGet, "/api/conversations", "console.internal.example:8080", "",
		"Authorization", basic("ops", "pw")))
}
