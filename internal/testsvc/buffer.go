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

// LineWriter calls Line with every complete line written to it, without its newline: a
// process's stdout read line by line as it writes. It is not safe for concurrent writers,
// which an exec.Cmd's copier never is.
type LineWriter struct {
	Line func(string)
	buf  []byte
}

// Write buffers p and calls Line for each line it completes.
func (w *LineWriter) Write(p []byte) (int, error) {
	w.buf = append(w.buf, p...)
	for {
		i := bytes.IndexByte(w.buf, '\n')
		if i < 0 {
			return len(p), nil
		}
		w.Line(string(w.buf[:i]))
		w.buf = w.buf[i+1:]
	}
}
