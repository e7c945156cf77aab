package producer_test

import (
	"testing"

	"go.uber.org/goleak"

	"github.com/batonhq/baton/internal/testsvc"
)

// runFunc lets goleak check for leaks after testsvc.Main has run the tests and stopped the shared
// Postgres cluster (whose pools and watcher goroutines would otherwise count as leaks).
type runFunc func() int

func (f runFunc) Run() int { return f() }

func TestMain(m *testing.M) {
	goleak.VerifyTestMain(runFunc(func() int { return testsvc.Main(m) }))
}
