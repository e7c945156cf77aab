package console

import (
	"os"
	"testing"

	"github.com/batonhq/baton/internal/testsvc"
)

func TestMain(m *testing.M) { os.Exit(testsvc.MainNoLeaks(m)) }
