package testsvc

import (
	"bufio"
	"io"
	"os"
	"os/exec"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"
)

// Process is a program a test runs as a child process (a Baton command, an example), with the
// lines it wrote kept for the test to wait on and to show when it fails.
type Process struct {
	Name   string
	Cmd    *exec.Cmd
	exited chan struct{}
	err    error // Cmd.Wait's result, set before exited is closed

	mu    sync.Mutex
	lines []string
}

// StartProcess starts bin with args, with env added to the test's environment, keeping the
// lines of its standard error and output. The test's cleanup stops it with SIGTERM, requires a
// clean exit within 30s, and logs the end of its output when the test failed.
func StartProcess(t *testing.T, name, bin string, env []string, args ...string) *Process {
	t.Helper()
	// Not CommandContext: the test's context ends before its cleanup, whose SIGTERM checks a clean
	// exit; a context would kill the process first.
	cmd := exec.Command(bin, args...) //nolint:gosec,noctx // G204: a program of this module, named by the test
	cmd.Env = append(os.Environ(), env...)
	out, err := cmd.StderrPipe()
	if err != nil {
		t.Fatalf("%s: %v", name, err)
	}
	cmd.Stdout = cmd.Stderr
	p := &Process{Name: name, Cmd: cmd, exited: make(chan struct{})}
	if err := cmd.Start(); err != nil {
		t.Fatalf("start %s: %v", name, err)
	}
	go func() {
		sc := bufio.NewScanner(out)
		sc.Buffer(make([]byte, 64<<10), 4<<20)
		for sc.Scan() {
			p.mu.Lock()
			p.lines = append(p.lines, sc.Text())
			p.mu.Unlock()
		}
		_, _ = io.Copy(io.Discard, out)
		p.err = cmd.Wait()
		close(p.exited)
	}()
	t.Cleanup(func() {
		select {
		case <-p.exited:
		default:
			if err := p.Stop(30 * time.Second); err != nil {
				t.Error(err)
			}
		}
		if t.Failed() {
			t.Logf("%s log:\n%s", name, p.Tail(16<<10))
		}
	})
	return p
}

// Exited is closed once the process exited; Err then says how.
func (p *Process) Exited() <-chan struct{} { return p.exited }

// Err is the process's exit error (nil: exit status 0), once Exited is closed.
func (p *Process) Err() error {
	<-p.exited
	return p.err
}

// Stop sends SIGTERM and waits up to within for the process to exit, killing it after that. It
// returns an error when the process did not exit cleanly in time.
func (p *Process) Stop(within time.Duration) error {
	_ = p.Cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-p.exited:
		if p.err != nil {
			return &stopError{name: p.Name, err: p.err}
		}
		return nil
	case <-time.After(within):
		_ = p.Cmd.Process.Kill()
		<-p.exited
		return &stopError{name: p.Name, timeout: within}
	}
}

type stopError struct {
	name    string
	err     error
	timeout time.Duration
}

func (e *stopError) Error() string {
	if e.err != nil {
		return e.name + " did not stop cleanly on SIGTERM: " + e.err.Error()
	}
	return e.name + " did not stop within " + e.timeout.String() + " of SIGTERM"
}

// LogLines returns the lines written so far.
func (p *Process) LogLines() []string {
	p.mu.Lock()
	defer p.mu.Unlock()
	return append([]string(nil), p.lines...)
}

// Tail returns the last n bytes of the output.
func (p *Process) Tail(n int) string {
	out := strings.Join(p.LogLines(), "\n")
	return out[max(0, len(out)-n):]
}

// WaitLog waits until a line contains part and every one of more, and returns it; it fails the
// test when the process exits first or within passes.
func (p *Process) WaitLog(t testing.TB, part string, within time.Duration, more ...string) string {
	t.Helper()
	deadline := time.Now().Add(within)
	for {
		for _, l := range p.LogLines() {
			if containsAll(l, append([]string{part}, more...)) {
				return l
			}
		}
		select {
		case <-p.exited:
			t.Fatalf("%s exited (%v) before logging %q", p.Name, p.err, part)
		default:
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s did not log %q %q within %v", p.Name, part, more, within)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// RequireRunning fails the test when the process exited.
func (p *Process) RequireRunning(t testing.TB) {
	t.Helper()
	select {
	case <-p.exited:
		t.Fatalf("%s exited: %v\n%s", p.Name, p.err, p.Tail(4<<10))
	default:
	}
}

func containsAll(s string, parts []string) bool {
	for _, p := range parts {
		if !strings.Contains(s, p) {
			return false
		}
	}
	return true
}
