package demo

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"golang.org/x/sync/errgroup"

	"github.com/batonhq/baton/producer"
)

// createConversations creates the run's conversations; Ctrl-C (ctx) or a failed relay or
// worker (abort) stops it.
func (d *Demo) createConversations(ctx, abort context.Context, pool *pgxpool.Pool, prod *producer.Producer) error {
	cctx, cancel := context.WithCancel(abort)
	defer cancel()
	defer context.AfterFunc(ctx, cancel)()
	g, gctx := errgroup.WithContext(cctx)
	g.SetLimit(Senders)
	for i := range d.cfg.Conversations {
		g.Go(func() error {
			_, err := prod.CreateConversation(gctx, pool, d.convID(i))
			return err
		})
	}
	if err := g.Wait(); err != nil {
		return fmt.Errorf("create conversations: %w", err)
	}
	return nil
}

// send sends the messages at the configured rate until all are sent or ctx ends (Ctrl-C). A
// Send in progress when ctx ends is finished, not canceled, so every message is either
// accepted (with its outbox id known) or not sent. abort ends the sending when the relay or a
// worker failed.
func (d *Demo) send(ctx, abort context.Context, pool *pgxpool.Pool, prod *producer.Producer) error {
	g, sctx := errgroup.WithContext(abort)
	jobs := make(chan int)
	g.Go(func() error {
		defer close(jobs)
		start := time.Now()
		timer := time.NewTimer(0)
		defer timer.Stop()
		for i := range d.cfg.Messages {
			if d.cfg.Rate > 0 {
				due := start.Add(time.Duration(float64(i) / d.cfg.Rate * float64(time.Second)))
				if wait := time.Until(due); wait > 0 {
					timer.Reset(wait)
					select {
					case <-timer.C:
					case <-ctx.Done():
						return nil
					case <-sctx.Done():
						return nil
					}
				}
			}
			select {
			case jobs <- i:
			case <-ctx.Done():
				return nil
			case <-sctx.Done():
				return nil
			}
		}
		return nil
	})
	for range min(Senders, d.cfg.Messages) {
		g.Go(func() error {
			for i := range jobs {
				if err := d.sendOne(sctx, pool, prod, i); err != nil {
					return err
				}
			}
			return nil
		})
	}
	return g.Wait()
}

// sendOne sends message i and, for every retryEvery-th message, sends it again with the same
// id, as a client that timed out would.
func (d *Demo) sendOne(ctx context.Context, pool *pgxpool.Pool, prod *producer.Producer, i int) error {
	msg := producer.Message{
		ConversationID: d.convID(i % d.cfg.Conversations),
		ID:             d.msgID(i),
		Content:        fmt.Sprintf("demo message %d: hello, agent", i),
	}
	first, err := sendWithRetry(ctx, pool, prod, msg, d.cfg.Logger)
	if err != nil {
		return err
	}
	d.ledger.sent(first.OutboxID, time.Now())
	if i%retryEvery != retryEvery-1 {
		return nil
	}
	again, err := sendWithRetry(ctx, pool, prod, msg, d.cfg.Logger)
	if err != nil {
		return err
	}
	ok := again.AlreadyAccepted && again.OutboxID == first.OutboxID
	if !ok {
		d.cfg.Logger.Error("retry with the same id was not recognised as a duplicate", "message_id", msg.ID,
			"outbox_id", first.OutboxID, "retry_outbox_id", again.OutboxID, "already_accepted", again.AlreadyAccepted)
	}
	d.ledger.retried(ok)
	return nil
}

// sendWithRetry calls Send until it succeeds, a few times at most. Retrying with the same
// message is always safe: Send is idempotent by message id, so a send whose reply was lost
// comes back as AlreadyAccepted.
func sendWithRetry(ctx context.Context, pool *pgxpool.Pool, prod *producer.Producer, msg producer.Message,
	log *slog.Logger) (producer.Result, error) {
	const attempts = 5
	backoff := 100 * time.Millisecond
	for attempt := 1; ; attempt++ {
		res, err := prod.Send(ctx, pool, msg)
		if err == nil {
			return res, nil
		}
		if attempt == attempts || ctx.Err() != nil || errors.Is(err, producer.ErrInvalidInput) ||
			errors.Is(err, producer.ErrConflict) || errors.Is(err, producer.ErrConversationNotFound) {
			return res, err
		}
		log.Warn("send failed; retrying with the same id", "message_id", msg.ID, "error", err, "retry_in", backoff)
		select {
		case <-time.After(backoff):
		case <-ctx.Done():
			return res, err
		}
		backoff *= 2
	}
}
