package consumer

import (
	"fmt"
	"log/slog"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus"
)

// This file holds every SQL statement of the package, grouped by role. The methods that run
// them live in store_claim.go (claims and leases), store_finish.go (final commits),
// store_end.go (runs ending without a reply, and recovery) and store_read.go (tool
// operations, and the reads of the sources and the conversation loop); store_retry.go says
// which failures are retried and how.

// store runs the SQL of claims, leases, final commits and recovery. Every statement that
// changes a claimed row is fenced by run id: a run whose rows were recovered or reclaimed
// changes nothing.
type store struct {
	pool        *pgxpool.Pool
	lease       time.Duration
	maxAttempts int
	backoff     func(attempt int) time.Duration
	worker      string
	// maxRows and maxBytes cap a claim (Config.MaxTurnMessages, Config.MaxTurnBytes).
	maxRows, maxBytes int
	// failureMessage is the text a user sees of a visible failure (Config.FailureMessage).
	failureMessage func(error) string
	// lockTimeout bounds how long a claim, a tool record or end, a final commit, a run's end
	// or a recovery waits for a row lock; zero: defaultLockTimeout.
	lockTimeout time.Duration
	// log gets what no caller can be told: a lost claim that could not be handed back
	// (Config.Logger); nil: discarded.
	log *slog.Logger
	// lostClaims counts claims whose answer was lost, by result (handed_back, failed); nil: not
	// counted.
	lostClaims *prometheus.CounterVec
}

// defaultLockTimeout is how long a claim or final commit waits for a row another transaction
// holds: Baton's own transactions hold conversation and outbox rows for milliseconds.
const defaultLockTimeout = 5 * time.Second

// lockTimeoutSetting is the lock_timeout value for set_config.
func (s *store) lockTimeoutSetting() string {
	d := s.lockTimeout
	if d <= 0 {
		d = defaultLockTimeout
	}
	return fmt.Sprintf("%dms", d.Milliseconds())
}

// Shared by claims, tool records and final commits.

// genericPlansSQL makes the statements after it in the transaction run their cached generic
// plan. Postgres otherwise keeps planning the claim and final-commit statements afresh on
// every execution (about a millisecond each): their generic plans, costed for arrays of
// unknown length, never look cheaper than a custom plan for a one-element array, though
// they are the same index probes.
//
// It turns sequential scans off for the transaction: a generic plan is made once per
// connection and kept until the tables' statistics change, so one made while a table was
// nearly empty (a new database; autovacuum analyzes it a minute later at the earliest) would
// otherwise scan that table whole on every execution as it grows. Seen in baton bench turns
// (a new database per phase): the final commit's update of the runs' operations read the
// whole operations table; without that scan the tools phase's final commits took a sixth
// less time (pg_stat_statements, 760 instead of 920µs per run).
//
// It also sets lock_timeout ($1) for the transaction (a claim, a tool record or a final
// commit): a row that another transaction holds for long fails the statement (55P03) instead
// of stalling it, and every one queued behind it; a shared statement is then redone for each
// conversation apart, so only the held conversation's fails (a final commit's run is
// recovered after its lease).
//
// It is the first statement of every transaction that asks for it: plan_cache_mode counts when
// a statement is bound, so a statement that set it would still be planned by the mode before.
// lock_timeout bounds what the statements after it wait for, not the round trip in which pgx
// first prepares a statement on a connection (or again after a failed batch), which comes
// before the batch: a table lock an operator holds (ALTER TABLE) stalls that until the batch's
// timeout (30 s).
const genericPlansSQL = `SELECT set_config('plan_cache_mode', 'force_generic_plan', true), set_config('enable_seqscan', 'off', true),
	set_config('lock_timeout', $1, true)`

// lockTimeoutSQL sets lock_timeout ($1) for the rest of the transaction: a run's end without
// a reply, and a recovery (see boundLockWaits).
const lockTimeoutSQL = `SELECT set_config('lock_timeout', $1, true)`

// Claims and leases.

