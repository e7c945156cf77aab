package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"slices"
	"strings"

	"github.com/batonhq/baton/consumer"
)

// This file holds echoagent's test hooks: flags that tests (consumer/process_test.go, e2e/)
// run the binary with to steer a turn. A copy of echoagent can drop this file and the uses of
// agent.hooks in agent.handle.

// pausePoints are the values of --pause-at, in the order a turn reaches them.
var pausePoints = []string{"model", "after-read", "during-write", "after-write", "before-commit"}

// hooks are the test hooks' settings.
type hooks struct {
	writeTool bool   // --write-tool: call the side-effecting notify tool in every turn
	fail      bool   // --fail: fail every turn
	pauseAt   string // --pause-at: hold every turn at this point
}

func (h *hooks) bindFlags(fs *flag.FlagSet) {
	fs.BoolVar(&h.writeTool, "write-tool", false, "call the side-effecting notify tool in every turn")
	fs.BoolVar(&h.fail, "fail", false, "fail every turn (test hook)")
	fs.StringVar(&h.pauseAt, "pause-at", "", "hold every turn at `point`: "+strings.Join(pausePoints, ", ")+" (test hook)")
}

// check validates the parsed flags. Pausing during or after the write tool implies --write-tool.
func (h *hooks) check() error {
	if h.pauseAt != "" && !slices.Contains(pausePoints, h.pauseAt) {
		return fmt.Errorf("--pause-at must be one of %s", strings.Join(pausePoints, ", "))
	}
	h.writeTool = h.writeTool || h.pauseAt == "during-write" || h.pauseAt == "after-write"
	return nil
}

// failure is the error every turn fails with under --fail, nil otherwise.
func (h *hooks) failure() error {
	if h.fail {
		return errors.New("echoagent runs with --fail")
	}
	return nil
}

// pause is the --pause-at hook: at the chosen point it prints "PAUSED <point> <run_id>
// <conversation_id>" and holds the turn until ctx ends, then returns ctx's error, as a call
// cancelled mid-flight would. os.Stdout is unbuffered, so the line is out before the turn
// blocks. Elsewhere it returns nil at once.
func (h *hooks) pause(ctx context.Context, point string, t *consumer.Turn) error {
	if h.pauseAt != point {
		return nil
	}
	fmt.Printf("PAUSED %s %s %s\n", point, t.RunID, t.ConversationID)
	<-ctx.Done()
	return ctx.Err()
}
