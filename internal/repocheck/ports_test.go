package repocheck

import (
	"go/ast"
	"go/parser"
	"go/token"
	"io/fs"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
)

// TestNoPickThenReleasePorts fails on code that picks a port by listening on port 0, reads the
// address and closes the listener, to hand the port to something else later: between the
// close and that bind the system may give the port to any other listener on port 0 (a CI
// run failed that way: a worker's metrics port, picked so, was taken by a test's proxy and
// the scrape reached NATS). Bind where the port is used and read back what was bound
// (--metrics-addr 127.0.0.1:0 logs "metrics listening" with the address; NATS takes port -1;
// a throwaway Postgres listens on a Unix socket).
func TestNoPickThenReleasePorts(t *testing.T) {
	root := moduleRoot(t)
	fset := token.NewFileSet()
	var found []string
	files := 0
	err := filepath.WalkDir(root, func(path string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if d.IsDir() {
			if name := d.Name(); path != root && (strings.HasPrefix(name, ".") || name == "testdata" || name == "vendor") {
				return filepath.SkipDir
			}
			return nil
		}
		if !strings.HasSuffix(path, ".go") {
			return nil
		}
		f, err := parser.ParseFile(fset, path, nil, parser.SkipObjectResolution)
		if err != nil {
			return err
		}
		files++
		for _, pos := range pickThenRelease(f) {
			p := fset.Position(pos)
			rel, _ := filepath.Rel(root, p.Filename)
			found = append(found, rel+":"+strconv.Itoa(p.Line))
		}
		return nil
	})
	require.NoError(t, err)
	require.Greater(t, files, 100, "read too few Go files under %s", root)
	require.Empty(t, found, "a listener opened only to read its port and close it: bind where the port is used instead")
}

// TestPickThenReleaseIsFound shows the check on the shapes it must catch and on uses it must
// leave alone.
func TestPickThenReleaseIsFound(t *testing.T) {
	for _, tc := range []struct {
		name  string
		src   string
		found int
	}{
		{"port returned after a deferred close", `
			func freePort() int {
				l, _ := net.Listen("tcp", "127.0.0.1:0")
				defer l.Close()
				return l.Addr().(*net.TCPAddr).Port
			}`, 1},
		{"address kept, listener closed", `
			func freeAddr(t *testing.T) string {
				var lc net.ListenConfig
				ln, err := lc.Listen(t.Context(), "tcp", "127.0.0.1:0")
				require.NoError(t, err)
				addr := ln.Addr().String()
				require.NoError(t, ln.Close())
				return addr
			}`, 1},
		{"in a loop, closed in a closure", `
			func ports(n int) (ps []int) {
				for range n {
					ln, _ := net.Listen("tcp", ":0")
					defer func() { _ = ln.Close() }()
					ps = append(ps, ln.Addr().(*net.TCPAddr).Port)
				}
				return ps
			}`, 1},
		{"declared with var", `
			func freePort() int {
				var l, _ = net.Listen("tcp", "127.0.0.1:0")
				defer l.Close()
				return l.Addr().(*net.TCPAddr).Port
			}`, 1},
		{"served", `
			func serve(ctx context.Context) error {
				ln, err := net.Listen("tcp", "127.0.0.1:0")
				if err != nil { return err }
				defer ln.Close()
				log.Info("listening", "addr", ln.Addr().String())
				return http.Serve(ln, nil)
			}`, 0},
		{"kept in a struct", `
			func start() *Proxy {
				ln, _ := net.Listen("tcp", "127.0.0.1:0")
				p := &Proxy{ln: ln}
				go p.accept()
				return p
			}`, 0},
		{"returned", `
			func listen() (net.Listener, string) {
				ln, _ := net.Listen("tcp", "127.0.0.1:0")
				return ln, ln.Addr().String()
			}`, 0},
		{"a port taken on purpose, released by the test", `
			func TestWaits(t *testing.T) {
				squatter, err := lc.Listen(ctx, "tcp", addr)
				require.NoError(t, err)
				go start()
				require.NoError(t, squatter.Close())
			}`, 0},
	} {
		t.Run(tc.name, func(t *testing.T) {
			f, err := parser.ParseFile(token.NewFileSet(), "x.go", "package x\n"+tc.src, parser.SkipObjectResolution)
			require.NoError(t, err)
			require.Len(t, pickThenRelease(f), tc.found)
		})
	}
}

