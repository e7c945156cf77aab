package console

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
)

// Every SQL statement of the console lives in this file. Tables are unqualified: the pool's
// search_path names Baton's schema (BATON_SCHEMA), as for `baton status`. Everything here only
// reads; the one write, sending, goes through producer.Send.

// Limits on what one read returns, so that no page or event grows without bound.
const (
	// maxConversations is how many conversations the chat's list shows (the most recent).
	maxConversations = 200
	// maxMessages is how many user messages of a conversation the chat shows (the latest).
	maxMessages = 200
	// maxTimelineRuns and maxTimelineOperations bound a message's timeline.
	maxTimelineRuns       = 50
	maxTimelineOperations = 200
	// maxWorkers is how many workers the system view lists.
	maxWorkers = 50
)

// clip cuts a text column to at most n characters in SQL, marking a cut with "…": any role
// that writes messages may write large ones, and a page or event carries at most maxMessages of
// them.
func clip(col string, n int) string {
	return fmt.Sprintf("CASE WHEN length(%[1]s) > %[2]d THEN left(%[1]s, %[2]d) || '…' ELSE %[1]s END", col, n)
}

// The longest texts the chat (per message and reply) and the timeline show, in characters.
const (
	chatTextChars     = 4000
	timelineTextChars = 64000
)

// Conversation is one entry of the chat's conversation list.
type Conversation struct {
	ID            string     `json:"id"`
	CreatedAt     time.Time  `json:"created_at"`
	LastMessageAt *time.Time `json:"last_message_at"`
}

const conversationsSQL = `SELECT id, created_at, last_message_at FROM conversations
	ORDER BY coalesce(last_message_at, created_at) DESC, id LIMIT $1`

func listConversations(ctx context.Context, db *pgxpool.Pool) ([]Conversation, error) {
	rows, err := db.Query(ctx, conversationsSQL, maxConversations)
	if err != nil {
		return nil, fmt.Errorf("list conversations: %w", err)
	}
	out, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (Conversation, error) {
		var c Conversation
		err := r.Scan(&c.ID, &c.CreatedAt, &c.LastMessageAt)
		return c, err
	})
	if err != nil {
		return nil, fmt.Errorf("list conversations: %w", err)
	}
	return out, nil
}

const conversationExistsSQL = `SELECT EXISTS (SELECT FROM conversations WHERE id = $1)`

func conversationExists(ctx context.Context, db *pgxpool.Pool, id string) (bool, error) {
	var ok bool
	if err := db.QueryRow(ctx, conversationExistsSQL, id).Scan(&ok); err != nil {
		return false, fmt.Errorf("look up conversation: %w", err)
	}
	return ok, nil
}

// messageRow is what messagesSQL and messageRowSQL read of one user message: the message, its
// outbox row, the run holding the row and the reply or error message answering it.
type messageRow struct {
	ID             string
	ConversationID string
	Content        string
	CreatedAt      time.Time

	OutboxID       *int64
	Status         *string
	Attempts       *int
	AvailableAt    *time.Time
	LeaseExpiresAt *time.Time
	RunID          *string
	Worker         *string
	RunStartedAt   *time.Time

	ReplyID        *string
	ReplyRole      *string
	ReplyContent   *string
	ReplyCreatedAt *time.Time
}

// messageColumns is shared by messagesSQL and messageRowSQL. last_error is never read: it
// holds internal error text, which no page shows (the error message in the conversation,
// reply_id, holds the generic text users see).
var messageColumns = `m.id, m.conversation_id, ` + clip("m.content", chatTextChars) + `, m.created_at,
	o.id, o.status, o.attempts, o.available_at, o.lease_expires_at, o.run_id::text, r.worker, r.started_at,
	p.id, p.role, ` + clip("p.content", chatTextChars) + `, p.created_at
	FROM messages m
	LEFT JOIN agent_outbox o ON o.message_id = m.id
	LEFT JOIN agent_runs r ON r.run_id = o.run_id
	LEFT JOIN messages p ON p.id = o.reply_id`

// messagesSQL reads the latest user messages of a conversation, oldest first.
var messagesSQL = `SELECT * FROM (SELECT ` + messageColumns + `
	WHERE m.conversation_id = $1 AND m.role = 'user'
	ORDER BY m.created_at DESC, m.id DESC LIMIT $2) x ORDER BY 4, 1`

var messageRowSQL = `SELECT ` + messageColumns + ` WHERE m.id = $1`

func scanMessageRow(r pgx.CollectableRow) (messageRow, error) {
	var m messageRow
	err := r.Scan(&m.ID, &m.ConversationID, &m.Content, &m.CreatedAt,
		&m.OutboxID, &m.Status, &m.Attempts, &m.AvailableAt, &m.LeaseExpiresAt, &m.RunID, &m.Worker, &m.RunStartedAt,
		&m.ReplyID, &m.ReplyRole, &m.ReplyContent, &m.ReplyCreatedAt)
	return m, err
}

