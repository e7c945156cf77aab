package console

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/chromedp/chromedp"
	"github.com/stretchr/testify/require"

	"github.com/batonhq/baton/internal/testsvc/browser"
)

// TestAttackSixChatTabsBlockSends: the console speaks HTTP/1.1 only, and every chat tab holds
// one connection open for its event stream. A browser opens at most 6 connections to one
// host, so with 6 chat tabs open every other request of the console from that browser waits
// for a free connection that never comes: a message typed in any tab stays local, without an
// error or a retry, and no other page of the console loads. (Fixed: a tab closes its stream
// for its send and reopens it after, and a hidden tab holds no stream.)
func TestAttackSixChatTabsBlockSends(t *testing.T) {
	t.Parallel()
	e := setup(t, Config{}, false)
	e.createConversation(t, "tabs")
	bctx := browser.Start(t, 2*time.Minute)
	url := e.base + "/#tabs"

	tabs := []context.Context{bctx}
	for range 5 {
		tctx, cancel := chromedp.NewContext(bctx)
		t.Cleanup(cancel)
		tabs = append(tabs, tctx)
	}
	for i, tctx := range tabs {
		ctx, cancel := context.WithTimeout(tctx, waitFor)
		require.NoError(t, chromedp.Do(ctx, chromedp.Navigate(url)), "open tab %d", i)
		cancel()
	}
	require.Eventually(t, func() bool { return e.srv.streams.Load() == int64(len(tabs)) }, waitFor, 10*time.Millisecond,
		"every tab's stream open")

	// Send from the first tab, as a user does.
	ctx, cancel := context.WithTimeout(bctx, waitFor)
	defer cancel()
	submitted, err := chromedp.Run(ctx, chromedp.Evaluate[bool](`(() => {
		const input = document.getElementById("message-input");
		if (input.disabled) return false;
		input.value = "hello from a busy browser";
		document.getElementById("composer").requestSubmit();
		return true;
	})()`))
	require.NoError(t, err)
	require.True(t, submitted, "the composer is enabled")
	deadline := time.Now().Add(waitFor)
	state := ""
	for time.Now().Before(deadline) {
		got, err := chromedp.Run(ctx, chromedp.Evaluate[string](
			`(document.querySelector("#messages .msg") || {dataset: {}}).dataset.state || ""`))
		require.NoError(t, err)
		state = got
		if state != "" && state != "local" {
			break
		}
		time.Sleep(50 * time.Millisecond)
	}
	require.NotEqual(t, "local", state, fmt.Sprintf("the message stayed local for %s with %d chat tabs open", waitFor, len(tabs)))
	// And the tab's stream came back: the server's state of the message (no worker runs here:
	// queued) reaches the page.
	for time.Now().Before(deadline) && state != "queued" {
		state, err = chromedp.Run(ctx, chromedp.Evaluate[string](`document.querySelector("#messages .msg").dataset.state`))
		require.NoError(t, err)
		time.Sleep(50 * time.Millisecond)
	}
	require.Equal(t, "queued", state, "the stream reopened after the send")
}

// TestHiddenTabHoldsNoStream: a chat tab that is hidden (a background tab) closes its event
// stream, so that background tabs do not use up the browser's 6 connections to the console;
// shown again, it reopens the stream and shows the states that changed meanwhile.
func TestHiddenTabHoldsNoStream(t *testing.T) {
	t.Parallel()
	e := setup(t, Config{}, false)
	e.createConversation(t, "bg")
	e.send(t, "bg", "m1", "hello")
	ctx := e.openPage(t, "bg")
	state := func() string {
		s, err := chromedp.Run(ctx, chromedp.Evaluate[string](`(document.querySelector('#messages .msg[data-client-id="m1"]') || {dataset: {}}).dataset.state || ""`))
		require.NoError(t, err)
		return s
	}
	require.Eventually(t, func() bool { return e.srv.streams.Load() == 1 && state() == "queued" }, waitFor, 20*time.Millisecond)

	// The page hears that it is hidden, as a browser tells a tab sent to the background.
	visibility := func(hidden bool) {
		_, err := chromedp.Run(ctx, chromedp.Evaluate[bool](fmt.Sprintf(`(() => {
			Object.defineProperty(document, "hidden", {value: %t, configurable: true});
			document.dispatchEvent(new Event("visibilitychange"));
			return true;
		})()`, hidden)))
		require.NoError(t, err)
	}
	visibility(true)
	require.Eventually(t, func() bool { return e.srv.streams.Load() == 0 }, waitFor, 10*time.Millisecond, "the hidden tab closed its stream")

	// Meanwhile a worker claims the message; shown again, the tab has the new state.
	w := worker{t: t, e: e, conv: "bg", msgID: "m1", runID: "00000000-0000-4000-8000-0000000000b1", worker: "w1"}
	w.claim()
	visibility(false)
	require.Eventually(t, func() bool { return e.srv.streams.Load() == 1 && state() == "running" }, waitFor, 20*time.Millisecond,
		"the tab shown again reopened its stream and shows running")
}

// TestStreamReopenIsNotADisconnect: the server ends each stream after MaxStreamAge and the
// browser reconnects; the page must not show that as a lost connection, and it keeps
// following the conversation on the new stream.
func TestStreamReopenIsNotADisconnect(t *testing.T) {
	t.Parallel()
	e := setup(t, Config{MaxStreamAge: 300 * time.Millisecond}, false)
	e.createConversation(t, "re")
	e.send(t, "re", "m1", "hello")
	ctx := e.openPage(t, "re")
	require.Eventually(t, func() bool { return e.srv.streams.Load() == 1 }, waitFor, 5*time.Millisecond)
	// Record every state the indicator shows from now on.
	_, err := chromedp.Run(ctx, chromedp.Evaluate[bool](`(() => {
		const c = document.getElementById("conn");
		window.connStates = [c.dataset.state];
		new MutationObserver(() => window.connStates.push(c.dataset.state)).observe(c, {attributes: true});
		return true;
	})()`))
	require.NoError(t, err)
	// Two reopens: the stream count drops to 0 and comes back, twice.
	for range 2 {
		require.Eventually(t, func() bool { return e.srv.streams.Load() == 0 }, waitFor, time.Millisecond, "the stream ended")
		require.Eventually(t, func() bool { return e.srv.streams.Load() == 1 }, waitFor, time.Millisecond, "the page reconnected")
	}
	w := worker{t: t, e: e, conv: "re", msgID: "m1", runID: "00000000-0000-4000-8000-0000000000c1", worker: "w1"}
	w.claim()
	require.Eventually(t, func() bool {
		s, err := chromedp.Run(ctx, chromedp.Evaluate[string](`document.querySelector('#messages .msg[data-client-id="m1"]').dataset.state`))
		return err == nil && s == "running"
	}, waitFor, 20*time.Millisecond, "the page follows the conversation on the new stream")
	states, err := chromedp.Run(ctx, chromedp.Evaluate[[]string](`window.connStates`))
	require.NoError(t, err)
	require.NotContains(t, states, "disconnected", "a reopen was shown as a lost connection: %v", states)
}

// openPage opens the console's page of conversation conv in a browser of the test's own,
// and returns the page's context, bounded by 2*waitFor.
func (e *testEnv) openPage(t *testing.T, conv string) context.Context {
	t.Helper()
	ctx, cancel := context.WithTimeout(browser.Start(t, 2*time.Minute), 2*waitFor)
	t.Cleanup(cancel)
	require.NoError(t, chromedp.Do(ctx, chromedp.Navigate(e.base+"/#"+conv)))
	return ctx
}
