package console

import (
	"context"
	"errors"
	"fmt"
	"strconv"
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
//
// It reads only the value's first n+1 characters: substr of a stored (TOASTed) value fetches,
// and decompresses, only the prefix it needs (in UTF-8 at most 4×(n+1) bytes), where length
// and left read the whole value, so that a 1 MB message cost 1 MB on every read that showed it.
// The slice is taken once per row: a function in FROM is not inlined (a plain subquery would
// be, taking the slice once for length and again for left).
func clip(col string, n int) string {
	return fmt.Sprintf("(SELECT CASE WHEN length(s) > %[2]d THEN left(s, %[2]d) || '…' ELSE s END FROM substr(%[1]s, 1, %[3]d) AS s)",
		col, n, n+1)
}

// The longest texts the chat (per message and reply) and the timeline show, in characters.
// nameChars bounds the names workers write and every page shows (agent_runs.worker,
// operations.tool): baton_worker may write any text there, and a whole 8 MB name would ride on
// every stream event, timeline and status.
const (
	chatTextChars     = 4000
	timelineTextChars = 64000
	nameChars         = 200
)

// Conversation is one entry of the chat's conversation list.
type Conversation struct {
	ID            string     `json:"id"`
	CreatedAt     time.Time  `json:"created_at"`
	LastMessageAt *time.Time `json:"last_message_at"`
}

// conversationsSQL lists the newest conversations first, by creation: an index scan of
// conversations_created (migration 9). Ordering by last activity would need an index on
// last_message_at, which every worker commit updates: each would then be a non-HOT update of
// conversations, a cost on the core path for a console feature.
const conversationsSQL = `SELECT id, created_at, last_message_at FROM conversations
	ORDER BY created_at DESC, id LIMIT $1`

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

	// MessageVersion and ReplyVersion are the xmin of the message's row and of the reply's:
	// every update of a row writes a new version with a new xmin, so a row whose versions
	// (and reply id) are the ones a stream read has the contents it read (see rowCache).
	MessageVersion uint32
	ReplyVersion   *uint32
}

// messageSelect is the select list and joins shared by messagesSQL, messageRowSQL,
// messageVersionsSQL and messagesByIDSQL; without contents, the two contents are NULL and
// neither message's content is read. last_error is never read: it holds internal error text,
// which no page shows (the error message in the conversation, reply_id, holds the generic
// text users see).
//
// The reply is read only when it is an assistant or error message of the row's own
// conversation: baton_worker may set reply_id to any message, and the key on reply_id checks
// only that it exists, so without these conditions a row could show another conversation's
// words as its answer.
func messageSelect(contents bool) string {
	content, replyContent := "NULL::text", "NULL::text"
	if contents {
		content, replyContent = clip("m.content", chatTextChars), clip("p.content", chatTextChars)
	}
	return `m.id, m.conversation_id, ` + content + `, m.created_at,
	o.id, o.status, o.attempts, o.available_at, o.lease_expires_at, o.run_id::text, ` + clip("r.worker", nameChars) + `, r.started_at,
	p.id, p.role, ` + replyContent + `, p.created_at, m.xmin, p.xmin
	FROM messages m
	LEFT JOIN agent_outbox o ON o.message_id = m.id
	LEFT JOIN agent_runs r ON r.run_id = o.run_id
	LEFT JOIN messages p ON p.id = o.reply_id AND p.conversation_id = o.conversation_id
		AND p.conversation_id = m.conversation_id AND p.role IN ('assistant', 'error')`
}

// latestMessages reads the latest $2 user messages of conversation $1, oldest first: an index
// scan of messages_conversation.
func latestMessages(contents bool) string {
	return `SELECT * FROM (SELECT ` + messageSelect(contents) + `
	WHERE m.conversation_id = $1 AND m.role = 'user'
	ORDER BY m.created_at DESC, m.id DESC LIMIT $2) x ORDER BY 4, 1`
}

// messagesSQL reads the latest user messages of a conversation, oldest first, with their
// contents.
var messagesSQL = latestMessages(true)

