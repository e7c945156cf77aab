package testsvc

import (
	"fmt"
	"os"
	"os/exec"
	"path"
	"path/filepath"
	"sync"
	"testing"
)

// binaries are the programs built by Binary in this test binary, in one temp dir that Main
// removes.
var binaries struct {
	mu    sync.Mutex
	dir   string
	built map[string]string
}

// Binary builds the main package pkg (an import path such as
// "github.com/batonhq/baton/cmd/baton") once per test binary and returns the program's path,
// for tests that run it as a process and kill it.
func Binary(t testing.TB, pkg string) string {
	t.Helper()
	binaries.mu.Lock()
	defer binaries.mu.Unlock()
	if bin, ok := binaries.built[pkg]; ok {
		return bin
	}
	if binaries.dir == "" {
		dir, err := os.MkdirTemp("", "baton-bin-")
		if err != nil {
			t.Fatalf("temp dir for binaries: %v", err)
		}
		binaries.dir, binaries.built = dir, map[string]string{}
	}
	bin := filepath.Join(binaries.dir, path.Base(pkg))
	build := exec.CommandContext(t.Context(), "go", "build", "-o", bin, pkg) //nolint:gosec // G204: a package of this module, named by the test
	if out, err := build.CombinedOutput(); err != nil {
		t.Fatalf("go build %s: %v: %s", pkg, err, out)
	}
	binaries.built[pkg] = bin
	return bin
}

func removeBinaries() error {
	binaries.mu.Lock()
	defer binaries.mu.Unlock()
	if binaries.dir == "" {
		return nil
	}
	if err := os.RemoveAll(binaries.dir); err != nil {
		return fmt.Errorf("remove built binaries: %w", err)
	}
	binaries.dir, binaries.built = "", nil
	return nil
}
