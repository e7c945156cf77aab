package bench

import (
	"fmt"
	"io"
	"strings"
	"sync"
	"time"
)

// progress tells the person waiting what the run does: on a terminal, one line rewritten in
// place with counts; otherwise one line per phase.
type progress struct {
	w     io.Writer
	tty   bool
	began time.Time

	mu    sync.Mutex
	text  string    // the current phase
	shown int       // the width of the line on screen (tty)
	last  time.Time // the last count shown (tty)
}

func newProgress(w io.Writer, tty bool) *progress {
	return &progress{w: w, tty: tty, began: time.Now()}
}

// phase starts a phase.
func (p *progress) phase(format string, args ...any) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.text = fmt.Sprintf(format, args...)
	line := fmt.Sprintf("[%s] %s", time.Since(p.began).Round(time.Second), p.text)
	if !p.tty {
		_, _ = fmt.Fprintln(p.w, line) // progress only: nothing to do when it fails
		return
	}
	p.show(line)
}

// count shows how far the phase is, on a terminal, at most ten times a second.
func (p *progress) count(n, total int) {
	if !p.tty {
		return
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	if time.Since(p.last) < 100*time.Millisecond {
		return
	}
	p.last = time.Now()
	p.show(fmt.Sprintf("[%s] %s: %s/%s", time.Since(p.began).Round(time.Second), p.text,
		thousands(float64(n)), thousands(float64(total))))
}

// show rewrites the terminal line.
func (p *progress) show(line string) {
	pad := max(0, p.shown-len(line))
	_, _ = fmt.Fprintf(p.w, "\r%s%s", line, strings.Repeat(" ", pad))
	p.shown = len(line)
}

// done clears the terminal line.
func (p *progress) done() {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.tty && p.shown > 0 {
		_, _ = fmt.Fprintf(p.w, "\r%s\r", strings.Repeat(" ", p.shown))
		p.shown = 0
	}
}
