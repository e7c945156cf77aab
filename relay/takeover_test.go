package relay_test

import (
	"bufio"
	"os"
	"os/exec"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// haProcess is `baton relay` as a child process whose log lines the test can wait for.
type haProcess struct {
	cmd    *exec.Cmd
	mu     sync.Mutex
	seen   []string
	exited chan struct{}
}

// startHAProcess runs `baton relay` on dbURL and the test's NATS server until the test ends.
func (b *bundle) startHAProcess(t *testing.T, dbURL string, args ...string) *haProcess {
	t.Helper()
	return b.startAdvProcess(t, dbURL, b.nats.URL(), args...)
}

// startAdvProcess runs `baton relay` on dbURL and natsURL (a proxy in front of either, say)
// until the test ends, collecting its log.
func (b *bundle) startAdvProcess(t *testing.T, dbURL, natsURL string, args ...string) *haProcess {
	t.Helper()
	cmd := exec.Command(batonBinary(t), append([]string{"relay"}, args...)...)
	cmd.Env = append(os.Environ(), "BATON_DATABASE_URL="+dbURL, "BATON_NATS_URL="+natsURL,
		"BATON_SLOT="+b.cfg.Slot, "BATON_LOG_LEVEL=info")
	stderr, err := cmd.StderrPipe()
	require.NoError(t, err)
	require.NoError(t, cmd.Start())
	p := &haProcess{cmd: cmd, exited: make(chan struct{})}
	go func() {
		sc := bufio.NewScanner(stderr)
		sc.Buffer(make([]byte, 64<<10), 1<<20)
		for sc.Scan() {
			p.mu.Lock()
			p.seen = append(p.seen, sc.Text())
			p.mu.Unlock()
		}
		_ = cmd.Wait()
		close(p.exited)
	}()
	t.Cleanup(func() {
		_ = cmd.Process.Signal(syscall.SIGCONT)
		_ = cmd.Process.Kill()
		select {
		case <-p.exited:
		case <-time.After(30 * time.Second):
			t.Error("relay process did not exit after SIGKILL")
		}
		p.mu.Lock()
		defer p.mu.Unlock()
		for _, l := range p.seen {
			if len(l) > 2000 {
				l = l[:2000] + "…"
			}
			t.Logf("pid %d: %s", cmd.Process.Pid, l)
		}
	})
	return p
}

// logged reports whether the process logged a line containing s.
func (p *haProcess) logged(s string) bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	for _, l := range p.seen {
		if strings.Contains(l, s) {
			return true
		}
	}
	return false
}

// The active relay's host vanishes without closing its sockets, behind a path that keeps them
// open (the proxy, frozen: nothing is forwarded, nothing is refused), so the server never
// learns: its walsender keeps the slot until wal_sender_timeout. The standby must take over
// within wal_sender_timeout + 40s, and nothing is lost or doubled.
func TestStandbyTakesOverFromAVanishedHost(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := ctxT(t, 4*time.Minute)
	const walSenderTimeout = 3 * time.Second
	setWalSenderTimeout(t, b, walSenderTimeout)
	convs := conversationIDs(10)
	createConversations(t, b.db.Pool, convs...)
	proxy, viaProxy := proxied(t, b.cfg.DatabaseURL)

	a := b.startHAProcess(t, viaProxy)
	require.Eventually(t, func() bool { return a.logged("msg=streaming") }, time.Minute, 20*time.Millisecond, "relay A never streamed")
	standby := b.startHAProcess(t, b.cfg.DatabaseURL)
	require.Eventually(t, func() bool { return standby.logged("standing by") }, time.Minute, 20*time.Millisecond, "relay B never stood by")
	_, err := send(ctx, b.db.Pool, convs[0], "before")
	require.NoError(t, err)
	b.waitStream(t, "AGENT_TURNS", 1, 30*time.Second)

	proxy.Freeze()
	require.NoError(t, a.cmd.Process.Signal(syscall.SIGSTOP))
	vanished := time.Now()
	t.Cleanup(proxy.Unfreeze)
	for i, c := range convs {
		_, err := send(ctx, b.db.Pool, c, "after-"+string(rune('a'+i)))
		require.NoError(t, err)
	}
	want := truth(t, b.db.Pool)
	within := walSenderTimeout + 10*time.Second + 30*time.Second
	require.Eventually(t, func() bool { return len(b.readStream(t, "AGENT_TURNS")) >= len(want) }, within, 100*time.Millisecond,
		"the standby did not deliver what was committed after the active relay's host vanished")
	t.Logf("standby delivered %v after the host vanished", time.Since(vanished).Round(time.Millisecond))
	require.True(t, standby.logged("msg=streaming"))
	assertExactlyOnceInOrder(t, b.readStream(t, "AGENT_TURNS"), want)
}
