package browser

import (
	"fmt"
	"image/png"
	"net/http"
	"net/http/httptest"
	"os"
	"testing"
	"time"

	"github.com/chromedp/chromedp"
	"github.com/stretchr/testify/require"
)

// TestBrowserRunsScript loads a page from a local server whose script writes into the DOM, and
// reads it back: Chromium starts on this machine, runs JavaScript and reaches localhost.
func TestBrowserRunsScript(t *testing.T) {
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
		_, _ = fmt.Fprint(w, `<!doctype html><body><p id="out">static</p>
<script>document.getElementById("out").textContent = "from script " + (6 * 7);</script></body>`)
	}))
	defer srv.Close()
	ctx := Start(t, time.Minute)
	require.NoError(t, chromedp.Do(ctx, chromedp.Navigate(srv.URL)))
	text, err := chromedp.Run(ctx, chromedp.Text(chromedp.ID("out")))
	require.NoError(t, err)
	require.Equal(t, "from script 42", text)

	t.Setenv(ScreenshotsEnv, t.TempDir())
	f, err := os.Open(Screenshot(ctx, t, "page.png"))
	require.NoError(t, err)
	defer func() { _ = f.Close() }()
	img, err := png.Decode(f)
	require.NoError(t, err, "the screenshot is a PNG")
	require.Equal(t, 1280, img.Bounds().Dx())
}