// messageVersionsSQL reads what messagesSQL does but the contents: the small columns of each
// row and the versions of the message and reply rows. An event stream reads it every poll and
// then the contents of only the rows that are new or changed (messagesByIDSQL): reading 200
// messages' contents four times a second, whether anything changed or not, kept the database
// busy with every stream open on a conversation of large messages.
var messageVersionsSQL = latestMessages(false)

// messagesByIDSQL reads the user messages $1 of conversation $2, with their contents, by
// primary key.
var messagesByIDSQL = `SELECT ` + messageSelect(true) + ` WHERE m.id = ANY ($1) AND m.conversation_id = $2 AND m.role = 'user'`

var messageRowSQL = `SELECT ` + messageSelect(true) + ` WHERE m.id = $1`

func scanMessageRow(r pgx.CollectableRow) (messageRow, error) {
	var m messageRow
	var content *string // NULL in messageVersionsSQL
	err := r.Scan(&m.ID, &m.ConversationID, &content, &m.CreatedAt,
		&m.OutboxID, &m.Status, &m.Attempts, &m.AvailableAt, &m.LeaseExpiresAt, &m.RunID, &m.Worker, &m.RunStartedAt,
		&m.ReplyID, &m.ReplyRole, &m.ReplyContent, &m.ReplyCreatedAt, &m.MessageVersion, &m.ReplyVersion)
	if content != nil {
		m.Content = *content
	}
	return m, err
}

func conversationMessages(ctx context.Context, db *pgxpool.Pool, conversationID string) ([]messageRow, error) {
	return queryMessages(ctx, db, "read messages", messagesSQL, conversationID, maxMessages)
}

// conversationVersions is conversationMessages without the contents (messageVersionsSQL).
func conversationVersions(ctx context.Context, db *pgxpool.Pool, conversationID string) ([]messageRow, error) {
	return queryMessages(ctx, db, "read message versions", messageVersionsSQL, conversationID, maxMessages)
}

// messagesByID reads the user messages ids of a conversation, with their contents; a message
// not found (deleted) is left out.
func messagesByID(ctx context.Context, db *pgxpool.Pool, conversationID string, ids []string) ([]messageRow, error) {
	return queryMessages(ctx, db, "read changed messages", messagesByIDSQL, ids, conversationID)
}

func queryMessages(ctx context.Context, db *pgxpool.Pool, what, sql string, args ...any) ([]messageRow, error) {
	rows, err := db.Query(ctx, sql, args...)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", what, err)
	}
	out, err := pgx.CollectRows(rows, scanMessageRow)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", what, err)
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

// timelineOutboxColumns are the outbox row's columns a timeline reads.
const timelineOutboxColumns = `o.id, o.conversation_id, o.status, o.attempts, o.created_at, o.available_at, o.processed_at,
	o.run_id::text, o.lease_expires_at, o.reply_id`

// timelineOutboxSQL finds the outbox row of a user message (its unique index on message_id).
const timelineOutboxSQL = `SELECT ` + timelineOutboxColumns + ` FROM agent_outbox o WHERE o.message_id = $1`

// timelineAnsweredSQL finds the outbox row a reply ($1, of conversation $2, written at $3)
// answered without an index on agent_outbox.reply_id, which every worker commit sets (an index
// there would make each commit a non-HOT update of agent_outbox): the reply is written by the
// final commit of the run that claimed the row, or by the recovery of the last run that did,
// and runs of one conversation never overlap, so the row is among those claimed by the
// conversation's last runs started before the reply (agent_runs_conversation), read by primary
// key. reply_id = $1 checks the find; a row not found this way leaves the timeline at the
// message itself.
const timelineAnsweredSQL = `SELECT ` + timelineOutboxColumns + ` FROM agent_outbox o
	WHERE o.id = ANY (ARRAY(SELECT unnest(r.outbox_ids) FROM (SELECT outbox_ids FROM agent_runs
		WHERE conversation_id = $2 AND started_at <= $3 ORDER BY started_at DESC LIMIT 2) r))
	AND o.conversation_id = $2 AND o.reply_id = $1
	ORDER BY o.id LIMIT 1`

