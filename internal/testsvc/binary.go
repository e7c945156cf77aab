package testsvc

import (
	"fmt"
	"os"
	"os/exec"
	"path"
	"path/filepath"
	"slices"
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

// Binaries is Binary for several main packages at once: the ones not built yet are built by
// one `go build`, which compiles and links them in parallel. It returns their paths in the
// order of pkgs.
func Binaries(t testing.TB, pkgs ...string) []string {
	t.Helper()
	binaries.mu.Lock()
	defer binaries.mu.Unlock()
	if binaries.dir == "" {
		dir, err := os.MkdirTemp("", "baton-bin-")
		if err != nil {
			t.Fatalf("temp dir for binaries: %v", err)
		}
		binaries.dir, binaries.built = dir, map[string]string{}
	}
	var missing []string
	for _, pkg := range pkgs {
		if _, ok := binaries.built[pkg]; !ok && !slices.Contains(missing, pkg) {
			missing = append(missing, pkg)
		}
	}
	if len(missing) > 0 {
		// One go build for all of them: it compiles what they share once and links them in
		// parallel, writing each program into dir under its package's last element.
		dir, err := os.MkdirTemp(binaries.dir, "set-")
		if err != nil {
			t.Fatalf("temp dir for binaries: %v", err)
		}
		names := map[string]bool{}
		for _, pkg := range missing {
			if names[path.Base(pkg)] {
				t.Fatalf("Binaries: two packages named %s; build them with Binary", path.Base(pkg))
			}
			names[path.Base(pkg)] = true
		}
		args := append([]string{"build", "-o", dir + string(filepath.Separator)}, missing...)
		build := exec.CommandContext(t.Context(), "go", args...) //nolint:gosec // G204: packages of this module, named by the test
		if out, err := build.CombinedOutput(); err != nil {
			t.Fatalf("go build %v: %v: %s", missing, err, out)
		}
		for _, pkg := range missing {
			binaries.built[pkg] = filepath.Join(dir, path.Base(pkg))
		}
	}
	out := make([]string, len(pkgs))
	for i, pkg := range pkgs {
		out[i] = binaries.built[pkg]
	}
	return out
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
