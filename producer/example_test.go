package producer_test

import (
	"context"
	"errors"
	"fmt"
	"log"
	"os"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/batonhq/baton/producer"
)

// An HTTP handler for "post a chat message" would do this: the client's request id is the
// message id, so a client that retries after a timeout cannot start a second turn.
func Example() {
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, os.Getenv("BATON_DATABASE_URL"))
	if err != nil {
		log.Fatal(err)
	}
	defer pool.Close()

	p, err := producer.New(producer.Config{}) // 1 MiB content limit, no logging
	if err != nil {
		log.Fatal(err)
	}
	if _, err := p.CreateConversation(ctx, pool, "support-42"); err != nil {
		log.Fatal(err)
	}

	res, err := p.Send(ctx, pool, producer.Message{
		ConversationID: "support-42",
		ID:             "req-8f14e45f", // from the client, reused on retries
		Content:        "Where is my order?",
	})
	switch {
	case errors.Is(err, producer.ErrInvalidInput): // 400 Bad Request
		log.Print(err)
	case errors.Is(err, producer.ErrConversationNotFound): // 404 Not Found
		log.Print(err)
	case errors.Is(err, producer.ErrConflict): // 409: the request id was used for another message
		log.Print(err)
	case err != nil: // 503: unknown whether it committed; the client retries with the same id
		log.Print(err)
	case res.AlreadyAccepted: // a retry: 200 with the original outbox id
		fmt.Println("already accepted as outbox row", res.OutboxID)
	default: // 202 Accepted
		fmt.Println("accepted as outbox row", res.OutboxID)
	}
}

// SendTx commits the message together with the application's own state.
func ExampleProducer_SendTx() {
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, os.Getenv("BATON_DATABASE_URL"))
	if err != nil {
		log.Fatal(err)
	}
	defer pool.Close()
	p, err := producer.New(producer.Config{})
	if err != nil {
		log.Fatal(err)
	}

	err = pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		if _, err := p.CreateConversationTx(ctx, tx, "ticket-7"); err != nil {
			return err
		}
		if _, err := tx.Exec(ctx, `UPDATE tickets SET state = 'waiting_for_agent' WHERE id = 7`); err != nil {
			return err
		}
		_, err := p.SendTx(ctx, tx, producer.Message{
			ConversationID: "ticket-7",
			ID:             "ticket-7-opened",
			Content:        "Summarise this ticket for the on-call engineer.",
		})
		return err // an error rolls back the ticket update and the message together
	})
	if err != nil {
		log.Fatal(err)
	}
}
