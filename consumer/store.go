package consumer

import (
	"context"
	"crypto/rand"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"strings"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/batonhq/baton/wire"
)

// store holds the SQL of claims, leases, final commits and recovery. Every statement that
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
	// lockTimeout bounds how long a claim or a final commit waits for a row lock; zero:
	// defaultLockTimeout.
	lockTimeout time.Duration
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

// claimReq asks to claim a conversation for a new run.
type claimReq struct {
	conversationID string
	runID          string
}

// claim is what one claim returned.
type claim struct {
	locked   bool // this worker held the conversation's lock for the claim
	busy     bool // a run of another worker holds the conversation
	ids      []int64
	attempts int       // the highest attempt number among the claimed rows
	messages []Message // the claimed user messages, in id order
	// oversize: the claim holds one message larger than maxBytes, without its content.
	oversize bool
	// unreadable: the claimed messages could not be decoded; the run ends as a visible
	// failure without a handler call.
	unreadable bool
	// waitUntil: nothing was claimed because the conversation's oldest pending row backs off
	// until then.
	waitUntil time.Time
}

// lockConversationsSQL takes the conversations' claim locks and records, for the rest of the
// transaction, which ones it got; SKIP LOCKED makes a concurrent claimer give up at once
// instead of queueing behind us. It also sets, for the claim transaction only:
//   - plan_cache_mode: the claim statement runs its cached generic plan (see genericPlansSQL);
//   - lock_timeout ($2): a row some other transaction holds for long fails the claim (55P03)
//     instead of stalling every claim behind it; the batch is then claimed apart;
//   - synchronous_commit off: the claim does not wait for its WAL to reach disk. A claim that
//     a database crash loses is harmless: its rows are pending again, and the run's fenced
//     final commit fails, so nothing of it is kept. Whatever the run does that matters commits
//     synchronously later (its tool operations, its final commit), and flushing that WAL
//     flushes the claim's before it.
const lockConversationsSQL = `
SELECT set_config('baton.claim_locked', coalesce(json_agg(id), '[]')::text, true),
       set_config('plan_cache_mode', 'force_generic_plan', true),
       set_config('lock_timeout', $2, true),
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
    RETURNING o.id, o.conversation_id, o.attempts, o.message_id, conv.run_id
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
       (SELECT q.available_at FROM queue q WHERE q.conversation_id = i.conversation_id AND q.n = 1 AND q.blocked)
FROM input i
LEFT JOIN conv ON conv.id = i.conversation_id
LEFT JOIN claimed c ON c.conversation_id = i.conversation_id
LEFT JOIN messages m ON m.id = c.message_id
GROUP BY i.conversation_id, conv.id`

// claimMany claims several conversations, each for its own run, in one round trip: for each,
// an ordered, capped prefix of its pending rows (see claimSQL), unless another run holds the
// conversation. The returned ids define the turn. The conversations must be distinct.
//
// Both statements go in one pipelined batch, which Postgres runs as one implicit transaction:
// the locks are held until the claim commits, and the claim statement still gets a snapshot of
// its own, taken after the locks. When a shared claim fails, each conversation is claimed on
// its own, so one conversation's trouble never stops another's claims.
func (s *store) claimMany(ctx context.Context, reqs []claimReq) ([]claim, error) {
	out, err := s.claimAll(ctx, reqs)
	if err == nil {
		return out, nil
	}
	s.unclaim(ctx, reqs) // in case it committed and only the answer was lost
	if len(reqs) == 1 {
		return nil, fmt.Errorf("claim conversation %q: %w", reqs[0].conversationID, err)
	}
	if ctx.Err() != nil {
		return nil, fmt.Errorf("claim %d conversations: %w", len(reqs), err)
	}
	// A claim has no effect outside its transaction, so claiming apart is always safe. A
	// conversation whose own claim fails comes back unlocked: its events wait and retry.
	out = make([]claim, len(reqs))
	for i := range reqs {
		one, err := s.claimAll(ctx, reqs[i:i+1])
		if err != nil {
			s.unclaim(ctx, reqs[i:i+1])
			continue
		}
		out[i] = one[0]
	}
	return out, nil
}

