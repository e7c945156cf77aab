// Package console drives `baton console` in a real headless Chromium (chromedp) against the
// whole system: a throwaway Postgres and NATS JetStream, `baton relay`, examples/echoagent and
// `baton console`, each a process. It sends messages from the page and watches their states
// arrive (local → synchronized → queued → running → replied, or failed), loses and regains the
// console's server, and takes the screenshots of the README (`make screenshots` writes them to
// docs/; otherwise they go to a temp dir).
package console

import (
	"os"
	"testing"

	"github.com/batonhq/baton/internal/testsvc"
)

func TestMain(m *testing.M) { os.Exit(testsvc.Main(m)) }
