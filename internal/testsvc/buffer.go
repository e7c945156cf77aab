package testsvc

import (
	"bytes"
	"sync"
)

// Buffer collects what a process or a logger writes, for the test to read while it writes:
// a bytes.Buffer behind a mutex. The zero value is ready to use.
type Buffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

// Write appends p.
func (b *Buffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.b.Write(p)
}

// String returns everything written so far.
func (b *Buffer) String() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.b.String()
}

// Tail returns the last n bytes written (all of them when fewer), for failure reports.
func (b *Buffer) Tail(n int) string {
	b.mu.Lock()
	defer b.mu.Unlock()
	out := b.b.Bytes()
	if len(out) > n {
		out = out[len(out)-n:]
	}
	return string(out)
}