var timelineRunsSQL = `SELECT run_id::text, ` + clip("worker", nameChars) + `, started_at, finished_at, outcome FROM agent_runs
	WHERE conversation_id = $1 AND $2::bigint = ANY (outbox_ids) ORDER BY started_at, run_id LIMIT $3`

var timelineOpsSQL = `SELECT id, run_id::text, ` + clip("tool", nameChars) + `, effect, status, started_at, finished_at FROM operations
	WHERE conversation_id = $1 AND run_id = ANY ($2::uuid[]) ORDER BY started_at, id LIMIT $3`

// timelineReplySQL reads the reply ($1) only when it is an assistant or error message of the
// conversation ($2): reply_id may name any message (see messageColumns).
var timelineReplySQL = `SELECT id, role, ` + clip("content", timelineTextChars) + `, created_at FROM messages
	WHERE id = $1 AND conversation_id = $2 AND role IN ('assistant', 'error')`

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
	var outboxConv string
	var replyID *string
	outboxSQL, args := timelineOutboxSQL, []any{id}
	if m.Role != "user" {
		outboxSQL, args = timelineAnsweredSQL, []any{id, m.ConversationID, m.CreatedAt}
	}
	err = db.QueryRow(ctx, outboxSQL, args...).Scan(&o.ID, &outboxConv, &o.Status, &o.Attempts, &o.CreatedAt, &o.AvailableAt,
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
	if replyID != nil && outboxConv == m.ConversationID {
		var rp TimelineReply
		err := db.QueryRow(ctx, timelineReplySQL, *replyID, m.ConversationID).Scan(&rp.ID, &rp.Role, &rp.Content, &rp.CreatedAt)
		switch {
		case errors.Is(err, pgx.ErrNoRows): // deleted meanwhile, or not a reply of this conversation
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

// workersSQL lists the workers that started a run in the last hour: an index scan of
// agent_runs_started (migration 9) over that hour's runs.
var workersSQL = `SELECT ` + clip("worker", nameChars) + `, count(*), count(*) FILTER (WHERE finished_at IS NULL), max(started_at)
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
	// TurnsPerSecond is the turns (runs) that ended with a reply or an error message (outcome
	// done or error) in the bucket, per second.
	TurnsPerSecond float64 `json:"turns_per_second"`
	// LatencySeconds is the median time from an outbox row's creation (the message sent) to
	// the end of the run that answered it, for the rows of the runs ended in the bucket; nil
	// when none did.
	LatencySeconds *float64 `json:"latency_seconds"`
}

// chartLongestTurn is how long before the chart's window a turn ending in it may have started:
// seriesSQL reads the runs started since the window's start minus this (agent_runs_started,
// migration 9), so a longer turn is left out of the chart.
const chartLongestTurn = 15 * time.Minute

// seriesSQL buckets the runs ended (done or error) in the last $1 seconds by $2 seconds, with
// the rows each claimed read by primary key for the latency. Outbox rows are not read by
// processed_at, which has no index: an index there would make every worker commit a non-HOT
// update of agent_outbox. The cost per refresh is one index probe per row finished in the
// window.
var seriesSQL = `SELECT to_timestamp(floor(extract(epoch FROM r.finished_at) / $2) * $2) AS at,
	count(DISTINCT r.run_id), percentile_cont(0.5) WITHIN GROUP (ORDER BY extract(epoch FROM r.finished_at - o.created_at))
	FROM agent_runs r LEFT JOIN agent_outbox o ON o.id = ANY (r.outbox_ids) AND o.conversation_id = r.conversation_id
	WHERE r.started_at > now() - make_interval(secs => $1 + ` + strconv.Itoa(int(chartLongestTurn.Seconds())) + `)
	AND r.finished_at > now() - make_interval(secs => $1) AND r.outcome IN ('done', 'error')
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
