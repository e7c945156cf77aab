// Package consumer is what agent workers are written with: it takes turn requests (from the
// relay's JetStream stream, or by polling agent_outbox), runs one turn per conversation at a
// time across any number of worker processes, and commits each turn's end in one transaction.
//
// Guarantees, each kept by the code named:
//   - A turn is built from the exact outbox rows its claim returned (store.claimMany): a
//     conversation's claim lock serialises claimers, the claim statement reads with a snapshot
//     taken after the lock and claims only where the lock was taken, and a conversation with
//     any processing row is busy, so at most one run per conversation exists at a time.
//   - Reply, operation ownership, outbox done and conversation metadata commit together
//     (store.finishMany). The update of the claimed rows is fenced by run id: a run whose rows
//     were recovered or reclaimed commits nothing. Runs ending together share the statement;
//     if one of them is fenced out, the others are committed one by one.
//   - A claim takes an ordered prefix of the conversation's pending rows, capped by
//     Config.MaxTurnMessages and Config.MaxTurnBytes, and nothing while the oldest backs off
//     (claimSQL), so replies keep message order.
//   - Every tool call goes through Turn.Tool, which records the operation as running before
//     the tool runs, and only while the run holds every claimed row with a live lease
//     (recordOperationSQL; recordOperationsSQL when calls of several turns share the
//     statement, each fenced by its own run). A write operation row exists ⇒ the effect may
//     have happened ⇒ the turn never replays automatically, whatever the row's status
//     (endOfRun). A call's end is written with the turn's next statement.
//   - A turn without a reply ends by endOfRun, per row (planEnd), in one transaction
//     (store.endRun): a write ⇒ visible failure; shutdown ⇒ released, attempt refunded; the
//     row's own attempts at Config.MaxAttempts ⇒ visible failure; else pending after a
//     backoff. A visible failure shows users Config.FailureMessage, never internal error text.
//     Work is never deleted.
//   - Expired leases are recovered at start and every RecoveryInterval (store.recoverRun), all
//     of a run's rows or none, by the same rule.
//   - A shared final commit that fails is redone run by run, so one run's failure never fails
//     another's; transient failures are retried, and a commit whose answer was lost is found
//     by its reply id.
//   - A turn event is acked only when its row is terminal (done or error) or gone; otherwise
//     it is kept in progress or nacked with a delay (settleHeld), so JetStream keeps it until
//     Postgres says the request is finished.
//   - A conversation deleted during a turn fails the final commit on its foreign key: the
//     result is discarded, the events are acked, and nothing is recreated.
//
// Tracing: each turn is an OpenTelemetry span, a child of the sender's span read from the
// claimed rows' trace_context (whichever source fed the worker), with spans for its claim,
// tool calls and commit; the reply stores the turn span's traceparent for its outcome event.
// See TracerName and Config.TracerProvider. Without a provider installed, spans are no-ops.
package consumer
