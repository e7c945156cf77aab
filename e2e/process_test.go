package e2e

import (
	"bufio"
	"bytes"
	"context"
	"fmt"
	"net/http"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/batonhq/baton/internal/opsserver"
	"github.com/batonhq/baton/internal/testsvc"
)

// proc is one of the system's programs (a relay, a worker, the subscriber) run as a child
// process, restartable with the same command line: its database and NATS connections go
// through proxies of its own, so network faults reach it and only it.
type proc struct {
	name        string
	kind        string // "relay", "worker" or "subscriber"
	bin         string
	args, env   []string
	metricsAddr string           // BATON_METRICS_ADDR, opsserver.AnyPort; "" for the subscriber
	pg          *testsvc.Proxy   // nil for the subscriber
	nats        []*testsvc.Proxy // one per NATS server (node of a cluster)
	stdoutLine  func(string)     // called for each line the process prints on stdout, or nil
	// recordLine is offered each line the process logs, and reports whether it was a record
	// the stream-level checks read (streams_test.go), kept apart from the log; nil for the
	// subscriber.
	recordLine func(string) bool

	log *tail // stderr of every run of the process, its end kept

	mu      sync.Mutex
	cmd     *exec.Cmd
	exited  chan struct{} // closed when the current run's process has exited
	status  error         // Wait's result of the last run that ended
	stopped bool          // SIGSTOPped, not yet continued
	// metricsAt is where the current run serves its metrics, from its log: each run binds a
	// port of its own. "" until the run logged it, and once it exited.
	metricsAt string
	// expecting is set while the test itself kills or stops the process; an exit without it
	// is a crash and recorded in crashes.
	expecting bool
	crashes   []string
	starts    int
	// busyWaits counts a relay's waits on its walsender busy decoding (a neighbour's bulk
	// transaction), from its log.
	busyWaits atomic.Int64
}

// walsenderBusyLog starts the relay's log line of a wait on its walsender busy decoding.
const walsenderBusyLog = "the walsender is busy decoding"

// start starts a new run of the process.
func (p *proc) start(t *testing.T) {
	t.Helper()
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.cmd != nil {
		t.Fatalf("%s: already running", p.name)
	}
	cmd := exec.Command(p.bin, p.args...)
	cmd.Env = append(os.Environ(), p.env...)
	p.log.note("start #%d", p.starts+1)
	cmd.Stderr = &testsvc.LineWriter{Line: func(line string) {
		if p.recordLine != nil && p.recordLine(line) {
			return // a record, not kept in the log: there would be little else to read
		}
		_, _ = p.log.Write([]byte(line + "\n"))
		if strings.Contains(line, walsenderBusyLog) {
			p.busyWaits.Add(1)
		}
		if addr, ok := opsserver.ListeningAddr(line, opsserver.MetricsListening); ok {
			p.mu.Lock()
			defer p.mu.Unlock()
			if p.cmd == cmd { // not a run the test already saw exit
				p.metricsAt = addr
			}
		}
	}}
	if p.stdoutLine != nil {
		cmd.Stdout = &testsvc.LineWriter{Line: p.stdoutLine}
	}
	if err := cmd.Start(); err != nil {
		t.Fatalf("%s: start: %v", p.name, err)
	}
	p.cmd, p.exited, p.stopped, p.expecting, p.metricsAt = cmd, make(chan struct{}), false, false, ""
	p.starts++
	exited := p.exited
	go func() { // owned by the process: ends when it exits
		err := cmd.Wait()
		p.mu.Lock()
		defer p.mu.Unlock()
		p.status = err
		if !p.expecting {
			p.crashes = append(p.crashes, fmt.Sprintf("%s (pid %d) exited on its own: %v", p.name, cmd.Process.Pid, err))
			p.log.note("exited on its own: %v", err)
		}
		if p.cmd == cmd {
			// Its port is free again: a scrape there would reach whatever took it.
			p.cmd, p.metricsAt = nil, ""
		}
		close(exited)
	}()
}

// pid returns the process id of the current run, 0 when it is not running.
func (p *proc) pid() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.cmd == nil {
		return 0
	}
	return p.cmd.Process.Pid
}

// isStopped reports whether the process was SIGSTOPped and not yet continued.
func (p *proc) isStopped() bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.stopped
}

// running reports whether a run of the process is alive (stopped or not).
func (p *proc) running() bool { return p.pid() != 0 }

