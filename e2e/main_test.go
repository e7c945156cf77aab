package e2e

import (
	"os"
	"testing"

	"github.com/batonhq/baton/internal/testsvc"
)

// TestMain removes the programs the tests built and checks that no goroutine of the test
// process (proxies, producers, the in-process NATS server) outlived them.
func TestMain(m *testing.M) { os.Exit(testsvc.MainNoLeaks(m)) }