// unclaim undoes whatever a claim whose answer was lost (the connection failed, or the
// deadline passed, after it committed) did for reqs' runs: their rows go back to pending with
// the attempt refunded, and their run records go (no handler ever saw them), so the run ids
// can be claimed with again. Best effort, on a context of its own since the claim's may have
// ended: rows it cannot reach are recovered when their lease ends.
func (s *store) unclaim(ctx context.Context, reqs []claimReq) {
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 5*time.Second)
	defer cancel()
	runs := make([]string, len(reqs))
	for i, r := range reqs {
		runs[i] = r.runID
	}
	batch := &pgx.Batch{}
	batch.Queue(`UPDATE agent_outbox SET status = 'pending', run_id = NULL, lease_expires_at = NULL,
		attempts = greatest(attempts - 1, 0) WHERE run_id = ANY($1::uuid[]) AND status = 'processing'`, runs)
	batch.Queue(`DELETE FROM agent_runs WHERE run_id = ANY($1::uuid[]) AND finished_at IS NULL`, runs)
	_ = s.pool.SendBatch(ctx, batch).Close()
}

// claimAll runs the claim of reqs as one transaction.
func (s *store) claimAll(ctx context.Context, reqs []claimReq) ([]claim, error) {
	convs := make([]string, len(reqs))
	runs := make([]string, len(reqs))
	for i, r := range reqs {
		convs[i], runs[i] = r.conversationID, r.runID
	}
	batch := &pgx.Batch{}
	batch.Queue(lockConversationsSQL, convs, s.lockTimeoutSetting())
	batch.Queue(claimSQL, convs, runs, s.lease.Milliseconds(), s.worker, s.maxRows, s.maxBytes)
	br := s.pool.SendBatch(ctx, batch)
	byConv := make(map[string]claim, len(reqs))
	_, err := br.Exec() // held by a concurrent claimer, or deleted: the claim takes nothing there
	if err == nil {
		var rows pgx.Rows
		rows, err = br.Query()
		if err == nil {
			for rows.Next() {
				var conv string
				var c claim
				var raw []byte
				var wait *time.Time
				if err = rows.Scan(&conv, &c.locked, &c.busy, &c.ids, &c.attempts, &raw, &c.oversize, &wait); err != nil {
					break
				}
				// The claim has committed: a conversation whose messages cannot be decoded
				// still comes back with its rows, to be ended, and the others are unaffected.
				if len(raw) > 0 && json.Unmarshal(raw, &c.messages) != nil {
					c.messages, c.unreadable = nil, true
				}
				if wait != nil {
					c.waitUntil = *wait
				}
				byConv[conv] = c
			}
			rows.Close()
			if err == nil {
				err = rows.Err()
			}
		}
	}
	if cerr := br.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		return nil, err
	}
	out := make([]claim, len(reqs))
	for i, r := range reqs {
		out[i] = byConv[r.conversationID]
	}
	return out, nil
}

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

// renew extends the lease of run's rows; false means the run lost them, all or some
// (recovered or reclaimed), and must stop.
func (s *store) renew(ctx context.Context, conversationID, runID string, ids []int64) (bool, error) {
	tag, err := s.pool.Exec(ctx, renewSQL, conversationID, runID, ids, s.lease.Milliseconds())
	if err != nil {
		return false, fmt.Errorf("renew lease of run %s: %w", runID, err)
	}
	return tag.RowsAffected() == int64(len(ids)), nil
}

// Message is one message of a conversation.
type Message struct {
	ID        string
	Role      string
	Content   string
	CreatedAt time.Time
}

// errLeaseLost is returned when a run's rows are no longer its own at commit.
var errLeaseLost = errors.New("lease lost: the run's rows were recovered or reclaimed")

// errConversationGone is returned when the conversation was deleted during the turn.
var errConversationGone = errors.New("conversation deleted during the turn")

// outcome is how a run ends in one transaction: a reply (role assistant, rows done) or a
// visible failure (role error, rows error).
type outcome struct {
	role    string // "assistant" or "error"
	content string
	reason  string // last_error for failures
}

// genericPlansSQL makes the statements after it in the transaction run their cached generic
// plan. Postgres otherwise keeps planning the claim and final-commit statements afresh on
// every execution (about a millisecond each): their generic plans, costed for arrays of
// unknown length, never look cheaper than a custom plan for a one-element array, though
// they are the same index probes.
//
// It also sets lock_timeout ($1) for the final commit: a conversation row that another
// transaction holds for long fails the commit (55P03) instead of stalling it, and every
// final commit queued behind it; a shared commit is then redone run by run, so only the run
// of the held conversation fails (and is recovered after its lease).
const genericPlansSQL = `SELECT set_config('plan_cache_mode', 'force_generic_plan', true), set_config('lock_timeout', $1, true)`