func conversationMessages(ctx context.Context, db *pgxpool.Pool, conversationID string) ([]messageRow, error) {
	rows, err := db.Query(ctx, messagesSQL, conversationID, maxMessages)
	if err != nil {
		return nil, fmt.Errorf("read messages: %w", err)
	}
	out, err := pgx.CollectRows(rows, scanMessageRow)
	if err != nil {
		return nil, fmt.Errorf("read messages: %w", err)
	}
	return out, nil
}

// errNotFound is a message or conversation that does not exist.
var errNotFound = errors.New("not found")

// Timeline is one message's journey, read from the database.
type Timeline struct {
	Message TimelineMessage `json:"message"`
	Outbox  *TimelineOutbox `json:"outbox"`
	Runs    []TimelineRun   `json:"runs"`
	Ops     []TimelineOp    `json:"operations"`
	Reply   *TimelineReply  `json:"reply"`
	Entries []TimelineEntry `json:"entries"`
	State   string          `json:"state"`
}

// TimelineMessage is the message itself.
type TimelineMessage struct {
	ID             string    `json:"id"`
	ConversationID string    `json:"conversation_id"`
	Role           string    `json:"role"`
	Content        string    `json:"content"`
	CreatedAt      time.Time `json:"created_at"`
}

// TimelineOutbox is the message's outbox row, without last_error (internal text).
type TimelineOutbox struct {
	ID             int64      `json:"id"`
	Status         string     `json:"status"`
	Attempts       int        `json:"attempts"`
	CreatedAt      time.Time  `json:"created_at"`
	AvailableAt    time.Time  `json:"available_at"`
	ProcessedAt    *time.Time `json:"processed_at"`
	RunID          *string    `json:"run_id"`
	LeaseExpiresAt *time.Time `json:"lease_expires_at"`
}

// TimelineRun is a run that claimed the message's outbox row, without its error (internal text).
type TimelineRun struct {
	RunID      string     `json:"run_id"`
	Worker     string     `json:"worker"`
	StartedAt  time.Time  `json:"started_at"`
	FinishedAt *time.Time `json:"finished_at"`
	Outcome    *string    `json:"outcome"`
}

// TimelineOp is one tool operation of those runs, without input, output or error.
type TimelineOp struct {
	ID         int64      `json:"id"`
	RunID      string     `json:"run_id"`
	Tool       string     `json:"tool"`
	Effect     string     `json:"effect"`
	Status     string     `json:"status"`
	StartedAt  time.Time  `json:"started_at"`
	FinishedAt *time.Time `json:"finished_at"`
}

// TimelineReply is the assistant or error message that answered the row.
type TimelineReply struct {
	ID        string    `json:"id"`
	Role      string    `json:"role"`
	Content   string    `json:"content"`
	CreatedAt time.Time `json:"created_at"`
}

var timelineMessageSQL = `SELECT id, conversation_id, role, ` + clip("content", timelineTextChars) + `, created_at FROM messages WHERE id = $1`

// timelineOutboxSQL finds the outbox row of a user message, or the one a reply answered.
const timelineOutboxSQL = `SELECT id, status, attempts, created_at, available_at, processed_at, run_id::text,
	lease_expires_at, reply_id FROM agent_outbox WHERE message_id = $1 OR reply_id = $1
	ORDER BY (message_id = $1) DESC LIMIT 1`

const timelineRunsSQL = `SELECT run_id::text, worker, started_at, finished_at, outcome FROM agent_runs
	WHERE conversation_id = $1 AND $2::bigint = ANY (outbox_ids) ORDER BY started_at, run_id LIMIT $3`

const timelineOpsSQL = `SELECT id, run_id::text, tool, effect, status, started_at, finished_at FROM operations
	WHERE conversation_id = $1 AND run_id = ANY ($2::uuid[]) ORDER BY started_at, id LIMIT $3`

var timelineReplySQL = `SELECT id, role, ` + clip("content", timelineTextChars) + `, created_at FROM messages WHERE id = $1`

