package bench

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"math"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"
)

// streamingLine is what `baton relay` (and the plain relay) log, in the text format, once
// START_REPLICATION succeeded.
const streamingLine = "msg=streaming"

// process is a relay running as a child process: `baton relay`, or the plain relay.
type process struct {
	name        string
	cmd         *exec.Cmd
	startedAt   time.Time
	streamingAt time.Time     // set before streaming is closed
	streaming   chan struct{} // closed when the process logs that it streams
	exited      chan struct{} // closed when it exited and its stderr was read

	mu   sync.Mutex
	tail []string // its last log lines, for errors
}

// startProcess starts argv with env (which replaces every BATON_* variable of this process's
// environment) and follows its log on stderr. Its stdout is discarded. The caller must call
// stop on every path; when ctx ends first, the process gets SIGTERM, and SIGKILL stopGrace
// later.
func startProcess(ctx context.Context, name string, argv, env []string) (*process, error) {
	if len(argv) == 0 {
		return nil, fmt.Errorf("%s: no command to run", name)
	}
	cmd := exec.CommandContext(ctx, argv[0], argv[1:]...) //nolint:gosec // G204: the baton binary the caller chose
	cmd.Cancel = func() error { return cmd.Process.Signal(syscall.SIGTERM) }
	cmd.WaitDelay = stopGrace
	cmd.Env = childEnv(os.Environ(), env)
	// The child dies with this process, even when this one is killed.
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	stderr, err := cmd.StderrPipe()
	if err != nil {
		return nil, fmt.Errorf("%s: %w", name, err)
	}
	p := &process{name: name, cmd: cmd, streaming: make(chan struct{}), exited: make(chan struct{})}
	p.startedAt = time.Now()
	if err := cmd.Start(); err != nil {
		return nil, fmt.Errorf("start %s (%s): %w", name, argv[0], err)
	}
	go func() {
		defer close(p.exited)
		sc := bufio.NewScanner(stderr)
		sc.Buffer(make([]byte, 64<<10), 1<<20)
		seen := false
		for sc.Scan() {
			line := sc.Text()
			if !seen && strings.Contains(line, streamingLine) {
				seen = true
				p.streamingAt = time.Now()
				close(p.streaming)
			}
			p.mu.Lock()
			p.tail = append(p.tail, line)
			if len(p.tail) > 20 {
				p.tail = p.tail[1:]
			}
			p.mu.Unlock()
		}
		_ = cmd.Wait() // the exit status shows in the log tail
	}()
	return p, nil
}

// childEnv returns base without its BATON_* variables, followed by set: a child sees only the
// settings the bench chose, never the caller's BATON_METRICS_ADDR or BATON_SCHEMA.
func childEnv(base, set []string) []string {
	env := make([]string, 0, len(base)+len(set))
	for _, kv := range base {
		if !strings.HasPrefix(kv, "BATON_") {
			env = append(env, kv)
		}
	}
	return append(env, set...)
}

// waitStreaming waits until the process logs that it streams, for at most within.
func (p *process) waitStreaming(ctx context.Context, within time.Duration) error {
	t := time.NewTimer(within)
	defer t.Stop()
	select {
	case <-p.streaming:
		return nil
	case <-p.exited:
		return fmt.Errorf("%s exited before streaming: %s", p.name, p.logTail())
	case <-t.C:
		return fmt.Errorf("%s did not stream within %v: %s", p.name, within, p.logTail())
	case <-ctx.Done():
		return ctx.Err()
	}
}

// alive returns an error when the process has exited.
func (p *process) alive() error {
	select {
	case <-p.exited:
		return fmt.Errorf("%s exited: %s", p.name, p.logTail())
	default:
		return nil
	}
}

func (p *process) logTail() string {
	p.mu.Lock()
	defer p.mu.Unlock()
	if len(p.tail) == 0 {
		return "(no log)"
	}
	return strings.Join(p.tail, "\n")
}

// stop asks the process to stop (SIGTERM: the relay drains and confirms) and waits for it,
// killing it after grace. It does nothing once the process has exited.
func (p *process) stop(grace time.Duration) {
	select {
	case <-p.exited:
		return
	default:
	}
	_ = p.cmd.Process.Signal(syscall.SIGTERM)
	t := time.NewTimer(grace)
	defer t.Stop()
	select {
	case <-p.exited:
	case <-t.C:
		_ = p.cmd.Process.Kill()
		<-p.exited
	}
}

// pid returns the process id.
func (p *process) pid() int { return p.cmd.Process.Pid }

// peakRSS returns the VmHWM of process pid: its peak resident set, in bytes.
func peakRSS(pid int) (int64, error) {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		return 0, fmt.Errorf("peak RSS: %w", err)
	}
	for line := range strings.SplitSeq(string(b), "\n") {
		if rest, ok := strings.CutPrefix(line, "VmHWM:"); ok {
			kb, err := strconv.ParseInt(strings.TrimSpace(strings.TrimSuffix(strings.TrimSpace(rest), "kB")), 10, 64)
			if err != nil {
				return 0, fmt.Errorf("peak RSS: VmHWM %q: %w", rest, err)
			}
			return kb << 10, nil
		}
	}
	return 0, errors.New("peak RSS: no VmHWM in /proc status")
}

// clockTicks is the kernel's USER_HZ, the unit of /proc/<pid>/stat's times: 100 on every
// Linux architecture Go supports.
const clockTicks = 100

// cpuSeconds returns the user+system CPU time process pid used so far, or NaN when it cannot
// be read (the process is gone, or not on this machine).
func cpuSeconds(pid int) float64 {
	if pid <= 0 {
		return math.NaN()
	}
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return math.NaN()
	}
	return parseStatCPU(string(b))
}

// parseStatCPU returns utime+stime, in seconds, of a /proc/<pid>/stat line, or NaN.
func parseStatCPU(stat string) float64 {
	// The command name (field 2) may hold spaces and parentheses: fields follow its last ')'.
	i := strings.LastIndexByte(stat, ')')
	if i < 0 {
		return math.NaN()
	}
	f := strings.Fields(stat[i+1:])
	if len(f) < 13 {
		return math.NaN()
	}
	utime, err1 := strconv.ParseFloat(f[11], 64)
	stime, err2 := strconv.ParseFloat(f[12], 64)
	if err1 != nil || err2 != nil {
		return math.NaN()
	}
	return (utime + stime) / clockTicks
}
