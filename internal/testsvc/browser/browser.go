// Package browser starts a real headless Chromium for Baton's browser tests and drives it over
// the DevTools protocol (chromedp). Each test gets a browser of its own, with an empty profile in
// a temp dir, closed when the test ends.
//
// Chromium is found on PATH (chromium, chromium-browser, google-chrome), or at
// BATON_TEST_CHROMIUM. It is not a service a test may silently do without: a missing browser
// fails the test with a message that says how to install it. As root (CI runs as root), Chromium
// refuses to start without --no-sandbox, which Start then passes.
package browser

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/chromedp/chromedp"
)

// ScreenshotsEnv names the directory Screenshot writes into (`make screenshots` sets it to
// docs/); without it, screenshots go to a temp dir of the test's, so a test run never modifies
// tracked files.
const ScreenshotsEnv = "BATON_SCREENSHOTS_DIR"

// Path returns the Chromium binary to run: BATON_TEST_CHROMIUM, or the first of chromium,
// chromium-browser and google-chrome on PATH.
func Path() (string, error) {
	if p := os.Getenv("BATON_TEST_CHROMIUM"); p != "" {
		return p, nil
	}
	for _, name := range []string{"chromium", "chromium-browser", "google-chrome"} {
		if p, err := exec.LookPath(name); err == nil {
			return p, nil
		}
	}
	return "", fmt.Errorf("no Chromium for the browser tests: install it (Debian: apt-get install chromium; .ci/run does) or set BATON_TEST_CHROMIUM to its path")
}

// Start starts a headless Chromium for t and returns the context of its first tab, for
// chromedp.Run. Everything run on it is bounded by within; the browser is closed when the test
// ends.
func Start(t testing.TB, within time.Duration) context.Context {
	t.Helper()
	bin, err := Path()
	if err != nil {
		t.Fatal(err)
	}
	opts := []chromedp.ExecAllocatorOption{
		chromedp.ExecPath(bin),
		chromedp.UserDataDir(t.TempDir()),
		chromedp.Flag("headless", true),
		chromedp.Flag("disable-gpu", true),
		chromedp.Flag("disable-quic", true),
		chromedp.Flag("no-first-run", true),
		chromedp.Flag("no-default-browser-check", true),
		// Without these, Chromium calls home at start; on a closed network its connections are
		// refused, many at a time.
		chromedp.Flag("disable-background-networking", true),
		chromedp.Flag("disable-component-update", true),
		chromedp.Flag("disable-sync", true),
		chromedp.Flag("disable-extensions", true),
		chromedp.Flag("disable-dev-shm-usage", true),
		chromedp.Flag("mute-audio", true),
		chromedp.WindowSize(1280, 860),
	}
	if os.Geteuid() == 0 {
		opts = append(opts, chromedp.NoSandbox)
	}
	ctx, cancelTime := context.WithTimeout(t.Context(), within)
	actx, cancelAlloc := chromedp.NewExecAllocator(ctx, opts...)
	var logs strings.Builder
	bctx, cancelBrowser := chromedp.NewContext(actx, chromedp.WithErrorf(func(format string, args ...any) {
		fmt.Fprintf(&logs, format+"\n", args...)
	}))
	t.Cleanup(func() {
		cancelBrowser()
		cancelAlloc()
		cancelTime()
		if t.Failed() && logs.Len() > 0 {
			t.Logf("chromedp errors:\n%s", logs.String())
		}
	})
	// Start the browser now, so a browser that cannot start fails here and says so.
	if err := chromedp.Do(bctx); err != nil {
		t.Fatalf("start Chromium (%s): %v", bin, err)
	}
	return bctx
}

// Screenshot saves the tab's viewport as name (a .png file name) in the screenshots directory
// (see ScreenshotsEnv) and returns its path.
func Screenshot(ctx context.Context, t testing.TB, name string) string {
	t.Helper()
	dir := os.Getenv(ScreenshotsEnv)
	if dir == "" {
		dir = t.TempDir()
	}
	png, err := chromedp.Run(ctx, chromedp.CaptureScreenshot())
	if err != nil {
		t.Fatalf("screenshot %s: %v", name, err)
	}
	path := filepath.Join(dir, name)
	if err := os.WriteFile(path, png, 0o644); err != nil { //nolint:gosec // G306: a picture for the docs
		t.Fatalf("write screenshot: %v", err)
	}
	return path
}
