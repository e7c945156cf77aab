package relay

import (
	"net"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"
)

// tcpPair returns both ends of a loopback TCP connection.
func tcpPair(t *testing.T) (client *net.TCPConn, server net.Conn) {
	t.Helper()
	ln, err := (&net.ListenConfig{}).Listen(t.Context(), "tcp", "127.0.0.1:0")
	require.NoError(t, err)
	defer func() { _ = ln.Close() }()
	accepted := make(chan net.Conn, 1)
	go func() {
		c, _ := ln.Accept()
		accepted <- c
	}()
	c, err := (&net.Dialer{}).DialContext(t.Context(), "tcp", ln.Addr().String())
	require.NoError(t, err)
	t.Cleanup(func() { _ = c.Close() })
	select {
	case server = <-accepted:
	case <-time.After(10 * time.Second):
		t.Fatal("no connection accepted")
	}
	require.NotNil(t, server)
	t.Cleanup(func() { _ = server.Close() })
	return c.(*net.TCPConn), server
}

// unread returns how many bytes c's socket holds unread.
func unread(t *testing.T, c *net.TCPConn) int {
	t.Helper()
	raw, err := c.SyscallConn()
	require.NoError(t, err)
	var n int
	require.NoError(t, raw.Control(func(fd uintptr) { n, err = unix.IoctlGetInt(int(fd), unix.SIOCINQ) }))
	require.NoError(t, err)
	return n
}

// rcvlowat returns c's socket's SO_RCVLOWAT.
func rcvlowat(t *testing.T, c *net.TCPConn) int {
	t.Helper()
	raw, err := c.SyscallConn()
	require.NoError(t, err)
	var n int
	require.NoError(t, raw.Control(func(fd uintptr) { n, err = unix.GetsockoptInt(int(fd), unix.SOL_SOCKET, unix.SO_RCVLOWAT) }))
	require.NoError(t, err)
	return n
}

// The wait between small reads ends once the socket holds lowat bytes, not at the first byte
// and not at its bound; and afterwards the connection's reads wake on any byte again.
func TestSocketWaiterWaitsForLowatBytesOnly(t *testing.T) {
	client, server := tcpPair(t)
	const lowat = 32 << 10
	wait := socketWaiter(client, lowat)
	require.NotNil(t, wait, "a TCP connection gets a socket wait")

	// A walsender sending message by message: 1 KiB every millisecond, 48 KiB in all.
	wrote := make(chan error, 1)
	go func() {
		chunk := make([]byte, 1<<10)
		for range 48 {
			if _, err := server.Write(chunk); err != nil {
				wrote <- err
				return
			}
			time.Sleep(time.Millisecond)
		}
		wrote <- nil
	}()
	start := time.Now()
	wait(time.Minute)
	require.Less(t, time.Since(start), 30*time.Second, "the wait ended at its bound, not when lowat bytes arrived")
	require.GreaterOrEqual(t, unread(t, client), lowat, "the wait ended before the socket held lowat bytes")
	require.NoError(t, <-wrote)

	// Afterwards the connection's reads, through Go's poller, wake on any byte again, as on
	// any connection: the wait put the socket's low water mark back.
	require.Equal(t, 1, rcvlowat(t, client), "the low water mark stayed raised: a read would wait for lowat bytes")
	buf := make([]byte, 64<<10)
	for got := 0; got < 48<<10; {
		n, err := client.Read(buf)
		require.NoError(t, err)
		got += n
	}

	// Fewer than lowat bytes that stay fewer: the wait ends at its bound.
	_, err := server.Write([]byte("tail"))
	require.NoError(t, err)
	require.Eventually(t, func() bool { return unread(t, client) == 4 }, 10*time.Second, time.Millisecond)
	done := make(chan struct{})
	go func() {
		wait(20 * time.Millisecond)
		close(done)
	}()
	select {
	case <-done:
	case <-time.After(30 * time.Second):
		t.Fatal("the wait did not end at its bound")
	}
	require.Equal(t, 4, unread(t, client))
}

// Where the wait cannot end early (a Unix socket: its poll ignores the low water mark) it is
// a plain sleep, kept at the shortest; on TCP it may last up to the longest.
func TestWaitOnBoundsTheSleepWhereItCannotEndEarly(t *testing.T) {
	a, b := net.Pipe()
	defer func() { _, _ = a.Close(), b.Close() }()
	require.Nil(t, socketWaiter(a, bulkLittle), "a connection that is not TCP gets no socket wait")
	f := newCutFrames(a, 1<<20)
	f.waitOn(a)
	require.Equal(t, bulkPauseShortest, f.longest)
	client, _ := tcpPair(t)
	f.waitOn(client)
	require.Equal(t, bulkPauseLongest, f.longest)
}