// lockConversationsSQL takes the conversations' claim locks and records, for the rest of the
// transaction, which ones it got; SKIP LOCKED makes a concurrent claimer give up at once
// instead of queueing behind us. It runs after genericPlansSQL, which gives it and the claim
// statement their cached generic plans and sets the claim's lock_timeout: a row some other
// transaction holds for long fails the claim (55P03) instead of stalling every claim behind
// it; the batch is then claimed apart. (When this statement set plan_cache_mode itself, the
// setting came too late for its own plan: it was planned afresh at every claim, about half its
// cost.) It also turns synchronous_commit off for the claim transaction: the claim does not
// wait for its WAL to reach disk. A claim that a database crash loses is harmless: its rows
// are pending again, and the run's fenced final commit fails, so nothing of it is kept.
// Whatever the run does that matters commits synchronously later (its tool operations, its
// final commit), and flushing that WAL flushes the claim's before it.
const lockConversationsSQL = `
SELECT set_config('baton.claim_locked', coalesce(json_agg(id), '[]')::text, true),
       set_config('synchronous_commit', 'off', true)
FROM (SELECT id FROM conversations WHERE id = ANY($1) FOR NO KEY UPDATE SKIP LOCKED) locked`

// claimSQL runs as the second statement of the claim transaction, so its snapshot is taken
// after the locks were acquired: it sees every claim committed before ours. It claims only in
// the conversations the first statement locked: locking here instead would take a lock that
// was free by now with a snapshot taken before it was (a claim committed in between would be
// invisible, and its conversation claimed twice).
//
// A conversation is busy while any of its rows is processing, live lease or not; expired ones
// are recovery's. Otherwise the claim takes an ordered prefix of its pending rows:
//   - in id order, stopping before the first row still backing off (available_at in the
//     future; a non-finite one does not count), so a reply never overtakes the reply to an
//     earlier message;
//   - at most $5 rows and, beyond the first row, at most $6 bytes of content in all, so a
//     claim stays far below Postgres's 1 GB value limit whatever piles up; the rest goes to
//     the next turn. A first row that alone exceeds $6 is claimed without its content
//     (oversize), and the worker ends it as a visible failure.
//
// Each run's record gets its claim order from a trigger (migration 13): one more than the
// conversation's largest, which our lock on the conversation and our snapshot, taken after it,
// make the largest of every earlier claim.
//
// For each requested conversation the statement returns whether we hold its lock, whether it
// is busy, the rows claimed for its run with their messages, and, when its oldest pending row
// backs off, until when. Every table is reached through "= ANY(array)" on an indexed key, so
// the generic plan of this prepared statement probes indexes whatever the batch size.
const claimSQL = `
WITH input AS (
    SELECT * FROM unnest($1::text[], $2::uuid[]) AS i(conversation_id, run_id)
), conv AS (
    SELECT i.conversation_id AS id, i.run_id FROM input i
    WHERE i.conversation_id IN (SELECT json_array_elements_text(current_setting('baton.claim_locked')::json))
), busy AS (
    SELECT DISTINCT conversation_id FROM agent_outbox
    WHERE conversation_id = ANY($1) AND status = 'processing'
), queue AS (
    SELECT q.id, q.conversation_id, q.available_at, q.n,
           sum(octet_length(m.content)) OVER w AS bytes,
           bool_or(q.available_at > now() AND isfinite(q.available_at)) OVER w AS blocked
    FROM (SELECT p.id, p.conversation_id, p.available_at, p.message_id,
                 row_number() OVER (PARTITION BY p.conversation_id ORDER BY p.id) AS n
          FROM agent_outbox p JOIN conv ON p.conversation_id = conv.id
          WHERE p.conversation_id = ANY($1) AND p.status = 'pending'
            AND p.conversation_id NOT IN (SELECT conversation_id FROM busy)) q
    JOIN messages m ON m.id = q.message_id
    WHERE q.n <= $5
    WINDOW w AS (PARTITION BY q.conversation_id ORDER BY q.id)
), claimed AS (
    UPDATE agent_outbox o
    SET status = 'processing', attempts = least(o.attempts, 2147483646) + 1, run_id = conv.run_id,
        lease_expires_at = now() + $3 * interval '1 millisecond'
    FROM conv
    WHERE o.conversation_id = conv.id AND o.id IN (
        SELECT id FROM queue WHERE NOT blocked AND (n = 1 OR bytes <= $6))
    RETURNING o.id, o.conversation_id, o.attempts, o.message_id, conv.run_id, o.trace_context
), run AS (
    INSERT INTO agent_runs (run_id, conversation_id, outbox_ids, worker)
    SELECT run_id, conversation_id, array_agg(id ORDER BY id), $4 FROM claimed
    GROUP BY run_id, conversation_id
)
SELECT i.conversation_id, conv.id IS NOT NULL, i.conversation_id IN (SELECT conversation_id FROM busy),
       coalesce(array_agg(c.id ORDER BY c.id) FILTER (WHERE c.id IS NOT NULL), '{}'),
       coalesce(max(c.attempts), 0),
       json_agg(json_build_object('ID', m.id, 'Role', m.role,
                                  'Content', CASE WHEN octet_length(m.content) > $6 THEN '' ELSE m.content END,
                                  'CreatedAt', CASE WHEN m.created_at BETWEEN '0001-01-01 00:00:00+00' AND '9999-12-31 00:00:00+00'
                                               THEN m.created_at END)
                ORDER BY c.id) FILTER (WHERE c.id IS NOT NULL),
       coalesce(bool_or(octet_length(m.content) > $6), false),
       (SELECT q.available_at FROM queue q WHERE q.conversation_id = i.conversation_id AND q.n = 1 AND q.blocked),
       array_agg(c.trace_context ORDER BY c.id) FILTER (WHERE c.trace_context IS NOT NULL)
FROM input i
LEFT JOIN conv ON conv.id = i.conversation_id
LEFT JOIN claimed c ON c.conversation_id = i.conversation_id
LEFT JOIN messages m ON m.id = c.message_id
GROUP BY i.conversation_id, conv.id`

