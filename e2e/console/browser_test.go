package console

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/chromedp/chromedp"
	"github.com/stretchr/testify/require"

	"github.com/batonhq/baton/internal/testsvc/browser"
)

// page is a browser tab on the console of one system.
type page struct {
	t   *testing.T
	ctx context.Context
	s   *system
}

// openPage starts a browser for the test and opens path on the console.
func (s *system) openPage(path string) *page {
	s.t.Helper()
	p := &page{t: s.t, ctx: browser.Start(s.t, 2*time.Minute), s: s}
	p.open(path)
	return p
}

// open navigates to path on the console.
func (p *page) open(path string) {
	p.t.Helper()
	require.NoError(p.t, chromedp.Do(p.ctx, chromedp.Navigate(p.s.url(path))), "open %s", path)
}

// eval evaluates a JavaScript expression on the page.
func eval[T any](p *page, js string) (T, error) {
	ctx, cancel := context.WithTimeout(p.ctx, 10*time.Second)
	defer cancel()
	return chromedp.Run(ctx, chromedp.Evaluate[T](js))
}

// await waits until the JavaScript expression cond is true on the page, polling it: the page
// changes by itself (Server-Sent Events), so the test watches instead of sleeping. On timeout
// it fails with what the page showed.
func (p *page) await(cond string, within time.Duration, what string) {
	p.t.Helper()
	deadline := time.Now().Add(within)
	for {
		ok, err := eval[bool](p, "Boolean("+cond+")")
		if err == nil && ok {
			return
		}
		if time.Now().After(deadline) {
			body, _ := eval[string](p, "document.body ? document.body.outerHTML : ''")
			p.t.Fatalf("%s: not within %v (last error %v); the page:\n%s", what, within, err, body[:min(len(body), 8<<10)])
		}
		time.Sleep(25 * time.Millisecond)
	}
}

// click clicks the first element matching the CSS selector.
func (p *page) click(sel string) {
	p.t.Helper()
	ctx, cancel := context.WithTimeout(p.ctx, 20*time.Second)
	defer cancel()
	require.NoError(p.t, chromedp.Do(ctx, chromedp.Click(chromedp.CSS(sel), chromedp.NodeVisible)), "click %s", sel)
}

// attr returns an attribute of the first element matching the CSS selector ("" when none).
func (p *page) attr(sel, name string) string {
	p.t.Helper()
	v, err := eval[string](p, fmt.Sprintf(`(document.querySelector(%q) || {getAttribute: () => ""}).getAttribute(%q) || ""`, sel, name))
	require.NoError(p.t, err)
	return v
}

// text returns the text of the first element matching the CSS selector ("" when none).
func (p *page) text(sel string) string {
	p.t.Helper()
	v, err := eval[string](p, fmt.Sprintf(`(document.querySelector(%q) || {textContent: ""}).textContent`, sel))
	require.NoError(p.t, err)
	return strings.TrimSpace(v)
}

// newConversation creates a conversation from the chat view and returns its id.
func (p *page) newConversation() string {
	p.t.Helper()
	before, err := eval[int](p, `document.querySelectorAll("#conversations [data-conversation]").length`)
	require.NoError(p.t, err)
	p.click("#new-conversation")
	p.await(fmt.Sprintf(`document.querySelectorAll("#conversations [data-conversation]").length > %d`, before), 20*time.Second, "the new conversation listed")
	p.await(`document.querySelector("#composer #message-input")`, 20*time.Second, "the composer")
	id := p.attr("#conversations [data-conversation].selected, #conversations [data-conversation][aria-current]", "data-conversation")
	if id == "" { // not marked: the newest is the last listed
		id, err = eval[string](p, `[...document.querySelectorAll("#conversations [data-conversation]")].pop().getAttribute("data-conversation")`)
		require.NoError(p.t, err)
	}
	require.NotEmpty(p.t, id)
	return id
}

