package e2e

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/batonhq/baton/producer"
)

// The load: producers send at a steady rate over many conversations, each conversation owned
// by one producer, so its messages are sent one after another.
const (
	producers       = 4
	messagesPerSec  = 40
	plainConvs      = 120
	sendRetryPause  = 100 * time.Millisecond
	sendCallTimeout = 10 * time.Second
)

// hostileConversations are conversation ids that a subject, a header or a log line could
// mistake for something else: NATS wildcards and separators, spaces, control characters,
// the subject encoding's own marker, non-ASCII, and the longest ids allowed (200 bytes).
var hostileConversations = []string{
	"a.b", "*", ">", "a.*.>", "$SYS.x", "$JS.API.STREAM.DELETE.AGENT_TURNS", "has space", " lead",
	"tab\tid", "new\nline", "~tilde", "日本語の会話", "emoji-🙂", `quote"'` + "`", `slash/back\`,
	"percent%2e", "nbsp\u00a0x", strings.Repeat("long-", 40), strings.Repeat("é", 100),
}

// accepted is a message Send accepted.
type accepted struct {
	id, conversation, content string
}

// load is the producers' run.
type load struct {
	stop     chan struct{}
	wg       sync.WaitGroup
	mu       sync.Mutex
	accepted []accepted
	retries  atomic.Int64
	again    atomic.Int64 // retries that found their message already accepted
	failures []string     // sends that can never succeed (a conflict): a defect
}

// conversations returns every conversation id of the run.
func conversations() []string {
	convs := make([]string, 0, plainConvs+len(hostileConversations))
	for i := range plainConvs {
		convs = append(convs, fmt.Sprintf("c%03d", i))
	}
	return append(convs, hostileConversations...)
}

// startLoad creates the conversations and starts the producers; stop them with finish.
func (s *system) startLoad(ctx context.Context) *load {
	t := s.t
	t.Helper()
	p, err := producer.New(producer.Config{})
	if err != nil {
		t.Fatalf("producer: %v", err)
	}
	convs := conversations()
	for _, c := range convs {
		if _, err := p.CreateConversation(ctx, s.app, c); err != nil {
			t.Fatalf("create conversation %q: %v", c, err)
		}
	}
	l := &load{stop: make(chan struct{})}
	var seq atomic.Int64
	hostile := map[string]bool{}
	for _, c := range hostileConversations {
		hostile[c] = true
	}
	for g := range producers {
		var mine []string
		for i, c := range convs {
			if i%producers == g {
				mine = append(mine, c)
			}
		}
		l.wg.Go(func() {
			tick := time.NewTicker(producers * time.Second / messagesPerSec)
			defer tick.Stop()
			for i := 0; ; i++ {
				select {
				case <-l.stop:
					return
				case <-ctx.Done():
					return
				case <-tick.C:
				}
				c := mine[i%len(mine)]
				n := seq.Add(1)
				m := producer.Message{ConversationID: c, ID: fmt.Sprintf("m%d", n), Content: fmt.Sprintf("msg %d", n)}
				if hostile[c] {
					m.ID = fmt.Sprintf("h.%d.*> $ü", n) // hostile message ids too
				}
				if l.send(ctx, p, s, m) {
					l.mu.Lock()
					l.accepted = append(l.accepted, accepted{m.ID, c, m.Content})
					l.mu.Unlock()
				}
			}
		})
	}
	return l
}

// send sends m until it is accepted (the same id each time: a retry of a message that did
// commit is accepted as a duplicate) or ctx ends. Faults make sends fail; stopping the load
// does not abandon a message under way.
func (l *load) send(ctx context.Context, p *producer.Producer, s *system, m producer.Message) bool {
	for {
		cctx, cancel := context.WithTimeout(ctx, sendCallTimeout)
		res, err := p.Send(cctx, s.app, m)
		cancel()
		switch {
		case err == nil:
			if res.AlreadyAccepted {
				l.again.Add(1) // an earlier try committed, its answer lost
			}
			return true
		case errors.Is(err, producer.ErrConflict), errors.Is(err, producer.ErrInvalidInput),
			errors.Is(err, producer.ErrConversationNotFound):
			l.mu.Lock()
			l.failures = append(l.failures, fmt.Sprintf("send %q to %q: %v", m.ID, m.ConversationID, err))
			l.mu.Unlock()
			return false
		}
		l.retries.Add(1)
		select {
		case <-ctx.Done():
			return false
		case <-time.After(sendRetryPause):
		}
	}
}

// finish stops the producers and waits until the messages under way are accepted.
func (l *load) finish() []accepted {
	close(l.stop)
	l.wg.Wait()
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.accepted
}