// unclaimSQL undoes claims whose answer was lost, for runs $1 of conversations $2: the runs'
// rows go back to pending with the attempt refunded (no handler saw them), and the runs' records
// end as released, with $3 as their error; it returns how many runs it ended (the claims that
// had committed). It updates and
// deletes nothing else: baton_worker may not delete run records (deploy/postgres/roles.sql), and
// a record says what happened. A run id whose record ended this way never claims again (the
// claim's insert of its record would fail): claimMany claims again under new run ids.
const unclaimSQL = `
WITH runs AS (
    UPDATE agent_runs SET finished_at = clock_timestamp(), outcome = 'released', error = $3
    WHERE run_id = ANY($1::uuid[]) AND finished_at IS NULL
    RETURNING 1
), back AS (
    UPDATE agent_outbox SET status = 'pending', run_id = NULL, lease_expires_at = NULL,
        attempts = greatest(attempts - 1, 0)
    WHERE conversation_id = ANY($2) AND run_id = ANY($1::uuid[]) AND status = 'processing'
)
SELECT count(*) FROM runs`

// renewSQL extends the lease of every row of a run, or of none: it locks the run's claimed
// rows and updates them only when it found all of them still the run's. A recovery that took
// the run (or part of it) first leaves it nothing to renew; a recovery that comes second finds
// the lease live and leaves the run alone.
const renewSQL = `
WITH held AS (
    SELECT id FROM agent_outbox
    WHERE conversation_id = $1 AND run_id = $2 AND id = ANY($3) AND status = 'processing'
    FOR UPDATE
)
UPDATE agent_outbox o SET lease_expires_at = now() + $4 * interval '1 millisecond'
WHERE o.id IN (SELECT id FROM held) AND (SELECT count(*) FROM held) = cardinality($3::bigint[])`

// Final commits.

