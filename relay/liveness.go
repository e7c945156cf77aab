package relay

import "time"

// minSilence is the least time the relay waits for an answer to a status update that asked
// for one before it decides that the replication connection is dead.
const minSilence = 10 * time.Second

// silenceBound is how long a replication stream may go without any CopyData after the oldest
// status update that asked for a reply: max(3 × the status interval, 10s).
func silenceBound(statusInterval time.Duration) time.Duration {
	return max(3*statusInterval, minSilence)
}

// liveness decides when a replication stream is dead. Silence alone is no signal: the
// walsender sends a keepalive only after hearing nothing from the client for half of
// wal_sender_timeout, and a relay that reports every second may hear nothing on an idle
// database. So every standby status update asks for a reply (ReplyRequested), which the
// walsender answers at once with a keepalive; the stream is dead when no CopyData at all
// (keepalive or XLogData) arrived within the bound after the oldest request still
// unanswered. It keeps no clock of its own: callers pass the time.
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

// heard records a CopyData message: every request sent before it counts as answered.
func (l *liveness) heard() {
	l.asked = time.Time{}
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