// signal sends sig to the current run and returns the channel closed when it exits; expect
// says the process may exit because of it.
func (p *proc) signal(sig syscall.Signal, expect bool) (<-chan struct{}, error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.cmd == nil {
		return nil, fmt.Errorf("%s is not running", p.name)
	}
	if expect {
		p.expecting = true
	}
	switch sig {
	case syscall.SIGSTOP:
		p.stopped = true
	case syscall.SIGCONT:
		p.stopped = false
	}
	p.log.note("%v", sig)
	if err := p.cmd.Process.Signal(sig); err != nil {
		return nil, fmt.Errorf("%s: signal %v: %w", p.name, sig, err)
	}
	return p.exited, nil
}

// kill sends SIGKILL and waits until the process is gone.
func (p *proc) kill() error {
	exited, err := p.signal(syscall.SIGKILL, true)
	if err != nil {
		return err
	}
	select {
	case <-exited:
		return nil
	case <-time.After(30 * time.Second):
		return fmt.Errorf("%s did not exit within 30s of SIGKILL", p.name)
	}
}

// terminate sends SIGTERM and waits, 30s at most, until the process exits; a graceful stop
// must exit 0.
func (p *proc) terminate() error {
	exited, err := p.signal(syscall.SIGTERM, true)
	if err != nil {
		return err
	}
	select {
	case <-exited:
	case <-time.After(30 * time.Second):
		_ = p.kill()
		return fmt.Errorf("%s did not exit within 30s of SIGTERM", p.name)
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.status != nil {
		return fmt.Errorf("%s exited after SIGTERM with %w, want 0", p.name, p.status)
	}
	return nil
}

// takeCrashes returns and forgets the exits the test did not cause.
func (p *proc) takeCrashes() []string {
	p.mu.Lock()
	defer p.mu.Unlock()
	c := p.crashes
	p.crashes = nil
	return c
}

// metric returns the value of the sample named exactly name (with its labels, if any) from
// the current run's /metrics. It fails while the run has not yet logged where it serves them
// (just started, or not running).
func (p *proc) metric(ctx context.Context, name string) (float64, error) {
	if p.metricsAddr == "" {
		return 0, fmt.Errorf("%s serves no metrics", p.name)
	}
	p.mu.Lock()
	addr := p.metricsAt
	p.mu.Unlock()
	if addr == "" {
		return 0, fmt.Errorf("%s: no run that logged where it serves metrics", p.name)
	}
	ctx, cancel := context.WithTimeout(ctx, 2*time.Second)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, "http://"+addr+"/metrics", nil)
	if err != nil {
		return 0, fmt.Errorf("metrics request: %w", err)
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return 0, fmt.Errorf("%s metrics: %w", p.name, err)
	}
	defer func() { _ = resp.Body.Close() }()
	sc := bufio.NewScanner(resp.Body)
	sc.Buffer(make([]byte, 64<<10), 1<<20)
	for sc.Scan() {
		f := strings.Fields(sc.Text())
		if len(f) == 2 && f[0] == name {
			v, err := strconv.ParseFloat(f[1], 64)
			if err != nil {
				return 0, fmt.Errorf("%s metric %s: %w", p.name, name, err)
			}
			return v, nil
		}
	}
	if err := sc.Err(); err != nil {
		return 0, fmt.Errorf("%s metrics: %w", p.name, err)
	}
	return 0, fmt.Errorf("%s has no metric %s", p.name, name)
}

// tail keeps the last bytes written to it (a process's log, across its runs).
type tail struct {
	mu  sync.Mutex
	buf []byte
	max int
}

func newTail(limit int) *tail { return &tail{max: limit} }

func (w *tail) Write(b []byte) (int, error) {
	w.mu.Lock()
	defer w.mu.Unlock()
	w.buf = append(w.buf, b...)
	if over := len(w.buf) - w.max; over > 0 {
		w.buf = append(w.buf[:0], w.buf[over:]...)
	}
	return len(b), nil
}

// lines returns the last n lines.
func (w *tail) lines(n int) string {
	w.mu.Lock()
	defer w.mu.Unlock()
	b := bytes.TrimRight(w.buf, "\n")
	for i := len(b) - 1; i >= 0; i-- {
		if b[i] == '\n' {
			n--
			if n == 0 {
				return string(b[i+1:])
			}
		}
	}
	return string(b)
}

// note writes a line of the test's own into the log, marked as such.
func (w *tail) note(format string, args ...any) {
	_, _ = w.Write([]byte("--- chaos: " + fmt.Sprintf(format, args...) + "\n"))
}
