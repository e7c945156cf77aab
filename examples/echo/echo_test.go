package echo_test

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/batonhq/baton/consumer"
	"github.com/batonhq/baton/examples/echo"
	"github.com/batonhq/baton/internal/testsvc"
	"github.com/batonhq/baton/producer"
)

func TestMain(m *testing.M) { os.Exit(testsvc.MainNoLeaks(m)) }

// runAgent runs a polling worker with a's handler on a fresh database until the test ends,
// sends "hello" to conversation c1, and returns the database once the turn ended in a reply
// or an error message.
func runAgent(t *testing.T, a *echo.Agent, maxAttempts int) *testsvc.Database {
	t.Helper()
	db := testsvc.NewDatabase(t)
	w, err := consumer.New(consumer.Config{Pool: db.RolePool(t, testsvc.RoleWorker), Handler: a.Handle, MaxAttempts: maxAttempts,
		PollInterval: 10 * time.Millisecond, Logger: slog.New(slog.NewTextHandler(io.Discard, nil))})
	require.NoError(t, err)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- w.Run(ctx) }()
	t.Cleanup(func() {
		cancel()
		select {
		case err := <-done:
			require.NoError(t, err)
		case <-time.After(30 * time.Second):
			t.Error("worker did not stop within 30s")
		}
	})

	prod, err := producer.New(producer.Config{})
	require.NoError(t, err)
	sctx, scancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer scancel()
	_, err = prod.CreateConversation(sctx, db.Pool, "c1")
	require.NoError(t, err)
	_, err = prod.Send(sctx, db.Pool, producer.Message{ConversationID: "c1", ID: "m1", Content: "hello"})
	require.NoError(t, err)
	require.Eventually(t, func() bool {
		return len(testsvc.Query[string](t, db, `SELECT id FROM messages WHERE role <> 'user'`)) > 0
	}, time.Minute, 10*time.Millisecond, "the turn never ended")
	return db
}

// recordPoints returns a hook that records the points a turn reaches and fails at failAt.
func recordPoints(failAt string) (hook func(context.Context, string, *consumer.Turn) error, points func() []string) {
	var mu sync.Mutex
	var got []string
	hook = func(_ context.Context, point string, _ *consumer.Turn) error {
		mu.Lock()
		defer mu.Unlock()
		got = append(got, point)
		if point == failAt {
			return errors.New("failed at " + point)
		}
		return nil
	}
	return hook, func() []string {
		mu.Lock()
		defer mu.Unlock()
		return slices.Clone(got)
	}
}

func TestAgentEchoesThroughEveryPointAndTool(t *testing.T) {
	t.Parallel()
	hook, points := recordPoints("")
	db := runAgent(t, &echo.Agent{WriteTool: true, Hook: hook}, 0)
	require.Equal(t, []string{"assistant: echo: hello"},
		testsvc.Query[string](t, db, `SELECT role || ': ' || content FROM messages WHERE role <> 'user'`))
	require.Equal(t, echo.Points, points())
	require.Equal(t, []string{"lookup read done", "notify write done"},
		testsvc.Query[string](t, db, `SELECT tool || ' ' || effect || ' ' || status FROM operations ORDER BY id`))
}

// A hook that fails ends the turn there: after the read tool, the request fails visibly once
// its attempts are spent, as the demo's failing conversations do.
func TestAgentHookErrorFailsTheTurn(t *testing.T) {
	t.Parallel()
	hook, points := recordPoints(echo.PointAfterRead)
	db := runAgent(t, &echo.Agent{Hook: hook}, 1)
	require.Equal(t, []string{"error"}, testsvc.Query[string](t, db, `SELECT role FROM messages WHERE role <> 'user'`))
	require.Equal(t, []string{echo.PointModel, echo.PointAfterRead}, points())
	require.Equal(t, []string{"lookup read done"},
		testsvc.Query[string](t, db, `SELECT tool || ' ' || effect || ' ' || status FROM operations ORDER BY id`))
}

func ExampleReply() {
	fmt.Println(echo.Reply([]consumer.Message{{Content: "hi"}, {Content: "are you there?"}}))
	// Output: echo: hi | are you there?
}