// send types content into the composer, sends it, and returns the message's client id, once
// the page shows it.
func (p *page) send(content string) string {
	p.t.Helper()
	before, err := eval[int](p, `document.querySelectorAll("#messages .msg[data-client-id]").length`)
	require.NoError(p.t, err)
	ctx, cancel := context.WithTimeout(p.ctx, 20*time.Second)
	defer cancel()
	require.NoError(p.t, chromedp.Do(ctx,
		chromedp.SendKeys(chromedp.CSS("#message-input"), content, chromedp.NodeVisible),
		chromedp.Click(chromedp.CSS("#send"), chromedp.NodeVisible),
	))
	p.await(fmt.Sprintf(`document.querySelectorAll("#messages .msg[data-client-id]").length > %d`, before), 10*time.Second, "the sent message shown")
	id, err := eval[string](p, `[...document.querySelectorAll("#messages .msg[data-client-id]")].pop().getAttribute("data-client-id")`)
	require.NoError(p.t, err)
	return id
}

// msg is the CSS selector of the message with client id id.
func msg(id string) string { return fmt.Sprintf(`#messages .msg[data-client-id=%q]`, id) }

// awaitState waits until message id shows state.
func (p *page) awaitState(id, state string, within time.Duration) {
	p.t.Helper()
	p.await(fmt.Sprintf(`(document.querySelector(%q) || {dataset: {}}).dataset.state === %q`, msg(id), state), within,
		fmt.Sprintf("message %s in state %s", id, state))
}

// history returns the states message id has shown, in order.
func (p *page) history(id string) []string {
	p.t.Helper()
	return strings.Fields(p.attr(msg(id), "data-history"))
}

// requireInOrder requires that want appear in got in this order (others may come between).
func requireInOrder(t *testing.T, got, want []string) {
	t.Helper()
	i := 0
	for _, g := range got {
		if i < len(want) && g == want[i] {
			i++
		}
	}
	require.Equal(t, len(want), i, "states %v do not include %v in order", got, want)
}

// TestConsoleChatJourney sends a message from the chat view and sees it go local →
// synchronized → queued → running → replied, pushed by the server; after a reload the page
// shows the same; the message view shows its timeline and the system view the system. It
// takes the README's screenshots of the three views.
func TestConsoleChatJourney(t *testing.T) {
	t.Parallel()
	// The model takes a while, so the turn is seen running.
	s := start(t, options{agentArgs: []string{"--model-latency", "1500ms"}})
	p := s.openPage("/")
	p.await(`document.body.dataset.page === "chat"`, 20*time.Second, "the chat view")
	conv := p.newConversation()
	p.await(`document.querySelector("#conn").dataset.state === "connected"`, 20*time.Second, "connected")

	id := p.send("hello from the browser")
	p.awaitState(id, "running", 30*time.Second)
	p.awaitState(id, "replied", 30*time.Second)
	h := p.history(id)
	require.Equal(t, []string{"local", "synchronized"}, h[:min(2, len(h))], "history %v", h)
	requireInOrder(t, h, []string{"local", "synchronized", "running", "replied"})
	require.NotContains(t, h, "failed")
	require.Contains(t, p.text(msg(id)+" .reply"), "hello from the browser", "the echo agent's reply is shown")
	// A second message, so the picture shows a conversation.
	id2 := p.send("and what state is this one in?")
	p.awaitState(id2, "replied", 30*time.Second)
	browser.Screenshot(p.ctx, t, "console-chat.png")

	// A reload rebuilds the states from the server.
	ctx, cancel := context.WithTimeout(p.ctx, 20*time.Second)
	require.NoError(t, chromedp.Do(ctx, chromedp.Reload()))
	cancel()
	p.await(`document.body.dataset.page === "chat"`, 20*time.Second, "the chat view after the reload")
	if p.attr(msg(id), "data-state") == "" {
		p.click(fmt.Sprintf(`#conversations [data-conversation=%q]`, conv))
	}
	p.awaitState(id, "replied", 20*time.Second)
	p.awaitState(id2, "replied", 20*time.Second)
	require.Contains(t, p.text(msg(id)+" .reply"), "hello from the browser")

	// The message view: the first message's timeline, from the database.
	p.open("/messages/" + id)
	p.await(`document.body.dataset.page === "message"`, 20*time.Second, "the message view")
	p.await(`document.querySelector('#timeline li[data-kind="replied"]')`, 20*time.Second, "the reply in the timeline")
	kinds, err := eval[[]string](p, `[...document.querySelectorAll("#timeline li[data-kind]")].map(e => e.dataset.kind)`)
	require.NoError(t, err)
	requireInOrder(t, kinds, []string{"written", "claimed", "replied"})
	browser.Screenshot(p.ctx, t, "console-message.png")

	// The system view: what `baton status --json` says, and the turns.
	p.open("/system")
	p.await(`document.body.dataset.page === "system"`, 20*time.Second, "the system view")
	p.await(`document.querySelector('#system [data-field="outbox-done"]') && /[1-9]/.test(document.querySelector('#system [data-field="outbox-done"]').textContent)`,
		30*time.Second, "the done outbox rows counted")
	p.await(`document.querySelector('#system [data-field="relay-state"]').textContent.trim() !== ""`, 20*time.Second, "the relay's state")
	p.await(`document.querySelector("svg#chart")`, 20*time.Second, "the chart")
	require.Contains(t, p.text(`#system [data-field="relay-state"]`), "active")
	browser.Screenshot(p.ctx, t, "console-system.png")
}

