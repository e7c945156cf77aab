// Package examples_test checks that every example builds as a user would build a copy of it:
// in a module of its own, which sees Baton only through its public packages.
package examples_test

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"go/parser"
	"go/token"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// buildTimeout bounds each go command of the test; the build cache makes them fast after the
// first build of the module.
const buildTimeout = 3 * time.Minute

// TestExamplesBuildAsTheirOwnModule copies each example's main package (without its tests)
// into a temporary module that requires github.com/batonhq/baton, replaced by this checkout,
// and builds it there. Go refuses imports of another module's internal/ packages, so the build
// fails if an example imports one: an example must be copyable into a user's module.
//
// It works offline, from the module cache: GOPROXY=off, so it never reaches the network. The
// checkout's go.sum is copied, so no checksum has to be looked up. `go mod tidy` runs with -e:
// tidy also looks for the modules that the tests of dependencies import (the yaml and diff
// modules that prometheus's tests use), which `go mod download` of this module does not fetch
// and the build does not need; -e reports them and goes on. The build that follows is the
// check: it fails on an internal import, or on an import no module in Baton's module graph
// provides.
func TestExamplesBuildAsTheirOwnModule(t *testing.T) {
	if testing.Short() {
		t.Skip("builds every example in a module of its own; skipped with -short")
	}
	root, err := filepath.Abs("..")
	require.NoError(t, err)
	goDirective := moduleGoDirective(t, filepath.Join(root, "go.mod"))
	goSum, err := os.ReadFile(filepath.Join(root, "go.sum"))
	require.NoError(t, err)

	mains := mainPackages(t, ".")
	require.Contains(t, mains, "echoagent")
	require.Contains(t, mains, "subscriber")
	for _, dir := range mains {
		t.Run(dir, func(t *testing.T) {
			mod := t.TempDir()
			copyPackage(t, dir, mod)
			goMod := "module example.com/x\n\n" + goDirective + "\n\nrequire github.com/batonhq/baton v0.0.0\n\n" +
				"replace github.com/batonhq/baton => " + root + "\n"
			require.NoError(t, os.WriteFile(filepath.Join(mod, "go.mod"), []byte(goMod), 0o600))
			require.NoError(t, os.WriteFile(filepath.Join(mod, "go.sum"), goSum, 0o600))

			tidy, _ := goCommand(t, mod, "mod", "tidy", "-e")
			build, ok := goCommand(t, mod, "build", "-o", filepath.Join(t.TempDir(), "example"), ".")
			if !ok {
				t.Fatalf("examples/%s does not build as its own module (does it import internal/ or a "+
					"module Baton does not use? Or, with \"module lookup disabled by GOPROXY=off\", the module cache "+
					"lacks a go.mod of Baton's module graph: run go mod download all, as make test does)\n"+
					"go mod tidy -e:\n%s\ngo build:\n%s", dir, tidy, build)
			}
		})
	}
}

// goCommand runs go with args in dir, offline, and returns its output and whether it
// succeeded.
func goCommand(t *testing.T, dir string, args ...string) (out []byte, ok bool) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), buildTimeout)
	defer cancel()
	cmd := exec.CommandContext(ctx, "go", args...)
	cmd.Dir = dir
	cmd.Env = append(withoutGoSettings(os.Environ()),
		"GOPROXY=off",                      // the module cache or nothing
		"GOFLAGS=-mod=mod -buildvcs=false", // go may add the example's requirements; no VCS stamping
		"GOWORK=off",                       // a go.work above the temp dir must not pull the checkout in
		"GOTOOLCHAIN=local",
	)
	out, err := cmd.CombinedOutput()
	if ctx.Err() != nil {
		t.Fatalf("go %s in %s did not finish within %v:\n%s", strings.Join(args, " "), dir, buildTimeout, out)
	}
	if err == nil {
		return out, true
	}
	var exit *exec.ExitError
	require.True(t, errors.As(err, &exit), "go %s: %v", strings.Join(args, " "), err)
	return append(out, err.Error()...), false
}

// withoutGoSettings drops the variables goCommand sets, so the environment cannot override them.
func withoutGoSettings(env []string) []string {
	var out []string
	for _, kv := range env {
		name, _, _ := strings.Cut(kv, "=")
		switch name {
		case "GOPROXY", "GOFLAGS", "GOWORK", "GOTOOLCHAIN":
			continue
		}
		out = append(out, kv)
	}
	return out
}

// moduleGoDirective returns the go line of the go.mod file at path ("go 1.26.0").
func moduleGoDirective(t *testing.T, path string) string {
	t.Helper()
	b, err := os.ReadFile(path)
	require.NoError(t, err)
	sc := bufio.NewScanner(bytes.NewReader(b))
	for sc.Scan() {
		if line := strings.TrimSpace(sc.Text()); strings.HasPrefix(line, "go ") {
			return line
		}
	}
	t.Fatalf("%s has no go directive", path)
	return ""
}

// mainPackages returns the directories under dir, relative to it, that hold a main package.
func mainPackages(t *testing.T, dir string) []string {
	t.Helper()
	var mains []string
	err := filepath.WalkDir(dir, func(path string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if d.IsDir() && path != dir && (d.Name() == "testdata" || strings.HasPrefix(d.Name(), ".") || strings.HasPrefix(d.Name(), "_")) {
			return filepath.SkipDir
		}
		if d.IsDir() || !isSource(d.Name()) {
			return nil
		}
		f, err := parser.ParseFile(token.NewFileSet(), path, nil, parser.PackageClauseOnly)
		if err != nil {
			return err
		}
		if rel := filepath.Dir(path); f.Name.Name == "main" && (len(mains) == 0 || mains[len(mains)-1] != rel) {
			mains = append(mains, rel)
		}
		return nil
	})
	require.NoError(t, err)
	return mains
}

// isSource reports whether name is a Go file the package is built from (not a test).
func isSource(name string) bool {
	return strings.HasSuffix(name, ".go") && !strings.HasSuffix(name, "_test.go")
}

// copyPackage copies the files of the package in src, without its tests, into dst.
func copyPackage(t *testing.T, src, dst string) {
	t.Helper()
	entries, err := os.ReadDir(src)
	require.NoError(t, err)
	copied := 0
	for _, e := range entries {
		if !e.Type().IsRegular() || strings.HasSuffix(e.Name(), "_test.go") {
			continue
		}
		b, err := os.ReadFile(filepath.Join(src, e.Name()))
		require.NoError(t, err)
		require.NoError(t, os.WriteFile(filepath.Join(dst, e.Name()), b, 0o600))
		if isSource(e.Name()) {
			copied++
		}
	}
	require.NotZero(t, copied, "%s has no Go files", src)
}