// finishSQL ends runs in one statement, so in one transaction and one round trip:
//   - per run, the logical message naming the rows its reply answers, for the relay's outcome
//     event (the reply's insert reads from it, so it reaches the WAL before the reply);
//   - the reply or error messages, whose foreign key fails (23503) when a conversation was
//     deleted meanwhile;
//   - the claimed rows terminal, fenced by run id: baton_fence raises BT001 unless, for each
//     run, every one of its claimed rows ($11 holds each run's count) is still its own and its
//     conversation row was updated. A conversation deleted meanwhile, or deleted and
//     recreated with the same id (the foreign key would pass), fails the fence too: the old
//     turn's reply never lands in a new conversation. finishOne tells a deleted conversation
//     from a lost lease afterwards;
//   - the runs' operations attached to their replies; those whose call ended since the run's
//     last statement ($13-$17, as endOperationsSQL takes them, with $18-$19 the run and the
//     reply of each) get their end in the same update, and any other still running is marked
//     interrupted; the conversations' metadata (unread_count stays at integer's maximum, which
//     any role may write, instead of failing every commit of the conversation), the runs'
//     records. The ended operations are
//     found by key and each one's end by its place in the arrays, not by a join: with
//     statistics of nearly empty tables, the generic plan of a join compared every operation
//     with every end (32 runs of 100 ended calls: 2.2 s for the statement, 0.3 s now).
//
// One statement instead of six pipelined ones costs about a quarter less server CPU per turn
// (measured with pgbench on this schema). Every table is reached through "= ANY(array)" on an
// indexed key, so the generic plan probes indexes whatever the batch size.
const finishSQL = `
WITH input AS (
    SELECT * FROM unnest($1::text[], $2::uuid[], $3::text[], $4::text[], $5::text[], $6::text[], $7::text[], $8::text[], $12::text[])
        AS i(conversation_id, run_id, status, reply_id, role, content, reason, answers, trace_context)
), emit AS (
    SELECT i.*, pg_logical_emit_message(true, $10, i.answers) FROM input i
), reply AS (
    INSERT INTO messages (id, conversation_id, role, content, trace_context)
    SELECT reply_id, conversation_id, role, content, trace_context FROM emit
    RETURNING id
), done AS (
    UPDATE agent_outbox o
    SET status = i.status, processed_at = now(), reply_id = i.reply_id, last_error = i.reason,
        lease_expires_at = NULL
    FROM input i
    WHERE o.id = ANY($9) AND o.conversation_id = ANY($1) AND o.run_id = ANY($2)
      AND o.conversation_id = i.conversation_id AND o.run_id = i.run_id AND o.status = 'processing'
    RETURNING o.run_id
), ended AS (
    UPDATE operations op SET (message_id, status, output, error, finished_at) = (
        SELECT ($19::text[])[k], ($14::text[])[k], ($15::text[])[k]::jsonb, ($16::text[])[k],
               op.started_at + ($17::bigint[])[k] * interval '1 microsecond'
        FROM (SELECT array_position($13::bigint[], op.id) AS k) e)
    WHERE op.id = ANY($13) AND op.run_id = ($18::uuid[])[array_position($13::bigint[], op.id)] AND op.message_id IS NULL
    RETURNING op.id
), ops AS (
    UPDATE operations op SET message_id = i.reply_id,
        status = CASE WHEN op.status = 'running' THEN 'error' ELSE op.status END,
        error = CASE WHEN op.status = 'running' THEN 'interrupted: the turn ended before the tool call did' ELSE op.error END,
        finished_at = coalesce(op.finished_at, now())
    FROM input i
    WHERE op.run_id = ANY($2) AND op.run_id = i.run_id AND op.message_id IS NULL
      AND op.id NOT IN (SELECT id FROM ended)
), conv AS (
    UPDATE conversations c SET last_message_at = now(), unread_count = least(c.unread_count, 2147483646) + 1
    FROM input i
    WHERE c.id = ANY($1) AND c.id = i.conversation_id
    RETURNING c.id
), run AS (
    UPDATE agent_runs r SET finished_at = clock_timestamp(), outcome = i.status, error = i.reason
    FROM input i
    WHERE r.run_id = ANY($2) AND r.run_id = i.run_id
)
SELECT baton_fence(coalesce(bool_and(coalesce(d.n, 0) = i.n AND c.id IS NOT NULL), true), 'a run no longer owns its rows')
FROM unnest($2::uuid[], $1::text[], $11::int[]) AS i(run_id, conversation_id, n)
LEFT JOIN (SELECT run_id, count(*)::int AS n FROM done GROUP BY run_id) d ON d.run_id = i.run_id
LEFT JOIN conv c ON c.id = i.conversation_id`

// repliesExistSQL counts the messages among ids ($1): a final commit whose outcome is unknown
// happened if its reply exists.
const repliesExistSQL = `SELECT count(*) FROM messages WHERE id = ANY($1)`

// conversationExistsSQL tells a deleted conversation from a lost lease.
const conversationExistsSQL = `SELECT EXISTS (SELECT 1 FROM conversations WHERE id = $1)`

// Runs that end without a reply, and recovery.

// lockRunSQL locks the rows a run claimed ($3) that are still its own, and returns their id
// and attempts.
const lockRunSQL = `SELECT id, attempts FROM agent_outbox
	WHERE conversation_id = $1 AND run_id = $2 AND id = ANY($3) AND status = 'processing'
	ORDER BY id FOR UPDATE`

// runOutcomeSQL reads how a run ended (NULL while it has not).
const runOutcomeSQL = `SELECT outcome FROM agent_runs WHERE run_id = $1`

