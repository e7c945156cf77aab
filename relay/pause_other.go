//go:build !linux

package relay

import "time"

// pause waits for d; off Linux with time.Sleep, which may wait longer (see pause_linux.go).
func pause(d time.Duration) { time.Sleep(d) }
