package demo

import (
	"context"
	"fmt"
	"strconv"
	"strings"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/batonhq/baton/producer"
	"github.com/batonhq/baton/wire"
)

// Relay is what Run asks the relay that publishes the run's events.
type Relay interface {
	// Active reports whether the relay streams from its slot.
	Active() bool
	// Ready reports whether the relay streams or stands by while another relay streams.
	Ready() bool
}

// Services are what Run talks to. The caller starts them and stops them after Run returned.
type Services struct {
	Relay    Relay
	NATS     *nats.Conn
	Pool     *pgxpool.Pool // at least Senders+2 connections
	Producer *producer.Producer
	// StopWorkers tells the workers to stop and returns once they did. Run calls it after the
	// wait for the outcomes, while the relay still runs, so that outcomes committed during the
	// workers' shutdown grace still reach the stream.
	StopWorkers func()
}

// Run waits for the relay, subscribes to the turns and outcomes streams, sends the messages,
// waits for their outcomes, stops the workers and reads the run's rows back. It reports its
// steps and a progress line to Config.Out. Call it once per Demo.
//
// ctx ending (Ctrl-C) stops the sending; the run then waits a short grace for the outcomes of
// what was accepted and reports the rest as unfinished. abort ending (the relay or a worker
// failed) ends the run with no error of its own: that failure is the caller's to report.
//
// The Result is never nil; its summary is worth printing when Result.Started.
func (d *Demo) Run(ctx, abort context.Context, s Services) (*Result, error) {
	res := &Result{
		Messages: d.cfg.Messages, Conversations: d.cfg.Conversations,
		MaxAttempts: d.cfg.MaxAttempts, FailEvery: d.cfg.FailEvery,
		TurnsStream: d.stream, OutcomesStream: d.outcomes,
		Database: unknownDatabase,
	}
	js, err := jetstream.New(s.NATS)
	if err != nil {
		return res, fmt.Errorf("jetstream: %w", err)
	}
	res.Interrupted, err = d.waitRelay(ctx, abort, s.Relay, js)
	switch {
	case abort.Err() != nil:
		return res, nil
	case err != nil:
		return res, err
	case res.Interrupted:
		d.printf("interrupted before sending anything\n")
		return res, nil
	}
	turns, err := d.watchTurns(js.Conn(), wire.StreamFilter(d.cfg.SubjectPrefix, wire.KindTurns))
	if err != nil {
		return res, err
	}
	defer func() { _ = turns.Unsubscribe() }()
	outcomes, err := d.subscribe(abort, js, d.outcomes, wire.StreamFilter(d.cfg.SubjectPrefix, wire.KindOutcomes), d.onOutcome)
	if err != nil {
		return res, err
	}
	defer stopConsume(outcomes, d.outcomes, d.cfg.Logger)
	failing := ""
	if d.cfg.FailEvery > 0 {
		failing = fmt.Sprintf("; every turn of every %dth conversation fails on purpose", d.cfg.FailEvery)
	}
	d.printf("  workers %s consuming %s: echo handler with a lookup tool, model latency %s, %d attempts%s\n",
		strings.Join(d.cfg.Workers, " and "), d.stream, d.cfg.ModelLatency, d.cfg.MaxAttempts, failing)
	d.printf("  outcome subscriber reading %s\n", d.outcomes)

	if err := d.createConversations(ctx, abort, s.Pool, s.Producer); err != nil {
		if ctx.Err() != nil && abort.Err() == nil {
			res.Interrupted = true
			d.printf("interrupted before sending anything\n")
			return res, nil
		}
		return res, err
	}
	rate := "as fast as possible"
	if d.cfg.Rate > 0 {
		rate = strconv.FormatFloat(d.cfg.Rate, 'f', -1, 64) + " msg/s"
	}
	d.printf("sending %d messages to %d conversations, %s, every %dth sent twice with the same id\n",
		d.cfg.Messages, d.cfg.Conversations, rate, retryEvery)
	res.Started = true

	progressDone := make(chan struct{})
	stopProgress := make(chan struct{})
	start := time.Now()
	go func() {
		defer close(progressDone)
		d.progress(start, stopProgress)
	}()
	sendErr := d.send(ctx, abort, s.Pool, s.Producer)
	res.SendTime = time.Since(start)
	res.Interrupted = ctx.Err() != nil

	// The tail: wait until every accepted message is in the turns stream and has its outcome.
	wait := d.cfg.TailTimeout
	if res.Interrupted {
		wait = interruptGrace
	}
	if sendErr == nil {
		res.TailTimeout = !d.waitTail(ctx, abort, wait, res.Interrupted)
		res.Interrupted = ctx.Err() != nil
	}
	// Stop the workers while the relay still runs: a running turn gets the workers' shutdown
	// grace to finish, then its rows are released. Outcomes committed meanwhile still reach
	// the stream.
	s.StopWorkers()
	if sendErr == nil && abort.Err() == nil && !d.ledger.snapshot().Settled() {
		res.TailTimeout = !d.waitTail(ctx, abort, outcomeGrace, true) && res.TailTimeout
	}
	close(stopProgress)
	<-progressDone

	qctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 10*time.Second)
	defer cancel()
	res.Database = d.queryDatabase(qctx, s.Pool)
	res.Counts, res.Latency = d.ledger.final()
	return res, sendErr
}