// writtenSQL tells whether run has a write operation, whatever its status: a write row exists
// ⇒ the effect may have happened (a tool recorded as failed may have failed after its effect,
// or been cut short mid-call).
const writtenSQL = `SELECT EXISTS (SELECT 1 FROM operations WHERE run_id = $1 AND effect = 'write')`

// closeOperationsSQL marks run's operations still running as interrupted.
const closeOperationsSQL = `UPDATE operations SET status = 'error', error = $2, finished_at = now()
	WHERE run_id = $1 AND status = 'running'`

// requeueSQL puts rows back to pending: each after its own delay, its attempt refunded or not.
const requeueSQL = `
UPDATE agent_outbox o
SET status = 'pending', run_id = NULL, lease_expires_at = NULL,
    attempts = CASE WHEN r.refund THEN greatest(o.attempts - 1, 0) ELSE o.attempts END,
    last_error = CASE WHEN r.refund THEN o.last_error ELSE $3 END,
    available_at = now() + r.delay_ms * interval '1 millisecond'
FROM unnest($1::bigint[], $2::bigint[], $4::boolean[]) AS r(id, delay_ms, refund)
WHERE o.id = r.id`

// endRunSQL records how a run ended when the final commit did not.
const endRunSQL = `UPDATE agent_runs SET finished_at = clock_timestamp(), outcome = $2, error = $3
	WHERE run_id = $1 AND finished_at IS NULL`

// leaseExpired is true for a processing row whose lease is over: expired, or never set or not a
// real time (rows Baton did not write), so that no such row keeps its conversation busy.
const leaseExpired = `(lease_expires_at IS NULL OR lease_expires_at < now() OR NOT isfinite(lease_expires_at))`

// expiredRunsSQL lists up to $1 runs holding processing rows whose lease expired; rows that
// name no run come as run id "".
const expiredRunsSQL = `SELECT DISTINCT coalesce(run_id::text, ''), conversation_id FROM agent_outbox
	WHERE status = 'processing' AND ` + leaseExpired + ` LIMIT $1`

// lockExpiredRunSQL locks, skipping any another transaction holds, the processing rows of run
// $2 ("" for rows that name no run) in conversation $1 whose lease expired, and returns their
// id and attempts.
const lockExpiredRunSQL = `SELECT id, attempts FROM agent_outbox
	WHERE conversation_id = $1 AND run_id IS NOT DISTINCT FROM nullif($2, '')::uuid AND status = 'processing'
	  AND ` + leaseExpired + `
	ORDER BY id FOR UPDATE SKIP LOCKED`

// countRunSQL counts the processing rows of run $2 ("" for none) in conversation $1.
const countRunSQL = `SELECT count(*) FROM agent_outbox
	WHERE conversation_id = $1 AND run_id IS NOT DISTINCT FROM nullif($2, '')::uuid AND status = 'processing'`

// assignRunSQL gives rows ($1) that name no run the run id $2.
const assignRunSQL = `UPDATE agent_outbox SET run_id = $2 WHERE id = ANY($1)`

// runlessLeftSQL tells whether conversation $1 still has processing rows that name no run.
const runlessLeftSQL = `SELECT EXISTS (SELECT 1 FROM agent_outbox
	WHERE conversation_id = $1 AND run_id IS NULL AND status = 'processing')`

// Tool operations.

// recordOperationSQL records a tool call as running, only while the run still holds every row
// it claimed ($6) with a live lease. It locks those rows FOR SHARE and inserts only when it
// got all of them: recovery (which takes a run's rows FOR UPDATE SKIP LOCKED, and only when it
// gets all of them) either waits until this operation is visible to it, or takes the rows
// first, and then this insert finds them, or some of them, no longer the run's. So a run that
// lost its turn, whole or in part, can never start a tool, and recovery never misses an
// operation that started: a write tool cannot run in a run whose turn is replayed elsewhere.
//
// In the same transaction (endOperationsSQL before it, in one round trip) it writes the ends
// of the turn's tool calls that returned since the turn's last statement, whether or not the
// new one is recorded: a tool call's end costs no transaction of its own.
const recordOperationSQL = `
WITH held AS (
    SELECT id FROM agent_outbox
    WHERE conversation_id = $2 AND run_id = $1 AND id = ANY($6) AND status = 'processing' AND lease_expires_at > now()
    FOR SHARE
)
INSERT INTO operations (run_id, conversation_id, tool, effect, input)
SELECT $1, $2, $3, $4, $5
WHERE (SELECT count(*) FROM held) = cardinality($6::bigint[])
RETURNING id`

