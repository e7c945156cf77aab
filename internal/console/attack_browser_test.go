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
// error or a retry, and no other page of the console loads.
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
}