// waitRelay waits until the relay streams, or stands by while another relay streams from the
// same slot into an existing stream. It reports whether ctx ended first, and fails when the
// relay is not ready within StartTimeout.
func (d *Demo) waitRelay(ctx, abort context.Context, r Relay, js jetstream.JetStream) (interrupted bool, err error) {
	deadline := time.Now().Add(StartTimeout)
	tick := time.NewTicker(50 * time.Millisecond)
	defer tick.Stop()
	for {
		if r.Active() {
			d.printf("  relay streaming from slot %s to streams %s and %s\n", d.cfg.Slot, d.stream, d.outcomes)
			return false, nil
		}
		if r.Ready() {
			// Standing by: another relay holds the slot and publishes the run's events.
			sctx, cancel := context.WithTimeout(abort, 2*time.Second)
			_, err := js.Stream(sctx, d.stream)
			if err == nil {
				_, err = js.Stream(sctx, d.outcomes)
			}
			cancel()
			if err == nil {
				d.printf("  another relay holds slot %s; this one stands by and the other publishes to %s and %s\n",
					d.cfg.Slot, d.stream, d.outcomes)
				return false, nil
			}
		}
		if time.Now().After(deadline) {
			return false, fmt.Errorf("the relay did not start streaming within %s (run with --log-level info to see why)",
				StartTimeout)
		}
		select {
		case <-tick.C:
		case <-ctx.Done():
			return true, nil
		case <-abort.Done():
			return false, nil
		}
	}
}

// waitTail waits, at most wait, until every accepted message is in the turns stream and has
// its outcome. It reports whether that happened. Unless interrupted, ctx ending (Ctrl-C)
// shortens the wait to interruptGrace from then.
func (d *Demo) waitTail(ctx, abort context.Context, wait time.Duration, interrupted bool) bool {
	deadline := time.NewTimer(wait)
	defer deadline.Stop()
	tick := time.NewTicker(20 * time.Millisecond)
	defer tick.Stop()
	done := ctx.Done()
	if interrupted {
		done = nil
	}
	for {
		if d.ledger.snapshot().Settled() {
			return true
		}
		select {
		case <-tick.C:
		case <-deadline.C:
			return false
		case <-abort.Done():
			return false
		case <-done: // Ctrl-C while waiting for the tail: a shorter grace from now
			done = nil
			if wait > interruptGrace {
				deadline.Reset(interruptGrace)
			}
		}
	}
}

// progress prints the progress line until stop closes: one line updated in place on a
// terminal, a plain line every second otherwise. It ends with a newline on a terminal.
func (d *Demo) progress(start time.Time, stop <-chan struct{}) {
	every := time.Second
	if d.cfg.TTY {
		every = 200 * time.Millisecond
	}
	tick := time.NewTicker(every)
	defer tick.Stop()
	width := 0
	line := func() {
		text := progressLine(d.ledger.snapshot(), d.cfg.Messages, time.Since(start))
		if d.cfg.TTY {
			pad := max(width-len(text), 0)
			width = len(text)
			d.printf("\r%s%s", text, strings.Repeat(" ", pad))
			return
		}
		d.printf("%s\n", text)
	}
	for {
		select {
		case <-tick.C:
			line()
		case <-stop:
			if d.cfg.TTY {
				line()
				d.printf("\n")
			}
			return
		}
	}
}