// pickThenRelease returns the positions of the listeners in f that are opened (a call of a
// method or function named Listen or ListenTCP), asked for their address and closed, and used
// for nothing else: not passed to a call, not stored, not returned.
func pickThenRelease(f *ast.File) []token.Pos {
	var out []token.Pos
	ast.Inspect(f, func(n ast.Node) bool {
		var body *ast.BlockStmt
		switch fn := n.(type) {
		case *ast.FuncDecl:
			body = fn.Body
		case *ast.FuncLit:
			body = fn.Body
		}
		if body == nil {
			return true
		}
		for name, pos := range listeners(body) {
			if usedOnlyForAddrAndClose(body, name) {
				out = append(out, pos)
			}
		}
		return true
	})
	return out
}

// listeners returns the variables assigned a Listen or ListenTCP call's first result in
// body, by name, with the call's position.
func listeners(body *ast.BlockStmt) map[string]token.Pos {
	ls := map[string]token.Pos{}
	add := func(lhs ast.Expr, rhs []ast.Expr) {
		if len(rhs) != 1 {
			return
		}
		call, ok := rhs[0].(*ast.CallExpr)
		if !ok || !isListen(call.Fun) {
			return
		}
		if id, ok := lhs.(*ast.Ident); ok && id.Name != "_" {
			ls[id.Name] = call.Pos()
		}
	}
	ast.Inspect(body, func(n ast.Node) bool {
		switch x := n.(type) {
		case *ast.AssignStmt: // ln, err := net.Listen(...)
			if len(x.Lhs) > 0 {
				add(x.Lhs[0], x.Rhs)
			}
		case *ast.ValueSpec: // var ln, err = net.Listen(...)
			if len(x.Names) > 0 {
				add(x.Names[0], x.Values)
			}
		}
		return true
	})
	return ls
}

func isListen(fun ast.Expr) bool {
	var name string
	switch f := fun.(type) {
	case *ast.SelectorExpr:
		name = f.Sel.Name
	case *ast.Ident:
		name = f.Name
	}
	return name == "Listen" || name == "ListenTCP"
}

// usedOnlyForAddrAndClose reports whether every use of the variable name in body is name.Addr()
// or name.Close(), and both occur.
func usedOnlyForAddrAndClose(body *ast.BlockStmt, name string) bool {
	addr, closed, other := false, false, false
	// Selector uses: name.Addr, name.Close, anything else.
	selected := map[*ast.Ident]bool{}
	ast.Inspect(body, func(n ast.Node) bool {
		sel, ok := n.(*ast.SelectorExpr)
		if !ok {
			return true
		}
		id, ok := sel.X.(*ast.Ident)
		if !ok || id.Name != name {
			return true
		}
		selected[id] = true
		switch sel.Sel.Name {
		case "Addr":
			addr = true
		case "Close":
			closed = true
		default:
			other = true
		}
		return true
	})
	// Any other mention (an argument, a struct field's value, a return value, a send) is a
	// use beyond picking a port; the assignment itself is on the left of :=.
	ast.Inspect(body, func(n ast.Node) bool {
		switch x := n.(type) {
		case *ast.AssignStmt:
			for _, l := range x.Lhs {
				if id, ok := l.(*ast.Ident); ok && id.Name == name {
					selected[id] = true // the declaration
				}
			}
		case *ast.ValueSpec:
			for _, id := range x.Names {
				if id.Name == name {
					selected[id] = true // the declaration
				}
			}
		case *ast.Ident:
			if x.Name == name && !selected[x] {
				other = true
			}
		}
		return true
	})
	return addr && closed && !other
}

// moduleRoot returns the directory of the module's go.mod, above this package.
func moduleRoot(t *testing.T) string {
	dir, err := os.Getwd()
	require.NoError(t, err)
	for {
		if _, err := os.Stat(filepath.Join(dir, "go.mod")); err == nil {
			if b, err := os.ReadFile(filepath.Join(dir, "go.mod")); err == nil && strings.Contains(string(b), "module github.com/batonhq/baton\n") {
				return dir
			}
		}
		parent := filepath.Dir(dir)
		require.NotEqual(t, dir, parent, "go.mod of github.com/batonhq/baton not found above the test's directory")
		dir = parent
	}
}