func readTimeline(ctx context.Context, db *pgxpool.Pool, id string) (*Timeline, error) {
	tl := &Timeline{Runs: []TimelineRun{}, Ops: []TimelineOp{}}
	m := &tl.Message
	err := db.QueryRow(ctx, timelineMessageSQL, id).Scan(&m.ID, &m.ConversationID, &m.Role, &m.Content, &m.CreatedAt)
	if errors.Is(err, pgx.ErrNoRows) {
		return nil, errNotFound
	}
	if err != nil {
		return nil, fmt.Errorf("read message: %w", err)
	}
	var o TimelineOutbox
	var replyID *string
	err = db.QueryRow(ctx, timelineOutboxSQL, id).Scan(&o.ID, &o.Status, &o.Attempts, &o.CreatedAt, &o.AvailableAt,
		&o.ProcessedAt, &o.RunID, &o.LeaseExpiresAt, &replyID)
	switch {
	case errors.Is(err, pgx.ErrNoRows):
		tl.finish()
		return tl, nil
	case err != nil:
		return nil, fmt.Errorf("read outbox row: %w", err)
	}
	tl.Outbox = &o
	rows, err := db.Query(ctx, timelineRunsSQL, m.ConversationID, o.ID, maxTimelineRuns)
	if err != nil {
		return nil, fmt.Errorf("read runs: %w", err)
	}
	tl.Runs, err = pgx.CollectRows(rows, func(r pgx.CollectableRow) (TimelineRun, error) {
		var run TimelineRun
		err := r.Scan(&run.RunID, &run.Worker, &run.StartedAt, &run.FinishedAt, &run.Outcome)
		return run, err
	})
	if err != nil {
		return nil, fmt.Errorf("read runs: %w", err)
	}
	runIDs := make([]string, len(tl.Runs))
	for i, r := range tl.Runs {
		runIDs[i] = r.RunID
	}
	rows, err = db.Query(ctx, timelineOpsSQL, m.ConversationID, runIDs, maxTimelineOperations)
	if err != nil {
		return nil, fmt.Errorf("read operations: %w", err)
	}
	tl.Ops, err = pgx.CollectRows(rows, func(r pgx.CollectableRow) (TimelineOp, error) {
		var op TimelineOp
		err := r.Scan(&op.ID, &op.RunID, &op.Tool, &op.Effect, &op.Status, &op.StartedAt, &op.FinishedAt)
		return op, err
	})
	if err != nil {
		return nil, fmt.Errorf("read operations: %w", err)
	}
	if replyID != nil {
		var rp TimelineReply
		err := db.QueryRow(ctx, timelineReplySQL, *replyID).Scan(&rp.ID, &rp.Role, &rp.Content, &rp.CreatedAt)
		switch {
		case errors.Is(err, pgx.ErrNoRows): // deleted meanwhile
		case err != nil:
			return nil, fmt.Errorf("read reply: %w", err)
		default:
			tl.Reply = &rp
		}
	}
	tl.finish()
	return tl, nil
}

// Worker is a worker seen in agent_runs lately.
type Worker struct {
	Name     string    `json:"name"`
	Runs     int64     `json:"runs"`
	Open     int64     `json:"open"`
	LastSeen time.Time `json:"last_seen"`
}

// workersSQL lists the workers that started a run in the last hour.
const workersSQL = `SELECT worker, count(*), count(*) FILTER (WHERE finished_at IS NULL), max(started_at)
	FROM agent_runs WHERE started_at > now() - interval '1 hour'
	GROUP BY worker ORDER BY max(started_at) DESC, worker LIMIT $1`

func readWorkers(ctx context.Context, db *pgxpool.Pool) ([]Worker, error) {
	rows, err := db.Query(ctx, workersSQL, maxWorkers)
	if err != nil {
		return nil, fmt.Errorf("read workers: %w", err)
	}
	out, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (Worker, error) {
		var w Worker
		err := r.Scan(&w.Name, &w.Runs, &w.Open, &w.LastSeen)
		return w, err
	})
	if err != nil {
		return nil, fmt.Errorf("read workers: %w", err)
	}
	return out, nil
}

// SeriesPoint is one bucket of the system view's chart.
type SeriesPoint struct {
	// At is the bucket's start.
	At time.Time `json:"at"`
	// TurnsPerSecond is the outbox rows finished (done or error) in the bucket, per second.
	TurnsPerSecond float64 `json:"turns_per_second"`
	// LatencySeconds is the median time from a row's creation to its end, for rows finished
	// in the bucket; nil when none did.
	LatencySeconds *float64 `json:"latency_seconds"`
}

// seriesSQL buckets the outbox rows finished in the last $1 seconds by $2 seconds. It scans the
// rows processed in the window; processed_at has no index, which costs a scan of agent_outbox
// per refresh of the system view.
const seriesSQL = `SELECT to_timestamp(floor(extract(epoch FROM processed_at) / $2) * $2) AS at,
	count(*), percentile_cont(0.5) WITHIN GROUP (ORDER BY extract(epoch FROM processed_at - created_at))
	FROM agent_outbox WHERE status IN ('done', 'error') AND processed_at > now() - make_interval(secs => $1)
	GROUP BY 1 ORDER BY 1`

func readSeries(ctx context.Context, db *pgxpool.Pool, window, bucket time.Duration) ([]SeriesPoint, error) {
	rows, err := db.Query(ctx, seriesSQL, window.Seconds(), bucket.Seconds())
	if err != nil {
		return nil, fmt.Errorf("read turn series: %w", err)
	}
	out, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (SeriesPoint, error) {
		var p SeriesPoint
		var n int64
		err := r.Scan(&p.At, &n, &p.LatencySeconds)
		p.TurnsPerSecond = float64(n) / bucket.Seconds()
		return p, err
	})
	if err != nil {
		return nil, fmt.Errorf("read turn series: %w", err)
	}
	return out, nil
}

func readMessageRow(ctx context.Context, db *pgxpool.Pool, id string) (messageRow, error) {
	rows, err := db.Query(ctx, messageRowSQL, id)
	if err != nil {
		return messageRow{}, fmt.Errorf("read message: %w", err)
	}
	m, err := pgx.CollectExactlyOneRow(rows, scanMessageRow)
	if errors.Is(err, pgx.ErrNoRows) {
		return messageRow{}, errNotFound
	}
	if err != nil {
		return messageRow{}, fmt.Errorf("read message: %w", err)
	}
	return m, nil
}
