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
//   - Every tool call goes through Turn.Tool, which records the operation as running before
//     the tool runs. After a Write tool ran or may have run, a failed or interrupted turn ends
//     as a visible error message in the conversation, never as an automatic replay.
//   - Failed attempts without side effects go back to pending with backoff; at
//     Config.MaxAttempts the turn ends as a visible error. Work is never deleted.
//   - Expired leases are recovered at start and every RecoveryInterval (store.recoverRun).
//   - A turn event is acked only when its row is terminal (done or error) or gone; otherwise
//     it is kept in progress or nacked with a delay, so JetStream keeps it until Postgres says
//     the request is finished.
//   - A conversation deleted during a turn fails the final commit on its foreign key: the
//     result is discarded, the events are acked, and nothing is recreated.
package consumer
