package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"slices"
	"strings"

	"github.com/batonhq/baton/consumer"
	"github.com/batonhq/baton/examples/echo"
)

// This file holds echoagent's test hooks: flags that tests (consumer/process_test.go, e2e/)
// run the binary with to steer a turn. A copy of echoagent can drop this file and the two
// lines of run that use hooks.

// hooks are the test hooks' settings.
type hooks struct {
	writeTool bool   // --write-tool: call the side-effecting notify tool in every turn
	fail      bool   // --fail: fail every turn
	pauseAt   string // --pause-at: hold every turn at this point (one of echo.Points)
}

func (h *hooks) bindFlags(fs *flag.FlagSet) {
	fs.BoolVar(&h.writeTool, "write-tool", false, "call the side-effecting notify tool in every turn")
	fs.BoolVar(&h.fail, "fail", false, "fail every turn (test hook)")
	fs.StringVar(&h.pauseAt, "pause-at", "", "hold every turn at `point`: "+strings.Join(echo.Points, ", ")+" (test hook)")
}

// check validates the parsed flags. Pausing during or after the write tool implies --write-tool.
func (h *hooks) check() error {
	if h.pauseAt != "" && !slices.Contains(echo.Points, h.pauseAt) {
		return fmt.Errorf("--pause-at must be one of %s", strings.Join(echo.Points, ", "))
	}
	h.writeTool = h.writeTool || h.pauseAt == echo.PointDuringWrite || h.pauseAt == echo.PointAfterWrite
	return nil
}

// apply sets the agent's write tool and, when --fail or --pause-at asks for it, its hook.
func (h *hooks) apply(a *echo.Agent) {
	a.WriteTool = a.WriteTool || h.writeTool
	if h.fail || h.pauseAt != "" {
		a.Hook = h.hook
	}
}

// hook is the agent's hook under --fail and --pause-at. --fail fails every turn at its first
// point, before the model call. --pause-at, at the chosen point, prints "PAUSED <point>
// <run_id> <conversation_id>" and holds the turn until ctx ends, then returns ctx's error, as a
// call cancelled mid-flight would. os.Stdout is unbuffered, so the line is out before the turn
// blocks.
func (h *hooks) hook(ctx context.Context, point string, t *consumer.Turn) error {
	if h.fail && point == echo.PointModel {
		return errors.New("echoagent runs with --fail")
	}
	if h.pauseAt != point {
		return nil
	}
	fmt.Printf("PAUSED %s %s %s\n", point, t.RunID, t.ConversationID)
	<-ctx.Done()
	return ctx.Err()
}
