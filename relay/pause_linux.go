package relay

import (
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
