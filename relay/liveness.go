package relay

import "time"

// silenceBound is how long a replication stream may go without any byte after the oldest
// status update that asked for a reply, before the relay looks at its walsender (see
// walsenderBusy): max(3 × the status interval, minSilence).
func silenceBound(statusInterval, minSilence time.Duration) time.Duration {
	return max(3*statusInterval, minSilence)
}

// liveness decides when a replication stream is dead. Silence alone is no signal: the
// walsender sends a keepalive only after hearing nothing from the client for half of
// wal_sender_timeout, and a relay that reports every second may hear nothing on an idle
// database. So every standby status update asks for a reply (ReplyRequested), which the
// walsender answers at once with a keepalive; the stream is silent when no byte at all arrived
// within the bound after the oldest request still unanswered. Silent is not yet dead: a
// walsender decoding a large transaction answers nobody (it reads replies only every
// wal_sender_timeout/2), which the reader tells apart from a dead path by looking at the
// walsender from its other connection (walsenderBusy). It keeps no clock of its own: callers
// pass the time.
type liveness struct {
	bound time.Duration
	asked time.Time // the oldest status update sent since the last CopyData; zero when none
}

// requested records a status update that asked for a reply, sent at now.
func (l *liveness) requested(now time.Time) {
	if l.asked.IsZero() {
		l.asked = now
	}
}

// heard records bytes from the walsender: every request sent before them counts as answered.
func (l *liveness) heard() {
	l.asked = time.Time{}
}

// waitedOn records that at now the walsender was seen busy: the next look is a bound later.
func (l *liveness) waitedOn(now time.Time) {
	l.asked = now
}

// dead reports whether, at now, the oldest unanswered request is older than the bound. Call
// it only when a read found nothing to read: a reader that was busy elsewhere (waiting for
// room in the pipeline) may have answers waiting in the socket.
func (l *liveness) dead(now time.Time) (bool, time.Duration) {
	if l.asked.IsZero() {
		return false, 0
	}
	waited := now.Sub(l.asked)
	return waited > l.bound, waited
}
