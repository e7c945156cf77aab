package consumer

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"time"
	"unicode/utf8"

	"go.opentelemetry.io/otel/codes"
)

// runTurn runs the handler for a claim (begun at claimed) and commits its end: a reply, a
// retry, or a visible failure. It returns the claimed rows that are now terminal (or gone).
//
// The turn is one span (see TracerName), a child of the sender's when the claimed rows carry
// one, and its context is the trace context of the message that ends the turn.
func (w *Worker) runTurn(ctx context.Context, conv, runID string, c claim, claimed time.Time) []int64 {
	ctx, span := w.startTurn(ctx, conv, runID, c, claimed, time.Now())
	defer span.End()
	traceContext := turnTraceparent(span, c)
	log := w.cfg.Logger.With("conversation_id", conv, "run_id", runID)
	started := w.clock.Now()
	w.m.running.Inc()
	defer w.m.running.Dec()
	w.m.attempts.Observe(float64(c.attempts))

	// The turn outlives a stopping worker by ShutdownGrace, and ends at once if the lease is lost.
	// The lease is kept until the run's end has committed: a final commit queued behind
	// others must not find the rows recovered meanwhile.
	turnCtx, cancel := context.WithCancelCause(context.WithoutCancel(ctx))
	defer cancel(nil)
	runEnded, keeper := make(chan struct{}), make(chan struct{})
	go func() {
		defer close(keeper)
		w.keepLease(ctx, runEnded, cancel, conv, runID, c.ids)
	}()
	defer func() {
		close(runEnded)
		<-keeper
	}()

	var reply Reply
	var herr error
	t := &Turn{ConversationID: conv, RunID: runID, OutboxIDs: c.ids, Messages: c.messages, Attempt: c.attempts, w: w, span: span}
	switch {
	case c.oversize:
		herr = fmt.Errorf("%w (Config.MaxTurnBytes is %d)", ErrMessageTooLarge, w.cfg.MaxTurnBytes)
	case c.unreadable:
		herr = errUnreadable
	default:
		reply, herr = w.handle(turnCtx, t)
	}
	cancel(nil)
	end := endOfTurn(herr, context.Cause(turnCtx)) // the cause is fixed now: later cancels change nothing
	// Commits run to completion even when the worker is stopping.
	dbCtx, dbCancel := context.WithTimeout(context.WithoutCancel(ctx), 30*time.Second)
	defer dbCancel()
	// The ends of tool calls not written yet go with the final commit; any other end of the
	// run writes them first (endRun marks operations still running as interrupted).
	ends := t.takeEnds()
	if end != turnReplied {
		w.endOperations(dbCtx, log, ends)
	}
	if end == turnLost {
		// Recovery (or whoever took the rows) decides their fate, seeing this run's operations.
		w.m.turns.WithLabelValues(resultLeaseLost).Inc()
		log.Warn("lease lost during the turn; its result is discarded")
		return nil
	}

	var result string
	var terminal []int64
	var err error
	_, commit := w.tracer.Start(dbCtx, "baton.commit")
	if end == turnReplied {
		result, terminal = "done", c.ids
		err = w.finish(dbCtx, finishReq{conversationID: conv, runID: runID, ids: c.ids,
			outcome: outcome{role: "assistant", content: reply.Content}, ends: ends, traceContext: traceContext})
		if err != nil {
			w.endOperations(dbCtx, log, ends) // nothing of the final commit was written
		}
	} else {
		// Not a reply: endOfRun decides per row, seeing every write operation of the run.
		stopping := end == turnStopped
		var e ended
		e, err = w.store.endRun(dbCtx, endReq{conversationID: conv, runID: runID, ids: c.ids, cause: herr,
			stopping: stopping, permanent: c.oversize || c.unreadable, traceContext: traceContext})
		result, terminal = e.result, e.failed
		log.Warn("turn failed", "error", detail(herr), "attempt", c.attempts, "stopping", stopping,
			"result", result, "failed", e.failed, "pending", e.retried)
	}
	result, terminal = afterCommit(result, terminal, c.ids, err)
	if span.IsRecording() {
		span.SetAttributes(attrResult.String(result))
		commit.SetAttributes(attrResult.String(result))
	}
	endSpan(commit, err)
	if herr != nil && span.IsRecording() {
		span.SetStatus(codes.Error, detail(herr))
	}
	switch result {
	case resultCancelled:
		log.Info("conversation deleted during the turn; result discarded")
	case resultLeaseLost:
		log.Warn("lease lost before the commit; result discarded")
	case resultCommitFailed:
		log.Error("commit turn", "error", err) // rows stay processing; recovery takes them after the lease
	}
	w.m.turns.WithLabelValues(result).Inc()
	w.m.turnSeconds.Observe(w.clock.Now().Sub(started).Seconds())
	return terminal
}