// TestConsoleFailedTurn: a turn that fails shows failed, with the generic message the worker
// records, never the error behind it.
func TestConsoleFailedTurn(t *testing.T) {
	t.Parallel()
	s := start(t, options{agentArgs: []string{"--fail", "--max-attempts", "1"}})
	p := s.openPage("/")
	p.newConversation()
	id := p.send("this turn fails")
	p.awaitState(id, "failed", 60*time.Second)
	requireInOrder(t, p.history(id), []string{"local", "synchronized", "failed"})
	require.NotContains(t, p.history(id), "replied")
	errText := p.text(msg(id) + " .error")
	require.Contains(t, errText, "could not be completed", "the generic visible error")
	require.NotContains(t, errText, "--fail", "the worker's internal error stays out of the page")
}

// TestConsoleDisconnected stops the console's server while a turn runs: the page shows
// disconnected. The turn finishes meanwhile; once the server is back the page reconnects by
// itself and shows the reply it missed. A message sent while the server was away stays local
// with a retry, also after a reload, and the retry reuses its client message id.
func TestConsoleDisconnected(t *testing.T) {
	t.Parallel()
	s := start(t, options{agentArgs: []string{"--model-latency", "3s"}})
	p := s.openPage("/")
	p.newConversation()
	p.await(`document.querySelector("#conn").dataset.state === "connected"`, 20*time.Second, "connected")
	id := p.send("reply while the console is away")
	p.awaitState(id, "running", 30*time.Second)

	s.stopConsole()
	p.await(`document.querySelector("#conn").dataset.state === "disconnected"`, 20*time.Second, "disconnected shown")
	// The reply commits while the console is away.
	require.Eventually(t, func() bool {
		var n int
		err := s.db.Pool.QueryRow(ctxFor(t, 5*time.Second), `SELECT count(*) FROM agent_outbox WHERE message_id = $1 AND status = 'done'`, id).Scan(&n)
		return err == nil && n == 1
	}, 30*time.Second, 20*time.Millisecond, "the turn never finished")
	require.Equal(t, "running", p.attr(msg(id), "data-state"), "no progress is inferred while disconnected")

	// A send while the server is away stays local, with a retry.
	sent := p.send("sent while the console is away")
	p.await(fmt.Sprintf(`document.querySelector(%q)`, msg(sent)+" .retry"), 20*time.Second, "a retry offered")
	require.Equal(t, "local", p.attr(msg(sent), "data-state"))

	s.restartConsole()
	p.await(`document.querySelector("#conn").dataset.state === "connected"`, 30*time.Second, "reconnected by itself")
	p.awaitState(id, "replied", 20*time.Second)

	// A reload keeps the unsent message: local, with its retry.
	ctx, cancel := context.WithTimeout(p.ctx, 20*time.Second)
	require.NoError(t, chromedp.Do(ctx, chromedp.Reload()))
	cancel()
	p.awaitState(id, "replied", 20*time.Second)
	p.await(fmt.Sprintf(`document.querySelector(%q)`, msg(sent)+" .retry"), 20*time.Second, "the unsent message and its retry after a reload")
	require.Equal(t, "local", p.attr(msg(sent), "data-state"))

	// The retry sends the same client message id: one message, answered once.
	p.click(msg(sent) + " .retry")
	p.awaitState(sent, "replied", 30*time.Second)
	var n int
	require.NoError(t, s.db.Pool.QueryRow(ctxFor(t, 5*time.Second), `SELECT count(*) FROM messages WHERE id = $1`, sent).Scan(&n))
	require.Equal(t, 1, n, "the retried message is stored once")
}