// recordOperationsSQL is recordOperationSQL for several tool calls ($1-$7, one per call, $7
// its order) of distinct runs or not, in one statement. $8-$10 list each run's claimed rows
// once (row id, run, conversation). Each call is recorded only when its run holds every row
// it claimed with a live lease ($6: how many it claimed), by the same FOR SHARE rule, the rows
// locked in id order. The calls are inserted in their order, so the ids returned for one run,
// ascending, belong to its recorded calls in their order.
const recordOperationsSQL = `
WITH input AS (
    SELECT * FROM unnest($1::uuid[], $2::text[], $3::text[], $4::text[], $5::jsonb[], $6::int[], $7::int[])
        AS i(run_id, conversation_id, tool, effect, input, n, ord)
), held AS (
    SELECT o.id, o.run_id FROM agent_outbox o
    JOIN unnest($8::bigint[], $9::uuid[], $10::text[]) AS r(id, run_id, conversation_id)
        ON o.id = r.id AND o.run_id = r.run_id AND o.conversation_id = r.conversation_id
    WHERE o.id = ANY($8) AND o.status = 'processing' AND o.lease_expires_at > now()
    ORDER BY o.id
    FOR SHARE OF o
), holds AS (
    SELECT run_id, count(*) AS n FROM held GROUP BY run_id
)
INSERT INTO operations (run_id, conversation_id, tool, effect, input)
SELECT i.run_id, i.conversation_id, i.tool, i.effect, i.input
FROM input i JOIN holds h ON h.run_id = i.run_id AND h.n = i.n
ORDER BY i.ord
RETURNING run_id, id`

// endOperationsSQL records the ends of tool calls ($1: operation ids) as $2 (done or error),
// with output $3 (JSON text, NULL for none) and error $4 (NULL for none). finished_at is
// started_at plus $5 microseconds: the time the worker measured from just before it recorded
// the call to the call's end, which is written later, in the transaction of the turn's next
// statement (recordOperationSQL, finishSQL), or alone before a run ends otherwise.
const endOperationsSQL = `
UPDATE operations op SET status = e.status, output = e.output::jsonb, error = e.error,
    finished_at = op.started_at + e.took_us * interval '1 microsecond'
FROM unnest($1::bigint[], $2::text[], $3::text[], $4::text[], $5::bigint[]) AS e(id, status, output, error, took_us)
WHERE op.id = ANY($1) AND op.id = e.id`

// Reads: history, the sources' look for pending work, the states of held events' rows.