// endOperations writes the ends of tool calls that no other statement of the run carries.
// Best effort: an operation whose end is not written shows as interrupted.
func (w *Worker) endOperations(ctx context.Context, log *slog.Logger, ends []opEnd) {
	if err := w.store.endOperations(ctx, ends); err != nil {
		log.Warn("record the end of tool calls", "error", err)
	}
}

// handle calls the handler with the claimed turn t.
func (w *Worker) handle(ctx context.Context, t *Turn) (Reply, error) {
	reply, err := w.callHandler(ctx, t)
	if err != nil {
		return Reply{}, err
	}
	if !utf8.ValidString(reply.Content) || strings.ContainsRune(reply.Content, 0) {
		return Reply{}, errors.New("handler returned a reply that is not valid UTF-8 text")
	}
	return reply, nil
}

// callHandler turns a handler panic into an error, so one bad turn cannot kill the worker.
func (w *Worker) callHandler(ctx context.Context, t *Turn) (reply Reply, err error) {
	defer func() {
		if p := recover(); p != nil {
			err = fmt.Errorf("handler panicked: %v", p)
		}
	}()
	return w.cfg.Handler(ctx, t)
}

// finish commits the end of a run, sharing the statement with other runs ending at the same
// moment.
func (w *Worker) finish(ctx context.Context, r finishReq) error {
	runErr, err := w.finishes.do(ctx, r)
	if err != nil {
		return err
	}
	return runErr
}

// record records a tool call, sharing the statement with other turns' calls made at the same
// moment. Outside Run (a turn driven by hand) the call is recorded alone.
func (w *Worker) record(ctx context.Context, r recordReq) (int64, error) {
	if w.records == nil {
		return w.store.recordOperation(ctx, r)
	}
	res, err := w.records.do(ctx, r)
	if err != nil {
		return 0, fmt.Errorf("record operation: %w", err)
	}
	return res.id, res.err
}

// history reads a turn's history, sharing the statement with other turns' reads made at the
// same moment. Outside Run (a turn driven by hand) it is read alone.
func (w *Worker) history(ctx context.Context, r historyReq) ([]Message, error) {
	if w.histories == nil {
		return w.store.history(ctx, r)
	}
	res, err := w.histories.do(ctx, r)
	if err != nil {
		return nil, fmt.Errorf("load history of %q: %w", r.conversationID, err)
	}
	return res.msgs, res.err
}

// keepLease renews the run's lease every Lease/3 and marks held events in progress every
// AckWait/3, until runEnded is closed (the run's end committed, or failed to). It cancels the
// turn with errLeaseLost when the lease is lost, and with errStopping ShutdownGrace after ctx
// ends; the lease is still kept while the run ends.
func (w *Worker) keepLease(ctx context.Context, runEnded <-chan struct{}, cancel context.CancelCauseFunc, conv, runID string, ids []int64) {
	renew, stopRenew := w.clock.NewTicker(w.cfg.Lease / 3)
	defer stopRenew()
	inProgress, stopInProgress := w.clock.NewTicker(w.cfg.AckWait / 3)
	defer stopInProgress()
	var grace <-chan time.Time
	stopGrace := func() bool { return false }
	defer func() { stopGrace() }()
	stopping := ctx.Done()
	for {
		select {
		case <-runEnded:
			return
		case <-stopping:
			stopping = nil
			grace, stopGrace = w.clock.NewTimer(w.cfg.ShutdownGrace)
		case <-grace:
			grace = nil
			cancel(errStopping)
		case <-inProgress:
			for _, ev := range w.heldEvents(conv) {
				_ = ev.d.inProgress()
			}
		case <-renew:
			rctx, rcancel := context.WithTimeout(context.WithoutCancel(ctx), w.cfg.Lease/3)
			ok, err := w.store.renew(rctx, conv, runID, ids)
			rcancel()
			if err != nil {
				w.cfg.Logger.Warn("renew lease", "run_id", runID, "error", err)
				continue
			}
			if !ok {
				cancel(errLeaseLost)
				return
			}
		}
	}
}
