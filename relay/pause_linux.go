package relay

import (
	"crypto/tls"
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
// unread bytes, or nil when conn is not TCP (a Unix socket's poll ignores SO_RCVLOWAT).
//
// The wait sets SO_RCVLOWAT to lowat, so that the kernel neither wakes a poller nor reports
// the socket readable below it, waits in ppoll, and sets it back to 1 before returning: the
// connection's other reads, through Go's poller, must wake on any byte, or a stream that
// stopped short of lowat would wait until the read deadline. It runs on the descriptor
// through RawConn.Read, so the descriptor cannot be closed meanwhile; a read deadline that
// passed skips it. Through TLS it waits on the TCP socket under it: the count is of
// encrypted bytes, which only makes the wait a little shorter.
func socketWaiter(conn net.Conn, lowat int) func(d time.Duration) {
	if c, ok := conn.(*tls.Conn); ok {
		conn = c.NetConn()
	}
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
			if unix.SetsockoptInt(s, unix.SOL_SOCKET, unix.SO_RCVLOWAT, lowat) != nil {
				pause(d)
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
