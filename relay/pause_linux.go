package relay

import (
	"net"
	"time"

	"golang.org/x/sys/unix"
)

// pause blocks the calling thread for d with nanosleep: precise to some microseconds, where
// time.Sleep parks the goroutine until the runtime's next timer check, a millisecond or more
// on an otherwise idle process.
func pause(d time.Duration) {
	ts := unix.NsecToTimespec(d.Nanoseconds())
	_ = unix.Nanosleep(&ts, nil)
}

// socketWaiter returns a function that waits at most d for conn's TCP socket to hold lowat
// unread bytes, or nil when conn is not plain TCP: a Unix socket's poll ignores SO_RCVLOWAT,
// and through TLS the socket's count says nothing of what the relay can read. A TLS read
// returns one record, 16 KiB at most, so every read would be small, and the TLS layer
// empties the socket into its own buffer as it goes, so the socket would rarely reach
// lowat: every read would wait the whole bound, and a walsender flushing message by message
// would be read a message per wait.
//
// The wait sets SO_RCVLOWAT to lowat, so that the kernel neither wakes a poller nor reports
// the socket readable below it, waits in ppoll, and sets it back to 1 before returning: the
// connection's other reads, through Go's poller, must wake on any byte, or a stream that
// stopped short of lowat would wait until the read deadline. It runs on the descriptor
// through RawConn.Read, so the descriptor cannot be closed meanwhile; a read deadline that
// passed skips it.
func socketWaiter(conn net.Conn, lowat int) func(d time.Duration) {
	tcp, ok := conn.(*net.TCPConn)
	if !ok {
		return nil
	}
	raw, err := tcp.SyscallConn()
	if err != nil {
		return nil
	}
	return func(d time.Duration) {
		_ = raw.Read(func(fd uintptr) bool {
			s := int(fd)
			// Raising the mark past what the receive buffer holds at a quarter (the kernel
			// shrinks it under memory pressure) would grow the buffer and clamp the TCP window
			// to lowat for good (tcp_set_rcvlowat): a cap on a long link. Sleep instead.
			if rcvbuf, err := unix.GetsockoptInt(s, unix.SOL_SOCKET, unix.SO_RCVBUF); err != nil || rcvbuf < 4*lowat ||
				unix.SetsockoptInt(s, unix.SOL_SOCKET, unix.SO_RCVLOWAT, lowat) != nil {
				pause(min(d, bulkPauseShortest))
				return true
			}
			fds := []unix.PollFd{{Fd: int32(s), Events: unix.POLLIN}} //nolint:gosec // G115: a descriptor fits an int32
			ts := unix.NsecToTimespec(d.Nanoseconds())
			_, _ = unix.Ppoll(fds, &ts, nil) // EINTR (a signal) only ends the wait early
			_ = unix.SetsockoptInt(s, unix.SOL_SOCKET, unix.SO_RCVLOWAT, 1)
			return true
		})
	}
}
