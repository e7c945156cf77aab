//go:build adversary

// Reproductions of open defects found by adversarial reviews of the relay. They fail on
// purpose and are kept out of the default run; run one with
//
//	go test -tags adversary -run TestAdversary<Name> ./relay/
//
// and move it into the default suite when its fix lands.

package relay_test

import (
	"fmt"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/batonhq/baton/internal/testsvc"
)

// JetStream's Nats-Msg-Id dedup covers a replay only within the duplicate window. A relay
// whose host pauses (SIGSTOP here: a VM pause, a partition) with a publish on the wire loses
// the slot to the standby, which republishes that event and the ones after it. When the
// paused relay comes back after the window, its stale publish reaches JetStream and is
// stored again, after later events of the same conversation: the stream holds the event twice
// and out of order. The window is 2 minutes by default and a takeover alone takes
// wal_sender_timeout (60s) + 10s; the test shortens both (--dup-window 2s).
func TestAdversaryStalePublishAfterTakeoverLandsOutOfOrder(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := ctxT(t, 4*time.Minute)
	const walSenderTimeout = 3 * time.Second
	setWalSenderTimeout(t, b, walSenderTimeout)
	createConversations(t, b.db.Pool, "c")
	natsProxy := testsvc.StartProxy(t, strings.TrimPrefix(b.nats.URL(), "nats://"))
	const window = 2 * time.Second
	a := b.startAdvProcess(t, b.cfg.DatabaseURL, "nats://"+natsProxy.Addr(), "--dup-window", window.String())
	require.Eventually(t, func() bool { return a.logged("msg=streaming") }, time.Minute, 20*time.Millisecond, "relay A never streamed")
	standby := b.startAdvProcess(t, b.cfg.DatabaseURL, b.nats.URL(), "--dup-window", window.String())
	require.Eventually(t, func() bool { return standby.logged("standing by") }, time.Minute, 20*time.Millisecond, "relay B never stood by")

	// A publishes the first event into a path that holds it; the others wait behind it.
	natsProxy.Freeze()
	t.Cleanup(natsProxy.Unfreeze)
	for i := range 3 {
		_, err := send(ctx, b.db.Pool, "c", fmt.Sprintf("m%d", i))
		require.NoError(t, err)
	}
	target := walInsertLSN(t, b)
	require.Eventually(t, func() bool {
		var ok bool
		err := b.db.Pool.QueryRow(ctx, `SELECT coalesce(bool_or(r.sent_lsn >= $1::pg_lsn), false)
			FROM pg_stat_replication r JOIN pg_replication_slots s ON s.active_pid = r.pid
			WHERE s.slot_name = $2`, target.String(), b.cfg.Slot).Scan(&ok)
		return err == nil && ok
	}, 30*time.Second, 20*time.Millisecond, "relay A was never sent the rows")
	require.NoError(t, a.cmd.Process.Signal(syscall.SIGSTOP))

	// B takes over and delivers everything, then one more.
	b.waitStream(t, "AGENT_TURNS", 3, walSenderTimeout+10*time.Second+30*time.Second)
	_, err := send(ctx, b.db.Pool, "c", "m3")
	require.NoError(t, err)
	msgs := b.waitStream(t, "AGENT_TURNS", 4, 30*time.Second)
	last := msgs[len(msgs)-1].stored
	// The dedup window is a time: wait it out (twice, against clock skew between the stamps).
	require.Eventually(t, func() bool { return time.Since(last) > 2*window }, 10*window, 50*time.Millisecond)

	// A comes back; its held publish is delivered.
	natsProxy.Unfreeze()
	require.NoError(t, a.cmd.Process.Signal(syscall.SIGCONT))
	require.Eventually(t, func() bool { return a.logged("relay session ended") }, 30*time.Second, 20*time.Millisecond,
		"relay A never noticed it lost its session")
	// A's publish was written before it paused; once A reconnected anything, the proxy has
	// delivered what it held (one TCP stream). Read the stream after A's next session started.
	require.Eventually(t, func() bool { return a.logged("standing by") }, time.Minute, 20*time.Millisecond,
		"relay A never stood by again")
	assertExactlyOnceInOrder(t, b.readStream(t, "AGENT_TURNS"), truth(t, b.db.Pool))
}
