package producer_test

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/batonhq/baton/internal/testsvc"
	"github.com/batonhq/baton/producer"
)

// An HTTP handler for "post a chat message" would do this: the client's request id is the
// message id, so a client that retries after a timeout cannot start a second turn. Each error
// a caller branches on maps to a status code.
func Example() {
	databaseURL, cleanup := exampleDatabase() // a migrated Baton database, for this example
	defer cleanup()

	ctx := context.Background()
	pool, err := pgxpool.New(ctx, databaseURL)
	if err != nil {
		fmt.Println(err)
		return
	}
	defer pool.Close()

	p, err := producer.New(producer.Config{}) // 1 MiB content limit, no logging
	if err != nil {
		fmt.Println(err)
		return
	}
	if _, err := p.CreateConversation(ctx, pool, "support-42"); err != nil {
		fmt.Println(err)
		return
	}

	post := func(conversationID, requestID, content string) string {
		res, err := p.Send(ctx, pool, producer.Message{
			ConversationID: conversationID,
			ID:             requestID, // from the client, reused on retries
			Content:        content,
		})
		var input *producer.InputError
		switch {
		case errors.As(err, &input): // errors.Is(err, producer.ErrInvalidInput) holds too
			return "400 Bad Request: " + input.Field + " " + input.Reason
		case errors.Is(err, producer.ErrConversationNotFound):
			return "404 Not Found"
		case errors.Is(err, producer.ErrConflict): // the request id was used for another message
			return "409 Conflict"
		case err != nil: // unknown whether it committed: the client retries with the same id
			return "503 Service Unavailable"
		case res.AlreadyAccepted: // a retry: nothing new was written
			return "200 OK"
		default: // written: a turn will answer it
			return "202 Accepted"
		}
	}
	fmt.Println(post("support-42", "req-8f14e45f", "Where is my order?"))
	fmt.Println(post("support-42", "req-8f14e45f", "Where is my order?")) // the client's retry
	fmt.Println(post("support-42", "req-8f14e45f", "Cancel my order."))   // the same id, other text
	fmt.Println(post("support-43", "req-c9f0f895", "Hello?"))             // no such conversation
	fmt.Println(post("support-42", "req-45c48cce", ""))
	fmt.Println(post("support-42", "baton:reply:1", "Hi"))
	// Output:
	// 202 Accepted
	// 200 OK
	// 409 Conflict
	// 404 Not Found
	// 400 Bad Request: Content is empty
	// 400 Bad Request: ID starts with "baton:" (in any letter case), a prefix reserved for Baton's own messages
}

// Send is idempotent by message id: sending the same message again, as a client retrying
// after a timeout does, writes nothing and reports the outbox row of the first send.
func ExampleProducer_Send() {
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
	// Send never creates a conversation; CreateConversation does, once.
	created, err := p.CreateConversation(ctx, pool, "conv-42")
	if err != nil {
		fmt.Println(err)
		return
	}
	fmt.Println("conversation created:", created)

	msg := producer.Message{
		ConversationID: "conv-42",
		ID:             "req-1", // the client's request id
		Content:        "What changed in the Q3 numbers?",
	}
	first, err := p.Send(ctx, pool, msg)
	if err != nil {
		fmt.Println(err)
		return
	}
	fmt.Println("first send, already accepted:", first.AlreadyAccepted)

	retry, err := p.Send(ctx, pool, msg) // the same message again
	if err != nil {
		fmt.Println(err)
		return
	}
	fmt.Println("retry, already accepted:", retry.AlreadyAccepted)
	fmt.Println("same outbox row:", retry.OutboxID == first.OutboxID)

	// Another message in a missing conversation writes nothing.
	_, err = p.Send(ctx, pool, producer.Message{ConversationID: "conv-43", ID: "req-2", Content: "Hello?"})
	fmt.Println(errors.Is(err, producer.ErrConversationNotFound))
	fmt.Println(err)
	// Output:
	// conversation created: true
	// first send, already accepted: false
	// retry, already accepted: true
	// same outbox row: true
	// true
	// send message "req-2" to conversation "conv-43": producer: conversation not found
}

// SendTx writes the message inside the caller's transaction, so it commits together with the
// application's own state, or not at all.
func ExampleProducer_SendTx() {
	databaseURL, cleanup := exampleDatabase() // a migrated Baton database with a tickets table
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

	// The ticket's new state and the request to the agent commit together.
	err = pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		if _, err := tx.Exec(ctx, `UPDATE tickets SET state = 'waiting_for_agent' WHERE id = 7`); err != nil {
			return err
		}
		if _, err := p.CreateConversationTx(ctx, tx, "ticket-7"); err != nil {
			return err
		}
		_, err := p.SendTx(ctx, tx, producer.Message{
			ConversationID: "ticket-7",
			ID:             "ticket-7-opened",
			Content:        "Summarise this ticket for the on-call engineer.",
		})
		return err
	})
	if err != nil {
		fmt.Println(err)
		return
	}

	// An error rolls back the ticket update and the message together: no turn starts.
	err = pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		if _, err := tx.Exec(ctx, `UPDATE tickets SET state = 'escalated' WHERE id = 7`); err != nil {
			return err
		}
		if _, err := p.SendTx(ctx, tx, producer.Message{
			ConversationID: "ticket-7",
			ID:             "ticket-7-escalated",
			Content:        "Draft a note to the customer about the escalation.",
		}); err != nil {
			return err
		}
		return errors.New("escalation refused: no on-call engineer") // the application's own check
	})
	fmt.Println(err)

	var state string
	if err := pool.QueryRow(ctx, `SELECT state FROM tickets WHERE id = 7`).Scan(&state); err != nil {
		fmt.Println(err)
		return
	}
	rows, err := pool.Query(ctx, `SELECT id FROM messages WHERE conversation_id = 'ticket-7' ORDER BY created_at`)
	if err != nil {
		fmt.Println(err)
		return
	}
	ids, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		fmt.Println(err)
		return
	}
	fmt.Println("ticket 7:", state)
	fmt.Println("messages of ticket-7:", ids)
	// Output:
	// escalation refused: no on-call engineer
	// ticket 7: waiting_for_agent
	// messages of ticket-7: [ticket-7-opened]
}

// exampleDatabase is the examples' plumbing, standing in for the application's own database:
// a fresh database of the test cluster, migrated to Baton's schema (what `baton migrate` does),
// with the application table ExampleProducer_SendTx writes to. cleanup drops it.
func exampleDatabase() (url string, cleanup func()) {
	url, cleanup, err := testsvc.ExampleDatabase()
	if err != nil {
		panic(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	conn, err := pgx.Connect(ctx, url)
	if err != nil {
		cleanup()
		panic(err)
	}
	defer func() { _ = conn.Close(ctx) }()
	if _, err := conn.Exec(ctx, `CREATE TABLE tickets (id bigint PRIMARY KEY, state text NOT NULL);
		INSERT INTO tickets VALUES (7, 'open')`); err != nil {
		cleanup()
		panic(err)
	}
	return url, cleanup
}