// historiesSQL reads the histories of turns ($1: conversation, $2: run, $3: at most how many
// messages, $4: the turn's place in the result; one element per turn), each oldest first:
// the conversation's user messages whose turns ended (done or error) before this turn's claim,
// each followed by its reply or visible error, in the order their turns were claimed (the runs'
// claim_order, migration 13); within a turn, in the order it claimed them (outbox id). Never a
// message pending at the claim, nor one this turn claimed; the newest $3 messages of all that.
//
//   - claimed: the turns before this one, walking back from its own claim over the index of
//     claim orders, at most $3 of those that ended rows (each has at least one message to
//     show), and their rows by primary key. A row counts for the run that ended it: a run's
//     rows that went back to pending belong to whichever run claimed them next.
//   - earlier: the rest from before claim order was recorded (runs claimed before migration 13,
//     finished rows that name no run, adopted histories), first, by created_at then id: every
//     message of the conversation except user messages whose row is not terminal or was ended by
//     a claim-ordered run, and replies of such runs (found by agent_outbox_reply). Read only
//     when claimed has fewer than $3 messages and the conversation has such runs or rows (its
//     first run has no claim order, or agent_outbox_unrun, which gets no new entries, holds a
//     row of it: two index probes), and
//     only before the conversation's first claim-ordered run started: everything from before
//     claim order was written then (a turn of the conversation ends before the next is
//     claimed), and what comes after, a backlog sent later above all, is never scanned.
//
// The OFFSET 0 of earlier's checks keeps each a probe per message: without it, at a few hundred
// thousand runs, the planner made the replies' check a hashed subplan, which reads the whole
// outbox and every run once per history read that gets that far (make test-long).
//
// A turn whose run is not found (its conversation was deleted, and perhaps created again)
// gets no history.
const historiesSQL = `
WITH turn AS (
    SELECT i.conversation_id, i.lim, i.ord, r.claim_order
    FROM unnest($1::text[], $2::uuid[], $3::int[], $4::int[]) AS i(conversation_id, run_id, lim, ord)
    LEFT JOIN agent_runs r ON r.run_id = i.run_id AND r.conversation_id = i.conversation_id
), claimed AS MATERIALIZED (
    SELECT t.ord, h.k1, h.k2, h.id, h.role, h.content, h.created_at
    FROM turn t CROSS JOIN LATERAL (
        SELECT x.*, row_number() OVER (ORDER BY x.k1 DESC, x.k2 DESC, x.created_at DESC, x.id DESC) AS back
        FROM (SELECT r.run_id, r.claim_order, r.outbox_ids FROM agent_runs r
              WHERE r.conversation_id = t.conversation_id AND r.claim_order < t.claim_order
                AND EXISTS (SELECT FROM agent_outbox o WHERE o.id = ANY(r.outbox_ids)
                              AND o.run_id = r.run_id AND o.status IN ('done', 'error'))
              ORDER BY r.claim_order DESC LIMIT t.lim) r
        CROSS JOIN LATERAL (
            SELECT r.claim_order AS k1, o.id AS k2, m.id, m.role, m.content, m.created_at
            FROM agent_outbox o JOIN messages m ON m.id = o.message_id
            WHERE o.id = ANY(r.outbox_ids) AND o.run_id = r.run_id AND o.status IN ('done', 'error')
            UNION ALL
            SELECT r.claim_order, 9223372036854775807, m.id, m.role, m.content, m.created_at
            FROM messages m
            WHERE m.id IN (SELECT o.reply_id FROM agent_outbox o WHERE o.id = ANY(r.outbox_ids)
                             AND o.run_id = r.run_id AND o.status IN ('done', 'error'))) x
    ) h
    WHERE h.back <= t.lim
), earlier AS (
    SELECT t.ord, h.id, h.role, h.content, h.created_at
    FROM turn t
    CROSS JOIN LATERAL (SELECT count(*) AS n FROM claimed c WHERE c.ord = t.ord) c
    CROSS JOIN LATERAL (
        SELECT m.id, m.role, m.content, m.created_at FROM messages m
        WHERE m.conversation_id = t.conversation_id AND c.n < t.lim AND t.claim_order IS NOT NULL
          AND ((SELECT r.claim_order IS NULL FROM agent_runs r WHERE r.conversation_id = t.conversation_id
                ORDER BY r.started_at LIMIT 1)
               OR EXISTS (SELECT FROM agent_outbox o WHERE o.conversation_id = t.conversation_id
                            AND o.run_id IS NULL AND o.status IN ('done', 'error')))
          AND m.created_at < (SELECT r.started_at FROM agent_runs r
                              WHERE r.conversation_id = t.conversation_id AND r.claim_order IS NOT NULL
                              ORDER BY r.claim_order LIMIT 1)
          AND CASE WHEN m.role = 'user' THEN NOT EXISTS (
                       SELECT FROM agent_outbox o WHERE o.message_id = m.id
                         AND (o.status NOT IN ('done', 'error') OR EXISTS (
                             SELECT FROM agent_runs r WHERE r.run_id = o.run_id AND r.claim_order IS NOT NULL))
                       OFFSET 0)
                   ELSE NOT EXISTS (
                       SELECT FROM agent_outbox o JOIN agent_runs r ON r.run_id = o.run_id
                       WHERE o.reply_id = m.id AND r.claim_order IS NOT NULL OFFSET 0) END
        ORDER BY m.created_at DESC, m.id DESC LIMIT greatest(t.lim - c.n, 0)) h
)
SELECT ord, id, role, content, created_at FROM (
    SELECT ord, 1 AS part, k1, k2, created_at, id, role, content FROM claimed
    UNION ALL
    SELECT ord, 0, 0, 0, created_at, id, role, content FROM earlier) h
ORDER BY ord, part, k1, k2, created_at, id`

