package consumer_test

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/batonhq/baton/consumer"
	"github.com/batonhq/baton/internal/testsvc"
	"github.com/batonhq/baton/producer"
)

// A worker without NATS (Config.NATS nil) polls agent_outbox. It runs one turn for the user
// message the application sent, and commits the handler's reply to the messages table.
func ExampleWorker() {
	databaseURL, cleanup := exampleDatabase() // a migrated Baton database, for this example
	defer cleanup()

	ctx := context.Background()
	pool, err := pgxpool.New(ctx, databaseURL)
	if err != nil {
		fmt.Println(err)
		return
	}
	defer pool.Close()

	// The application's side: a conversation and a user message (package producer).
	p, err := producer.New(producer.Config{})
	if err != nil {
		fmt.Println(err)
		return
	}
	if _, err := p.CreateConversation(ctx, pool, "conv-42"); err != nil {
		fmt.Println(err)
		return
	}
	if _, err := p.Send(ctx, pool, producer.Message{ConversationID: "conv-42", ID: "req-1", Content: "Hello, Baton"}); err != nil {
		fmt.Println(err)
		return
	}

	// The worker's side.
	w, err := consumer.New(consumer.Config{
		Pool: pool,
		NATS: nil, // poll agent_outbox every PollInterval (250ms) instead of consuming the relay's stream
		Handler: func(_ context.Context, t *consumer.Turn) (consumer.Reply, error) {
			var said []string
			for _, m := range t.Messages { // the user messages this turn answers, in order
				said = append(said, m.Content)
			}
			fmt.Printf("turn in %s, attempt %d: %q\n", t.ConversationID, t.Attempt, said)
			return consumer.Reply{Content: "You said: " + strings.Join(said, " / ")}, nil
		},
	})
	if err != nil {
		fmt.Println(err)
		return
	}
	runCtx, stop := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- w.Run(runCtx) }() // until runCtx ends

	// Without NATS, the application reads the answer to its message from Postgres: the outbox
	// row's reply_id names it once the turn has committed.
	role, content, err := waitForAnswer(ctx, pool, "req-1")
	stop() // Run returns once running turns have finished (within ShutdownGrace)
	if runErr := <-done; runErr != nil {
		fmt.Println(runErr)
	}
	if err != nil {
		fmt.Println(err)
		return
	}
	fmt.Printf("%s: %s\n", role, content)
	// Output:
	// turn in conv-42, attempt 1: ["Hello, Baton"]
	// assistant: You said: Hello, Baton
}

// Every tool call of a turn goes through Turn.Tool with its effect declared: the call is
// recorded in the operations table before it runs, and finished with its output. A Read tool
// only looks, so a turn that called it may be replayed; after a Write tool, a failed turn
// ends as a visible error instead.
func ExampleTurn_Tool() {
	databaseURL, cleanup := exampleDatabase() // a migrated Baton database, for this example
	defer cleanup()

	ctx := context.Background()
	pool, err := pgxpool.New(ctx, databaseURL)
	if err != nil {
		fmt.Println(err)
		return
	}
	defer pool.Close()
	p, err := producer.New(producer.Config{})
	if err != nil {
		fmt.Println(err)
		return
	}
	if _, err := p.CreateConversation(ctx, pool, "order-A17"); err != nil {
		fmt.Println(err)
		return
	}
	if _, err := p.Send(ctx, pool, producer.Message{ConversationID: "order-A17", ID: "req-1", Content: "Where is my order?"}); err != nil {
		fmt.Println(err)
		return
	}

	// lookUpOrder stands in for the application's own read-only service call.
	lookUpOrder := func(_ context.Context, id string) (map[string]string, error) {
		return map[string]string{"order": id, "status": "shipped"}, nil
	}
	w, err := consumer.New(consumer.Config{
		Pool: pool,
		Handler: func(_ context.Context, t *consumer.Turn) (consumer.Reply, error) {
			out, err := t.Tool(ctx, "order_status", consumer.Read, map[string]string{"order": "A17"},
				func(ctx context.Context) (any, error) { return lookUpOrder(ctx, "A17") })
			if err != nil { // errors.Is(err, consumer.ErrToolFailed) when lookUpOrder failed
				return consumer.Reply{}, err // this attempt fails: retried after a backoff, up to MaxAttempts
			}
			order, ok := out.(map[string]string) // Tool returns what the function returned
			if !ok {
				return consumer.Reply{}, errors.New("order_status: unexpected output")
			}
			return consumer.Reply{Content: "Your order " + order["order"] + " has " + order["status"] + "."}, nil
		},
	})
	if err != nil {
		fmt.Println(err)
		return
	}
	runCtx, stop := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- w.Run(runCtx) }()
	_, reply, err := waitForAnswer(ctx, pool, "req-1")
	stop()
	if runErr := <-done; runErr != nil {
		fmt.Println(runErr)
	}
	if err != nil {
		fmt.Println(err)
		return
	}
	fmt.Println(reply)

	// The operation, as recorded; the final commit attached it to the reply.
	var tool, effect, status, input, output string
	err = pool.QueryRow(ctx, `SELECT o.tool, o.effect, o.status, o.input::text, o.output::text
		FROM operations o JOIN agent_outbox x ON x.reply_id = o.message_id
		WHERE x.message_id = 'req-1'`).Scan(&tool, &effect, &status, &input, &output)
	if err != nil {
		fmt.Println(err)
		return
	}
	fmt.Println(tool, effect, status, input, output)
	// Output:
	// Your order A17 has shipped.
	// order_status read done {"order": "A17"} {"order": "A17", "status": "shipped"}
}

// waitForAnswer waits, up to ten seconds, for the reply to the user message messageID and
// returns its role ("assistant", or "error" for a request that failed for good) and content.
// A service with NATS would subscribe to the outcomes stream instead (wire.OutcomeSubscriber).
func waitForAnswer(ctx context.Context, pool *pgxpool.Pool, messageID string) (role, content string, err error) {
	ctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	for {
		err := pool.QueryRow(ctx, `SELECT m.role, m.content
			FROM agent_outbox x JOIN messages m ON m.id = x.reply_id
			WHERE x.message_id = $1`, messageID).Scan(&role, &content)
		if !errors.Is(err, pgx.ErrNoRows) {
			return role, content, err
		}
		select {
		case <-ctx.Done():
			return "", "", fmt.Errorf("no answer to %s: %w", messageID, ctx.Err())
		case <-time.After(20 * time.Millisecond):
		}
	}
}

// exampleDatabase is the examples' plumbing, standing in for the application's database: a
// fresh database of the test cluster, migrated to Baton's schema (what `baton migrate` does).
// cleanup drops it.
func exampleDatabase() (url string, cleanup func()) {
	url, cleanup, err := testsvc.ExampleDatabase()
	if err != nil {
		panic(err)
	}
	return url, cleanup
}
