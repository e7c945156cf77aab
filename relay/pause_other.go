//go:build !linux

package relay

import (
	"net"
	"time"
)

// pause waits for d; off Linux with time.Sleep, which may wait longer (see pause_linux.go).
func pause(d time.Duration) { time.Sleep(d) }

// socketWaiter returns nil off Linux: the waits between small reads are plain pauses.
func socketWaiter(net.Conn, int) func(time.Duration) { return nil }