// pendingConversationsSQL lists up to $2 conversations whose oldest pending row is claimable
// (not backing off) and at least $1 milliseconds old, with when that row was written, oldest
// first (by that row's id, the order claims take rows in); busy conversations (a run holds rows
// of theirs) are left out. Rows younger than $1 do not count: a conversation's oldest pending row
// is its first one old enough.
//
// It costs the page, not the backlog (grouping every pending row cost about 150 ms at
// 100,000 rows, and the polling source polls again 10 ms later while pages are full):
//   - win: the oldest pending rows, 4 × $2 of them, in id order (agent_outbox_pending_order).
//     The first row of each conversation in it is that conversation's oldest pending row, and
//     every conversation whose oldest row comes later starts after the window; so the
//     conversations near starts, oldest first, are exactly the page's, whenever they fill it.
//     Only the oldest of them are checked for busy runs, one index probe each, until the page
//     is full (the OFFSET 0 keeps the check above the sort);
//   - far: only when near does not fill the page and the window did not hold every pending row
//     (the oldest rows belong to few conversations, or to busy or backing-off ones), every
//     conversation with pending rows is visited once, at its oldest row, by a skip scan over
//     agent_outbox_pending_head: it costs the conversations, not their rows.
//
// The gates are one-time filters: far's skip scan does not start unless its branch is taken.
const pendingConversationsSQL = `
WITH RECURSIVE win AS MATERIALIZED (
    SELECT id, conversation_id, created_at, available_at FROM agent_outbox
    WHERE status = 'pending' AND created_at <= now() - $1 * interval '1 millisecond'
    ORDER BY id LIMIT 4 * $2
), near AS MATERIALIZED (
    SELECT h.id, h.conversation_id, h.created_at FROM (
        SELECT * FROM (SELECT DISTINCT ON (conversation_id) id, conversation_id, created_at, available_at
                       FROM win ORDER BY conversation_id, id) d
        WHERE available_at <= now() OR NOT isfinite(available_at)
        ORDER BY id OFFSET 0) h
    WHERE NOT coalesce((SELECT true FROM agent_outbox b
                        WHERE b.conversation_id = h.conversation_id AND b.status = 'processing' LIMIT 1), false)
    ORDER BY h.id LIMIT $2
), heads AS (
    (SELECT conversation_id, id, created_at, available_at FROM agent_outbox
     WHERE status = 'pending' AND created_at <= now() - $1 * interval '1 millisecond'
     ORDER BY conversation_id, id LIMIT 1)
    UNION ALL
    SELECT n.* FROM heads p CROSS JOIN LATERAL (
        SELECT o.conversation_id, o.id, o.created_at, o.available_at FROM agent_outbox o
        WHERE o.status = 'pending' AND o.created_at <= now() - $1 * interval '1 millisecond'
          AND o.conversation_id > p.conversation_id
        ORDER BY o.conversation_id, o.id LIMIT 1) n
), far AS (
    SELECT h.id, h.conversation_id, h.created_at FROM (
        SELECT * FROM heads WHERE available_at <= now() OR NOT isfinite(available_at)
        ORDER BY id OFFSET 0) h
    WHERE NOT coalesce((SELECT true FROM agent_outbox b
                        WHERE b.conversation_id = h.conversation_id AND b.status = 'processing' LIMIT 1), false)
    ORDER BY h.id LIMIT $2
), enough AS (
    SELECT (SELECT count(*) FROM near) = $2 OR (SELECT count(*) FROM win) < 4 * $2 AS near_is_all
)
SELECT conversation_id, created_at FROM (
    SELECT id, conversation_id, created_at FROM near WHERE (SELECT near_is_all FROM enough)
    UNION ALL
    SELECT id, conversation_id, created_at FROM far WHERE NOT (SELECT near_is_all FROM enough)
) page
ORDER BY id`

// oldestPendingSQL is the age in seconds of the oldest pending row, the first in id order (0
// when none): one probe of agent_outbox_pending_order, not a read of every pending row.
const oldestPendingSQL = `SELECT coalesce((SELECT extract(epoch FROM now() - created_at) FROM agent_outbox
	WHERE status = 'pending' ORDER BY id LIMIT 1), 0)`

// statesSQL reads the status and available_at of outbox rows ($1).
const statesSQL = `SELECT id, status, available_at FROM agent_outbox WHERE id = ANY($1)`

// tablesSchemaSQL answers the schema in which the connection's search_path finds
// agent_outbox, or "" when it finds none.
const tablesSchemaSQL = `SELECT coalesce((SELECT n.nspname::text FROM pg_class c
	JOIN pg_namespace n ON n.oid = c.relnamespace WHERE c.oid = to_regclass('agent_outbox')), '')`