// finishReq is the end of one run: a reply (role assistant, rows done) or a visible failure
// (role error, rows error).
type finishReq struct {
	conversationID string
	runID          string
	ids            []int64
	outcome
	// replyID names the message that ends the run; empty: a new one is made (newReplyID).
	replyID string
}

// status is what the run's rows become.
func (r finishReq) status() string {
	if r.role == "error" {
		return "error"
	}
	return "done"
}

// replyIDPrefix starts the id of every message a worker writes (replies and visible errors):
// producer.ReservedIDPrefix, which the producer refuses in client message ids. The rest of the
// id is 128 random bits, so a reply can never collide with a client's message, nor be guessed.
const replyIDPrefix = "baton:"

// newReplyID returns a fresh id for a message of role that ends a run.
func newReplyID(role string) string {
	var b [16]byte
	_, _ = rand.Read(b[:])
	kind := "reply"
	if role == "error" {
		kind = "error"
	}
	return fmt.Sprintf("%s%s:%x", replyIDPrefix, kind, b)
}

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
//   - the runs' operations attached to their replies (any still running marked interrupted),
//     the conversations' metadata, the runs' records.
//
// One statement instead of six pipelined ones costs about a quarter less server CPU per turn
// (measured with pgbench on this schema). Every table is reached through "= ANY(array)" on an
// indexed key, so the generic plan probes indexes whatever the batch size.
const finishSQL = `
WITH input AS (
    SELECT * FROM unnest($1::text[], $2::uuid[], $3::text[], $4::text[], $5::text[], $6::text[], $7::text[], $8::text[])
        AS i(conversation_id, run_id, status, reply_id, role, content, reason, answers)
), emit AS (
    SELECT i.*, pg_logical_emit_message(true, $10, i.answers) FROM input i
), reply AS (
    INSERT INTO messages (id, conversation_id, role, content)
    SELECT reply_id, conversation_id, role, content FROM emit
    RETURNING id
), done AS (
    UPDATE agent_outbox o
    SET status = i.status, processed_at = now(), reply_id = i.reply_id, last_error = i.reason,
        lease_expires_at = NULL
    FROM input i
    WHERE o.id = ANY($9) AND o.conversation_id = ANY($1) AND o.run_id = ANY($2)
      AND o.conversation_id = i.conversation_id AND o.run_id = i.run_id AND o.status = 'processing'
    RETURNING o.run_id
), ops AS (
    UPDATE operations op SET message_id = i.reply_id,
        status = CASE WHEN op.status = 'running' THEN 'error' ELSE op.status END,
        error = CASE WHEN op.status = 'running' THEN 'interrupted: the turn ended before the tool call did' ELSE op.error END,
        finished_at = coalesce(op.finished_at, now())
    FROM input i
    WHERE op.run_id = ANY($2) AND op.run_id = i.run_id AND op.message_id IS NULL
), conv AS (
    UPDATE conversations c SET last_message_at = now(), unread_count = c.unread_count + 1
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

// finishOne commits the end of run r in one transaction: the logical message naming the
// answered rows, the reply or error message, the run's operations attached to it, the claimed
// rows terminal, the conversation's metadata and the run's record. It fails with errLeaseLost
// when any claimed row is no longer this run's, and with errConversationGone when the
// conversation was deleted; either way nothing is written. A lost connection or another
// transient error is retried (see finishRetrying).
func (s *store) finishOne(ctx context.Context, r finishReq) error {
	err := s.finishRetrying(ctx, []finishReq{r})
	if errors.Is(err, errLeaseLost) {
		if exists, qerr := conversationExists(ctx, s.pool, r.conversationID); qerr == nil && !exists {
			return errConversationGone
		}
	}
	if err != nil && !runFailed(err) {
		return fmt.Errorf("finish run %s: %w", r.runID, err)
	}
	return err
}

// finishMany ends several runs (of distinct conversations) in one statement and returns each
// one's error (see finishOne). When the shared statement fails for any reason but a transient
// one (which it retries), the runs are finished one by one, so that a run whose commit fails
// for a reason of its own (its lease, its conversation, a value Postgres refuses) fails alone
// and the others still commit.
func (s *store) finishMany(ctx context.Context, reqs []finishReq) ([]error, error) {
	errs := make([]error, len(reqs))
	if len(reqs) == 1 {
		errs[0] = s.finishOne(ctx, reqs[0])
		return errs, nil
	}
	err := s.finishRetrying(ctx, reqs)
	if err == nil {
		return errs, nil
	}
	if ctx.Err() != nil {
		return nil, fmt.Errorf("finish %d runs: %w", len(reqs), err)
	}
	// Apart, and several at a time: a run whose conversation row another transaction holds
	// waits out its lock_timeout without holding up the others.
	var wg sync.WaitGroup
	sem := make(chan struct{}, isolateConcurrency)
	for i, r := range reqs {
		sem <- struct{}{}
		wg.Go(func() {
			defer func() { <-sem }()
			errs[i] = s.finishOne(ctx, r)
		})
	}
	wg.Wait()
	return errs, nil
}

// isolateConcurrency is how many runs of a failed shared final commit are redone at once.
const isolateConcurrency = 8

// runFailed reports whether err is about one run of a final commit rather than the commit.
func runFailed(err error) bool {
	return errors.Is(err, errConversationGone) || errors.Is(err, errLeaseLost)
}

// finishRetrying runs finishSQL for reqs, retrying transient failures (see
// retryUncertain). A final commit whose outcome is unknown (the connection was lost while it
// ran, perhaps after it committed) is not simply repeated: the repeat would find the rows no
// longer processing and report a lost lease. It first asks whether the runs' replies exist —
// reply ids are unique per run, so they exist only if this commit happened.
func (s *store) finishRetrying(ctx context.Context, reqs []finishReq) error {
	replies := make([]string, len(reqs))
	for i := range reqs {
		if reqs[i].replyID == "" {
			reqs[i].replyID = newReplyID(reqs[i].role)
		}
		replies[i] = reqs[i].replyID
	}
	return retryUncertain(ctx, func() error { return s.finishIn(ctx, s.pool, reqs) }, func() (bool, error) {
		var n int
		err := s.pool.QueryRow(ctx, `SELECT count(*) FROM messages WHERE id = ANY($1)`, replies).Scan(&n)
		return n > 0, err
	})
}

// conversationExists tells a deleted conversation from a lost lease, on q (a pool or a
// transaction).
func conversationExists(ctx context.Context, q interface {
	QueryRow(context.Context, string, ...any) pgx.Row
}, id string) (bool, error) {
	var exists bool
	err := q.QueryRow(ctx, `SELECT EXISTS (SELECT 1 FROM conversations WHERE id = $1)`, id).Scan(&exists)
	return exists, err
}

// batchSender is a pool or a transaction.
type batchSender interface {
	SendBatch(ctx context.Context, b *pgx.Batch) pgx.BatchResults
}

// finishIn runs finishSQL for reqs on q (the pool, or a transaction of the caller's): all
// commit, or none. A deleted conversation fails it with errConversationGone, a run that no
// longer owns its rows with errLeaseLost. Texts Baton makes (reasons, visible errors) are
// sanitized; a reply's content is the handler's, checked before.
func (s *store) finishIn(ctx context.Context, q batchSender, reqs []finishReq) error {
	n := len(reqs)
	convs, runs, statuses, replies := make([]string, n), make([]string, n), make([]string, n), make([]string, n)
	roles, contents, reasons, answers := make([]string, n), make([]string, n), make([]*string, n), make([]string, n)
	counts := make([]int32, n)
	var ids []int64
	for i, r := range reqs {
		if r.replyID == "" {
			r.replyID = newReplyID(r.role)
		}
		convs[i], runs[i], statuses[i], replies[i] = r.conversationID, r.runID, r.status(), r.replyID
		roles[i], contents[i] = r.role, r.content
		if r.role == "error" {
			contents[i] = sanitize(r.content, maxDetailBytes)
		}
		if r.reason != "" {
			reason := sanitize(r.reason, maxDetailBytes)
			reasons[i] = &reason
		}
		a, _ := json.Marshal(struct {
			MessageID string  `json:"message_id"`
			OutboxIDs []int64 `json:"outbox_ids"`
		}{replies[i], r.ids})
		answers[i] = string(a)
		ids = append(ids, r.ids...)
		counts[i] = int32(len(r.ids))
	}
	batch := &pgx.Batch{}
	batch.Queue(genericPlansSQL, s.lockTimeoutSetting())
	batch.Queue(finishSQL, convs, runs, statuses, replies, roles, contents, reasons, answers, ids, wire.AnswersPrefix, counts)
	err := q.SendBatch(ctx, batch).Close()
	var pgErr *pgconn.PgError
	switch {
	case errors.As(err, &pgErr) && pgErr.Code == "23503": // foreign_key_violation
		return errConversationGone
	case errors.As(err, &pgErr) && pgErr.Code == "BT001": // baton_fence
		return errLeaseLost
	}
	return err
}

// transient reports whether err may go away when the same statement is tried again: the
// connection could not be made, failed or was lost, or Postgres answered with a serialization
// failure, a deadlock, a shutdown or too many connections. Context errors are not transient:
// the caller gave up.
func transient(err error) bool {
	if err == nil || errors.Is(err, context.Canceled) || errors.Is(err, context.DeadlineExceeded) {
		return false
	}
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) {
		switch pgErr.Code {
		case "40001", "40P01", // serialization_failure, deadlock_detected
			"57P01", "57P02", "57P03", // admin_shutdown, crash_shutdown, cannot_connect_now
			"53300": // too_many_connections
			return true
		}
		return strings.HasPrefix(pgErr.Code, "08") // connection_exception
	}
	var connectErr *pgconn.ConnectError
	var netErr net.Error
	return pgconn.SafeToRetry(err) || errors.As(err, &connectErr) || errors.As(err, &netErr) ||
		errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF) ||
		errors.Is(err, pgconn.ErrConnClosed) || errors.Is(err, net.ErrClosed)
}

// retryUncertain runs do until it succeeds, fails for good, or ctx ends, backing off between
// tries. After a transient failure the outcome of do is unknown (a connection lost at COMMIT
// may have lost only the answer), so before trying again it asks done whether the effect is
// already there; done's own transient failures are retried the same way.
func retryUncertain(ctx context.Context, do func() error, done func() (bool, error)) error {
	wait := 20 * time.Millisecond
	var err error
	uncertain := false
	for {
		if uncertain {
			ok, cerr := done()
			switch {
			case cerr == nil && ok:
				return nil
			case cerr == nil:
				uncertain = false
			case !transient(cerr):
				return cerr
			}
		}
		if !uncertain {
			if err = do(); !transient(err) {
				return err
			}
			uncertain = true
		}
		if !sleep(ctx, wait) {
			return err
		}
		wait = min(2*wait, time.Second)
	}
}

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

// heldRow is a claimed row locked by the transaction that ends its run.
type heldRow struct {
	id       int64
	attempts int
}

// lockHeld runs sql, which locks claimed rows and returns their id and attempts, in tx.
func lockHeld(ctx context.Context, tx pgx.Tx, sql string, args ...any) ([]heldRow, error) {
	rows, err := tx.Query(ctx, sql, args...)
	if err != nil {
		return nil, err
	}
	return pgx.CollectRows(rows, func(row pgx.CollectableRow) (heldRow, error) {
		var h heldRow
		return h, row.Scan(&h.id, &h.attempts)
	})
}

// endReq ends a run that has no reply: its handler failed, the worker stopped, the run was
// lost, or its claim cannot be answered.
type endReq struct {
	conversationID, runID string
	ids                   []int64
	cause                 error // why: the handler's error, or one of this package's
	stopping              bool  // the worker is shutting down
	permanent             bool  // no attempt can succeed
	// outcome recorded for the run when no row fails visibly: "" for the rows' fate (retry or
	// released); recovery records "recovered".
	outcome string
}

// ended says what endRun did.
type ended struct {
	failed  []int64 // rows now error, answered by a visible failure
	retried []int64 // rows pending again
	result  string  // "error" when any row failed visibly, else "retry" or "released"
	reason  string  // the detail stored, redacted
}

// endRun ends a run without a reply, in one transaction that sees all of the run's rows or
// none: it locks the claimed rows, fails with errLeaseLost unless every one is still the run's,
// then applies endOfRun to each row (with the run's write operations and the row's own
// attempts) and commits together the requeued rows, the visible failure of the others (the
// error message, rows error, operations attached), the operations left running marked
// interrupted, and the run's record.
func (s *store) endRun(ctx context.Context, r endReq) (ended, error) {
	var e ended
	replyID := newReplyID("error")
	err := retryUncertain(ctx, func() error {
		return pgx.BeginFunc(ctx, s.pool, func(tx pgx.Tx) error {
			held, err := lockHeld(ctx, tx, `SELECT id, attempts FROM agent_outbox
				WHERE conversation_id = $1 AND run_id = $2 AND id = ANY($3) AND status = 'processing'
				ORDER BY id FOR UPDATE`, r.conversationID, r.runID, r.ids)
			if err != nil {
				return err
			}
			if len(held) != len(r.ids) {
				exists, err := conversationExists(ctx, tx, r.conversationID)
				if err != nil {
					return err
				}
				if !exists {
					return errConversationGone
				}
				return errLeaseLost
			}
			e, err = s.endHeld(ctx, tx, r, held, replyID)
			return err
		})
	}, func() (bool, error) {
		var outcome *string
		err := s.pool.QueryRow(ctx, `SELECT outcome FROM agent_runs WHERE run_id = $1`, r.runID).Scan(&outcome)
		return outcome != nil && *outcome != "recovered", err
	})
	if err != nil && !runFailed(err) {
		return e, fmt.Errorf("end run %s: %w", r.runID, err)
	}
	return e, err
}

// endHeld is the decision and the writes of endRun and recoverRun, in tx, for rows it holds.
func (s *store) endHeld(ctx context.Context, tx pgx.Tx, r endReq, held []heldRow, replyID string) (ended, error) {
	e := ended{reason: detail(r.cause)}
	var wrote bool
	if err := tx.QueryRow(ctx, writtenSQL, r.runID).Scan(&wrote); err != nil {
		return e, fmt.Errorf("operations of run %s: %w", r.runID, err)
	}
	interrupted := "interrupted: " + e.reason
	if r.stopping {
		interrupted = "interrupted: the worker stopped"
	}
	if _, err := tx.Exec(ctx, closeOperationsSQL, r.runID, sanitize(interrupted, maxDetailBytes)); err != nil {
		return e, fmt.Errorf("close operations of run %s: %w", r.runID, err)
	}
	var delays []int64
	var refunds []bool
	var cause error // the failure the visible rows end with: the first row's
	result := endRetry
	for _, h := range held {
		switch end := endOfRun(wrote, r.permanent, h.attempts, s.maxAttempts, r.stopping); end {
		case endFail:
			e.failed = append(e.failed, h.id)
			if cause == nil {
				cause = failure(wrote, r.permanent, h.attempts, r.cause)
			}
		default:
			e.retried = append(e.retried, h.id)
			var delay time.Duration
			if end == endRetry {
				delay = s.backoff(h.attempts)
			}
			delays = append(delays, delay.Milliseconds())
			refunds = append(refunds, end == endRelease)
			result = end
		}
	}
	e.result = result.String()
	if len(e.retried) > 0 {
		if _, err := tx.Exec(ctx, requeueSQL, e.retried, delays, e.reason, refunds); err != nil {
			return e, fmt.Errorf("requeue rows of run %s: %w", r.runID, err)
		}
	}
	if len(e.failed) == 0 {
		outcome := r.outcome
		if outcome == "" {
			outcome = e.result
		}
		_, err := tx.Exec(ctx, endRunSQL, r.runID, outcome, e.reason)
		return e, err
	}
	e.result = "error"
	e.reason = detail(cause)
	err := s.finishIn(ctx, tx, []finishReq{{conversationID: r.conversationID, runID: r.runID, ids: e.failed,
		replyID: replyID, outcome: outcome{role: "error", content: s.failureMessage(cause), reason: e.reason}}})
	return e, err
}

// leaseExpired is true for a processing row whose lease is over: expired, or never set or not a
// real time (rows Baton did not write), so that no such row keeps its conversation busy.
const leaseExpired = `(lease_expires_at IS NULL OR lease_expires_at < now() OR NOT isfinite(lease_expires_at))`

// expiredRun is a run holding processing rows whose lease expired. runID is "" for
// processing rows that name no run (not written by Baton): recovery treats them as one dead
// run of their conversation.
type expiredRun struct{ runID, conversationID string }

// expiredRuns lists runs holding processing rows whose lease expired.
func (s *store) expiredRuns(ctx context.Context, limit int) ([]expiredRun, error) {
	rows, err := s.pool.Query(ctx, `SELECT DISTINCT coalesce(run_id::text, ''), conversation_id FROM agent_outbox
		WHERE status = 'processing' AND `+leaseExpired+` LIMIT $1`, limit)
	if err != nil {
		return nil, fmt.Errorf("find expired leases: %w", err)
	}
	runs, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (expiredRun, error) {
		var e expiredRun
		return e, r.Scan(&e.runID, &e.conversationID)
	})
	if err != nil {
		return nil, fmt.Errorf("find expired leases: %w", err)
	}
	return runs, nil
}

// recovered says what recovery did with one dead run.
type recovered struct {
	conversationID string
	ids            []int64 // every row the run held; none when recovery left the run alone
	ended
}

// recoverRun applies the recovery rule to a run whose lease expired, in one transaction, to
// all of the run's rows or none:
//   - it takes the run's rows with FOR UPDATE SKIP LOCKED, and leaves the run alone unless it
//     got every processing row of the run, each with an expired lease: a renewal or a tool
//     check in flight holds some of them, and the run is not dead;
//   - then endOfRun decides for each row, as for a failed attempt (the cause is ErrWorkerLost):
//     a write operation in any status, or the row's attempts used up ⇒ a visible failure,
//     committed in this same transaction; otherwise the row goes back to pending, its run id
//     cleared, claimable after the backoff. No row is left processing under the dead run.
func (s *store) recoverRun(ctx context.Context, run expiredRun) (recovered, error) {
	r := recovered{conversationID: run.conversationID}
	replyID := newReplyID("error")
	err := retryUncertain(ctx, func() error {
		r.ids = nil
		return pgx.BeginFunc(ctx, s.pool, func(tx pgx.Tx) error {
			held, err := lockHeld(ctx, tx, `SELECT id, attempts FROM agent_outbox
				WHERE conversation_id = $1 AND run_id IS NOT DISTINCT FROM nullif($2, '')::uuid AND status = 'processing'
				  AND `+leaseExpired+`
				ORDER BY id FOR UPDATE SKIP LOCKED`, run.conversationID, run.runID)
			if err != nil || len(held) == 0 {
				return err
			}
			var all int
			if err := tx.QueryRow(ctx, `SELECT count(*) FROM agent_outbox
				WHERE conversation_id = $1 AND run_id IS NOT DISTINCT FROM nullif($2, '')::uuid AND status = 'processing'`,
				run.conversationID, run.runID).Scan(&all); err != nil {
				return err
			}
			if all != len(held) {
				return nil // part of the run is busy or alive: not ours to take now
			}
			runID := run.runID
			if runID == "" {
				// Rows that name no run: give them one, so the rule and the fence apply.
				runID = newRunID()
				ids := make([]int64, len(held))
				for i, h := range held {
					ids[i] = h.id
				}
				if _, err := tx.Exec(ctx, `UPDATE agent_outbox SET run_id = $2 WHERE id = ANY($1)`, ids, runID); err != nil {
					return err
				}
			}
			e, err := s.endHeld(ctx, tx, endReq{conversationID: run.conversationID, runID: runID, cause: ErrWorkerLost,
				outcome: "recovered"}, held, replyID)
			if err != nil {
				return err
			}
			for _, h := range held {
				r.ids = append(r.ids, h.id)
			}
			r.ended = e
			return nil
		})
	}, func() (bool, error) {
		if run.runID == "" {
			var left bool
			err := s.pool.QueryRow(ctx, `SELECT EXISTS (SELECT 1 FROM agent_outbox
				WHERE conversation_id = $1 AND run_id IS NULL AND status = 'processing')`, run.conversationID).Scan(&left)
			return !left, err
		}
		var outcome *string
		err := s.pool.QueryRow(ctx, `SELECT outcome FROM agent_runs WHERE run_id = $1`, run.runID).Scan(&outcome)
		return outcome != nil, err
	})
	if err != nil {
		if runFailed(err) {
			return recovered{conversationID: run.conversationID}, nil // the conversation was deleted: nothing to recover
		}
		return recovered{conversationID: run.conversationID}, fmt.Errorf("recover run %s: %w", run.runID, err)
	}
	return r, nil
}

// recordOperationSQL records a tool call as running, only while the run still holds every row
// it claimed ($6) with a live lease. It locks those rows FOR SHARE and inserts only when it
// got all of them: recovery (which takes a run's rows FOR UPDATE SKIP LOCKED, and only when it
// gets all of them) either waits until this operation is visible to it, or takes the rows
// first, and then this insert finds them, or some of them, no longer the run's. So a run that
// lost its turn, whole or in part, can never start a tool, and recovery never misses an
// operation that started: a write tool cannot run in a run whose turn is replayed elsewhere.
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

// recordOperation records a tool call of run as running and returns its id, or errLeaseLost
// when the run no longer holds its turn.
func (s *store) recordOperation(ctx context.Context, runID, conversationID string, ids []int64, tool string, effect Effect, input []byte) (int64, error) {
	var id int64
	err := s.pool.QueryRow(ctx, recordOperationSQL, runID, conversationID, tool, string(effect), input, ids).Scan(&id)
	switch {
	case errors.Is(err, pgx.ErrNoRows):
		return 0, fmt.Errorf("not run: %w", errLeaseLost)
	case err != nil:
		return 0, fmt.Errorf("record operation: %w", err)
	}
	return id, nil
}

// finishOperation records the end of operation id: done with its output, or error.
func (s *store) finishOperation(ctx context.Context, id int64, status string, output []byte, errText string) error {
	_, err := s.pool.Exec(ctx, `UPDATE operations SET status = $2, output = $3, error = $4, finished_at = now() WHERE id = $1`,
		id, status, output, nullIfEmpty(errText))
	return err
}

func nullIfEmpty(s string) any {
	if s == "" {
		return nil
	}
	return s
}

// history returns up to limit messages of conversation sent before first, oldest first.
func (s *store) history(ctx context.Context, conversationID string, first Message, limit int) ([]Message, error) {
	rows, err := s.pool.Query(ctx, `SELECT id, role, content, created_at FROM (
			SELECT id, role, content, created_at FROM messages
			WHERE conversation_id = $1 AND (created_at, id) < ($2, $3)
			ORDER BY created_at DESC, id DESC LIMIT $4) h
		ORDER BY created_at, id`, conversationID, first.CreatedAt, first.ID, limit)
	if err != nil {
		return nil, fmt.Errorf("load history of %q: %w", conversationID, err)
	}
	msgs, err := pgx.CollectRows(rows, pgx.RowToStructByPos[Message])
	if err != nil {
		return nil, fmt.Errorf("load history of %q: %w", conversationID, err)
	}
	return msgs, nil
}

// pendingConversation is a conversation with claimable rows, since its oldest was written.
type pendingConversation struct {
	conversationID string
	since          time.Time
}

// pendingConversations lists up to limit conversations whose oldest pending row is claimable
// (not backing off) and at least minAge old, oldest first. Busy conversations (a run holds
// rows of theirs) are left out: their claims would find nothing, and a page full of them
// would hide every other conversation from the polling source.
func (s *store) pendingConversations(ctx context.Context, minAge time.Duration, limit int) ([]pendingConversation, error) {
	rows, err := s.pool.Query(ctx, `SELECT conversation_id, min(created_at) FROM agent_outbox
		WHERE status = 'pending' AND created_at <= now() - $1 * interval '1 millisecond'
		  AND conversation_id NOT IN (SELECT conversation_id FROM agent_outbox WHERE status = 'processing')
		GROUP BY conversation_id
		HAVING (array_agg(available_at <= now() OR NOT isfinite(available_at) ORDER BY id))[1]
		ORDER BY min(id) LIMIT $2`, minAge.Milliseconds(), limit)
	if err != nil {
		return nil, fmt.Errorf("look for pending rows: %w", err)
	}
	convs, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (pendingConversation, error) {
		var p pendingConversation
		return p, r.Scan(&p.conversationID, &p.since)
	})
	if err != nil {
		return nil, fmt.Errorf("look for pending rows: %w", err)
	}
	return convs, nil
}

// oldestPending is the age of the oldest pending row (0 when none).
func (s *store) oldestPending(ctx context.Context) (time.Duration, error) {
	var age float64
	err := s.pool.QueryRow(ctx, `SELECT coalesce(extract(epoch FROM now() - min(created_at)), 0)
		FROM agent_outbox WHERE status = 'pending'`).Scan(&age)
	return time.Duration(age * float64(time.Second)), err
}

// rowState is the status of one outbox row, for resolving held events.
type rowState struct {
	status    string // "" when the row no longer exists
	available time.Time
}

func (s *store) states(ctx context.Context, ids []int64) (map[int64]rowState, error) {
	rows, err := s.pool.Query(ctx, `SELECT id, status, available_at FROM agent_outbox WHERE id = ANY($1)`, ids)
	if err != nil {
		return nil, fmt.Errorf("outbox states: %w", err)
	}
	defer rows.Close()
	out := make(map[int64]rowState, len(ids))
	for rows.Next() {
		var id int64
		var st rowState
		if err := rows.Scan(&id, &st.status, &st.available); err != nil {
			return nil, fmt.Errorf("outbox states: %w", err)
		}
		out[id] = st
	}
	return out, rows.Err()
}
