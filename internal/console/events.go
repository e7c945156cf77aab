package console

import (
	"context"
	"encoding/json"
	"net/http"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
)

// Event stream timings.
const (
	// keepaliveEvery is how often an idle stream gets a comment line, so that a dead client is
	// noticed by a failing write and a proxy does not close the stream.
	keepaliveEvery = 15 * time.Second
	// writeTimeout bounds one write to a stream: a client that stops reading is dropped.
	writeTimeout = 10 * time.Second
)

// messagesEvent is the data of an event of type "messages": the views of the messages that
// changed since the last event (all of them in the first one, with full set).
type messagesEvent struct {
	ConversationID string        `json:"conversation_id"`
	Full           bool          `json:"full"`
	Messages       []MessageView `json:"messages"`
}

// handleEvents streams a conversation's message states as Server-Sent Events: first every
// message (full), then each message whose view changed. It reads the rows every PollInterval
// and at once when the conversation's outcome is published (Run) or a message is sent through
// this console; after the first read, each reads the contents of only the messages that are
// new or changed (readConversation). The stream ends with its request's context: the client
// leaving, or Serve stopping, which also ends a write blocked on a client that stopped reading.
//
// A client (an IP address) holds at most MaxStreamsPerClient streams and all of them at most
// MaxStreams; a stream beyond either is refused with 503.
//
// Each read is bounded by StreamReadTimeout, so a database that stops answering never holds a
// stream; a failed read is retried at the next poll. A stream logs one warning when its reads
// start failing and one info line when they work again, not one per poll: 64 streams polling
// every 250 ms through an outage would bury the log.
func (s *Server) handleEvents(w http.ResponseWriter, r *http.Request) {
	client := streamClient(r)
	if refused := s.takeStream(client); refused != "" {
		writeError(w, http.StatusServiceUnavailable, refused)
		return
	}
	defer s.releaseStream(client)
	checkCtx, cancelCheck := context.WithTimeoutCause(r.Context(), s.cfg.RequestTimeout, errDatabaseTimeout)
	conv, ok := s.conversationFromPath(w, r.WithContext(checkCtx))
	cancelCheck()
	if !ok {
		return
	}
	ctx := r.Context()
	rc := http.NewResponseController(w)
	wake, unwatch := s.watch(conv)
	defer unwatch()
	// A write to a client that stopped reading blocks until writeTimeout; when the stream's
	// context ends (the client left, Serve stops) the write must end at once, or Shutdown waits
	// for it. Setting a past deadline from another goroutine is safe (net.Conn's methods are),
	// and write sets its own deadline before it checks ctx: a deadline set by write after this
	// one is followed by that check, which then fails, so it never undoes this one.
	stopUnblock := context.AfterFunc(ctx, func() { _ = rc.SetWriteDeadline(time.Now()) })
	defer stopUnblock()

	w.Header().Set("Content-Type", "text/event-stream")
	w.Header().Set("Cache-Control", "no-store")
	w.Header().Set("X-Accel-Buffering", "no")
	w.WriteHeader(http.StatusOK)
	write := func(payload []byte) bool {
		_ = rc.SetWriteDeadline(time.Now().Add(writeTimeout))
		if ctx.Err() != nil {
			return false
		}
		if _, err := w.Write(payload); err != nil {
			return false
		}
		return rc.Flush() == nil
	}
	// The browser's EventSource reconnects after this long when the stream breaks.
	if !write([]byte("retry: 1000\n\n")) {
		return
	}

	poll := time.NewTicker(s.cfg.PollInterval)
	defer poll.Stop()
	keepalive := time.NewTicker(keepaliveEvery)
	defer keepalive.Stop()
	expire := time.NewTimer(s.cfg.MaxStreamAge) // see Config.MaxStreamAge
	defer expire.Stop()
	var last map[string]MessageView
	var cache rowCache // nil until the first read
	failing := false   // the last read failed; logged once per outage, not once per poll
	for {
		readCtx, cancelRead := context.WithTimeout(ctx, s.cfg.StreamReadTimeout)
		rows, next, err := readConversation(readCtx, s.cfg.Pool, conv, cache)
		cancelRead()
		if err != nil {
			if ctx.Err() != nil {
				return
			}
			// The database is away or too slow: say nothing new, try again at the next poll.
			if !failing {
				s.log.Warn("console: a stream cannot read its conversation; retrying every poll",
					"conversation_id", conv, "error", err)
				failing = true
			}
		} else {
			if failing {
				s.log.Info("console: a stream reads its conversation again", "conversation_id", conv)
				failing = false
			}
			cache = next
			diff, idx := changed(last, views(rows))
			if last == nil || len(diff) > 0 {
				ev := messagesEvent{ConversationID: conv, Full: last == nil, Messages: diff}
				if ev.Messages == nil {
					ev.Messages = []MessageView{}
				}
				data, err := json.Marshal(ev)
				if err != nil {
					s.log.Error("console: encode event", "error", err)
					return
				}
				if !write([]byte("event: messages\ndata: " + string(data) + "\n\n")) {
					return
				}
				keepalive.Reset(keepaliveEvery)
			}
			last = idx
		}
		select {
		case <-ctx.Done():
			return
		case <-poll.C:
		case <-wake:
		case <-keepalive.C:
			if !write([]byte(": keepalive\n\n")) {
				return
			}
		case <-expire.C:
			// Said first, so the page does not show the reconnect as a lost connection; the
			// browser reconnects after the retry time above.
			write([]byte("event: reopen\ndata: {}\n\n"))
			return
		}
	}
}

// readConversation reads a stream's conversation: with no cache (the stream's first read)
// every row with its contents, as GET .../messages does; then the rows without contents
// (messageVersionsSQL: no message's content is read), and the contents of only those the
// cache does not hold (messagesByIDSQL; none while nothing changed). It returns the rows, as
// a read of everything would, and the cache for the next read.
func readConversation(ctx context.Context, db *pgxpool.Pool, conv string, cache rowCache) ([]messageRow, rowCache, error) {
	if cache == nil {
		rows, err := conversationMessages(ctx, db, conv)
		if err != nil {
			return nil, nil, err
		}
		return rows, newRowCache(rows), nil
	}
	probed, err := conversationVersions(ctx, db, conv)
	if err != nil {
		return nil, nil, err
	}
	var read []messageRow
	if ids := cache.missing(probed); len(ids) > 0 {
		if read, err = messagesByID(ctx, db, conv, ids); err != nil {
			return nil, nil, err
		}
	}
	rows, next := cache.complete(probed, read)
	return rows, next, nil
}
