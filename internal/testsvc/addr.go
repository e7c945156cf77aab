package testsvc

import (
	"net"
	"strconv"
	"syscall"
	"testing"
)

// RefusingAddr returns a 127.0.0.1 address on which nothing listens, for the test's whole
// life: a socket of the test holds the port, bound and never listening, so that connecting
// there is refused at once, as to a server that is down, and no other process can bind the
// port meanwhile nor get it from the system for port 0 or a connection. A port picked and
// released instead may become a parallel test's listener, which would accept.
func RefusingAddr(t testing.TB) string {
	t.Helper()
	return holdAddr(t, false)
}

// ReservedAddr returns a 127.0.0.1 address that a process of the test may bind, on each of its
// starts, and that no other process gets meanwhile, for the test's whole life: for a server
// that must come back at the same address after a restart (a page reconnecting to the
// console at its origin).
//
// A socket of the test holds the port: bound with SO_REUSEADDR and never listening. On Linux
// a socket that binds the very address with SO_REUSEADDR too (Go's listeners set it) may bind
// and listen beside it, while no socket without SO_REUSEADDR may bind it, and the system gives
// it to no bind of port 0 while a port without any socket is free, nor to a connection. While
// the server is down, connecting there is refused.
func ReservedAddr(t testing.TB) string {
	t.Helper()
	return holdAddr(t, true)
}

func holdAddr(t testing.TB, reuse bool) string {
	t.Helper()
	// Close-on-exec under ForkLock, as the net package does: children must not inherit it.
	syscall.ForkLock.RLock()
	fd, err := syscall.Socket(syscall.AF_INET, syscall.SOCK_STREAM, syscall.IPPROTO_TCP)
	if err == nil {
		syscall.CloseOnExec(fd)
	}
	syscall.ForkLock.RUnlock()
	if err != nil {
		t.Fatalf("hold an address: socket: %v", err)
	}
	t.Cleanup(func() { _ = syscall.Close(fd) })
	if reuse {
		if err := syscall.SetsockoptInt(fd, syscall.SOL_SOCKET, syscall.SO_REUSEADDR, 1); err != nil {
			t.Fatalf("hold an address: SO_REUSEADDR: %v", err)
		}
	}
	if err := syscall.Bind(fd, &syscall.SockaddrInet4{Addr: [4]byte{127, 0, 0, 1}}); err != nil {
		t.Fatalf("hold an address: bind: %v", err)
	}
	sa, err := syscall.Getsockname(fd)
	if err != nil {
		t.Fatalf("hold an address: getsockname: %v", err)
	}
	in4, ok := sa.(*syscall.SockaddrInet4)
	if !ok {
		t.Fatalf("hold an address: getsockname gave %T", sa)
	}
	return net.JoinHostPort("127.0.0.1", strconv.Itoa(in4.Port))
}
