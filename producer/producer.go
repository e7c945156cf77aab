package producer

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"time"
	"unicode/utf8"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/trace"
)

// DefaultMaxContentBytes is Config.MaxContentBytes when it is left zero: 1 MiB.
const DefaultMaxContentBytes = 1 << 20

// maxContentLimit is the largest MaxContentBytes New accepts: a Postgres text value holds at
// most 1 GB.
const maxContentLimit = 1 << 30

// MaxIDBytes is the longest conversation or message id, in bytes, that the schema accepts.
const MaxIDBytes = 200

// ReservedIDPrefix starts the ids of the messages Baton writes itself, such as a worker's reply
// or error message ("baton:reply:<random>"). Send and SendTx refuse a message id that starts with
// it in any ASCII letter case ("baton:", "BATON:", "Baton:", ...) with an *InputError for field
// ID, so no client message can take, or be mistaken for, one of Baton's ids. Postgres compares
// ids exactly; refusing every case variant keeps the namespace clear of look-alikes too.
// Conversation ids are the application's own and have no reserved prefix.
const ReservedIDPrefix = "baton:"

// lookupAttempts bounds how often send starts over when the message holding an id vanished
// before it could be read (its conversation was deleted in between).
const lookupAttempts = 3

// Config configures a Producer.
type Config struct {
	// MaxContentBytes is the largest message content, in bytes, Send accepts; larger content is
	// ErrContentTooLarge. Default (zero): DefaultMaxContentBytes, 1 MiB. At most 1 GiB.
	MaxContentBytes int
	// Logger receives a debug record per message written. Default (nil): records are discarded.
	Logger *slog.Logger
	// Schema is the Postgres schema holding Baton's tables (BATON_SCHEMA; see
	// migrations.Options). Statements name it, so the caller's search_path does not matter.
	// Default (empty): "public".
	Schema string
}

// Producer writes user messages and their outbox rows. It holds no connections and is safe for
// concurrent use; one per process is enough.
type Producer struct {
	maxContentBytes int
	logger          *slog.Logger
	sql             statements
}

// statements are the producer's SQL with the tables qualified by the configured schema.
type statements struct {
	insert, insertTraced, lookup, createConversation string
}

func newStatements(schema string) statements {
	if schema == "" {
		schema = "public"
	}
	r := strings.NewReplacer(
		"{messages}", pgx.Identifier{schema, "messages"}.Sanitize(),
		"{agent_outbox}", pgx.Identifier{schema, "agent_outbox"}.Sanitize(),
		"{conversations}", pgx.Identifier{schema, "conversations"}.Sanitize())
	return statements{
		insert:             r.Replace(insertSQL),
		insertTraced:       r.Replace(insertTracedSQL),
		lookup:             r.Replace(lookupSQL),
		createConversation: r.Replace(createConversationSQL),
	}
}

// New returns a Producer with cfg's defaults filled in.
func New(cfg Config) (*Producer, error) {
	switch {
	case cfg.MaxContentBytes == 0:
		cfg.MaxContentBytes = DefaultMaxContentBytes
	case cfg.MaxContentBytes < 0:
		return nil, fmt.Errorf("producer: MaxContentBytes is %d, must not be negative", cfg.MaxContentBytes)
	case cfg.MaxContentBytes > maxContentLimit:
		return nil, fmt.Errorf("producer: MaxContentBytes is %d, over the limit of %d (1 GiB)",
			cfg.MaxContentBytes, maxContentLimit)
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.New(slog.DiscardHandler)
	}
	return &Producer{maxContentBytes: cfg.MaxContentBytes, logger: cfg.Logger, sql: newStatements(cfg.Schema)}, nil
}

// Message is a user message to hand to the agent. It has no queue fields: an outbox row always
// starts pending, with zero attempts and no claim; only workers change that.
type Message struct {
	// ConversationID names an existing conversation (see CreateConversation).
	ConversationID string
	// ID is the client's request id and becomes the message's primary key: sending the same
	// message with the same ID again is a no-op (see Result.AlreadyAccepted). It must not start
	// with ReservedIDPrefix, in any letter case.
	ID string
	// Content is the message text: non-empty, valid UTF-8 without NUL bytes, at most
	// Config.MaxContentBytes bytes.
	Content string
}

// Result describes the outbox row of a sent message.
type Result struct {
	// OutboxID is the id of the message's agent_outbox row, the id workers dedupe by.
	OutboxID int64
	// AlreadyAccepted reports that this message had been written before, by an earlier call with
	// the same ID, conversation and content; this call wrote nothing. OutboxID and CreatedAt
	// then describe the existing row.
	AlreadyAccepted bool
	// CreatedAt is when the outbox row was inserted (the database's now() of that transaction).
	CreatedAt time.Time
}

// DB is a database handle Send writes through: *pgxpool.Pool and *pgx.Conn satisfy it.
//
// Send's write is one statement, which Postgres runs as a transaction of its own, so today it
// only calls QueryRow; Begin is part of the contract so that how Send makes its write atomic
// stays this package's choice.
type DB interface {
	Begin(ctx context.Context) (pgx.Tx, error)
	QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
}

// querier is what the write statements run on: a DB or a pgx.Tx.
type querier interface {
	QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
}

// Send writes msg and its outbox row in one transaction of its own: after Send returns nil,
// both are committed; after an error, neither was written by this call.
//
// Send is idempotent by msg.ID. If a message with that ID already exists with the same
// conversation and content (a retry, including one racing the original), Send writes nothing
// and returns the existing outbox row with AlreadyAccepted set. If the ID belongs to a
// different message, Send returns ErrConflict, which says nothing more about that message (not
// its conversation, role or content), so a caller cannot learn what other conversations hold.
// A missing conversation is ErrConversationNotFound; Send never creates one. Invalid input,
// including an ID that starts with ReservedIDPrefix, is an *InputError (ErrInvalidInput), found
// before any I/O.
//
// If Send returns a network error, the write may or may not have committed: call Send again with
// the same message to find out.
//
// Tracing: when ctx carries a valid OpenTelemetry span context (the caller's span), Send stores
// its W3C traceparent in the outbox row's trace_context, and the turn and its outcome join that
// trace (see wire.HeaderTraceparent). It uses the W3C propagator itself, not the global one, so
// this works whether or not the application configured OpenTelemetry. Without a span the column
// is NULL and tracing costs nothing. A retry that finds the message written keeps the first
// call's trace.
func (p *Producer) Send(ctx context.Context, db DB, msg Message) (Result, error) {
	return p.send(ctx, db, msg, false)
}

// SendTx writes msg and its outbox row inside tx, so they commit or roll back together with the
// caller's own writes. It has Send's idempotency and errors; AlreadyAccepted also reports a
// message written earlier in the same transaction.
//
// Until tx commits, a concurrent Send or SendTx of the same ID waits for it. In a REPEATABLE READ
// or SERIALIZABLE transaction, racing a concurrent writer of the same ID can fail with a
// serialization failure (SQLSTATE 40001): retry the whole transaction. ErrConflict and input
// errors leave tx usable; any other error comes from a failed statement and, as always in
// Postgres, leaves tx aborted.
func (p *Producer) SendTx(ctx context.Context, tx pgx.Tx, msg Message) (Result, error) {
	return p.send(ctx, tx, msg, true)
}

// insertSQL writes the message and its outbox row in one statement: one round trip and, without
// an enclosing transaction, one transaction. The outbox insert names only conversation_id and
// message_id, so status, attempts and the claim columns are always the table's defaults.
//
// When the id is taken, m is empty, the outbox insert selects nothing and the statement returns
// no row; send then reads the existing message with lookupSQL. That is a second statement, and
// under READ COMMITTED a new snapshot, which it needs when the id was taken by a concurrent
// transaction: ON CONFLICT waits for that transaction to commit, and its row is newer than this
// statement's snapshot. (Answering retries from this statement too, with a UNION over messages,
// cost about a fifth of the throughput of new messages, the case that matters.)
//
// ON CONFLICT names no index: messages has two unique ones, id and (conversation_id, id,
// role), which the outbox's foreign key references, and a concurrent retry of the same id may
// meet either first. With ON CONFLICT (id) it failed with a unique violation on the other.
//
// A missing conversation fails the foreign key messages_conversation_id_fkey, checked at the
// end of the statement; the statement then writes nothing.
const insertSQL = `
WITH m AS (
	INSERT INTO {messages} (id, conversation_id, role, content)
	VALUES ($1, $2, 'user', $3)
	ON CONFLICT DO NOTHING
	RETURNING id, conversation_id
)
INSERT INTO {agent_outbox} (conversation_id, message_id)
SELECT conversation_id, id FROM m
RETURNING id, created_at`

// insertTracedSQL is insertSQL that also stores the sender's traceparent ($4) in the outbox
// row's trace_context. It is a statement of its own, so that a sender without a span names no
// column that a database not yet migrated to version 8, or an app role not yet granted it
// (deploy/postgres/roles.sql), lacks.
var insertTracedSQL = strings.Replace(strings.Replace(insertSQL,
	"(conversation_id, message_id)\n", "(conversation_id, message_id, trace_context)\n", 1),
	"SELECT conversation_id, id FROM m", "SELECT conversation_id, id, $4::text FROM m", 1)

// lookupSQL reads the outbox row of the message that holds an id, and whether that message is
// the one being sent: same conversation, a user message, same content. It answers one boolean,
// not which of these differs, so the reason for a conflict is never read, logged or returned.
const lookupSQL = `
SELECT x.id, x.created_at,
	e.conversation_id = $2 AND e.role = 'user' AND e.content = $3
FROM {messages} e LEFT JOIN {agent_outbox} x ON x.message_id = e.id
WHERE e.id = $1`

// createConversationSQL creates a conversation unless it exists, answering true when it did.
const createConversationSQL = `INSERT INTO {conversations} (id) VALUES ($1) ON CONFLICT (id) DO NOTHING RETURNING true`

// existing is what lookupSQL says about the message holding an id.
type existing struct {
	outboxID  *int64
	createdAt *time.Time
	same      bool // same conversation, role user and same content
}

func (p *Producer) send(ctx context.Context, q querier, msg Message, inTx bool) (Result, error) {
	if err := p.validate(msg); err != nil {
		return Result{}, fmt.Errorf("send message: %w", err)
	}
	wrap := func(err error) error {
		return fmt.Errorf("send message %q to conversation %q: %w", msg.ID, msg.ConversationID, err)
	}
	tc := traceContext(ctx)
	for attempt := 1; ; attempt++ {
		var res Result
		var row pgx.Row
		if tc == "" {
			row = q.QueryRow(ctx, p.sql.insert, msg.ID, msg.ConversationID, msg.Content)
		} else {
			row = q.QueryRow(ctx, p.sql.insertTraced, msg.ID, msg.ConversationID, msg.Content, tc)
		}
		err := row.Scan(&res.OutboxID, &res.CreatedAt)
		if errors.Is(err, pgx.ErrNoRows) {
			// The id is taken: a retry, or a different message.
			var e existing
			err = q.QueryRow(ctx, p.sql.lookup, msg.ID, msg.ConversationID, msg.Content).
				Scan(&e.outboxID, &e.createdAt, &e.same)
			if errors.Is(err, pgx.ErrNoRows) {
				// The message that held the id is gone again: its conversation was deleted in
				// between. Start over; the insert now succeeds or finds the conversation missing.
				if attempt < lookupAttempts {
					continue
				}
				return Result{}, wrap(errors.New("message id taken and freed again, repeatedly"))
			}
			if err == nil {
				res, err = e.result()
			}
		}
		if err != nil {
			return Result{}, wrap(classify(err))
		}
		p.logger.LogAttrs(ctx, slog.LevelDebug, "message sent",
			slog.String("conversation_id", msg.ConversationID),
			slog.String("message_id", msg.ID),
			slog.Int64("outbox_id", res.OutboxID),
			slog.Bool("already_accepted", res.AlreadyAccepted),
			slog.Bool("in_caller_tx", inTx))
		return res, nil
	}
}

// traceContext returns the W3C traceparent of the span context ctx carries, for the outbox
// row's trace_context, or "" when it carries none. Without a span it allocates nothing.
func traceContext(ctx context.Context) string {
	if !trace.SpanContextFromContext(ctx).IsValid() {
		return ""
	}
	var c traceparentCarrier
	propagation.TraceContext{}.Inject(ctx, &c)
	return c.traceparent
}

// traceparentCarrier keeps the traceparent a propagator injects and ignores the rest
// (tracestate is not stored).
type traceparentCarrier struct{ traceparent string }

func (c *traceparentCarrier) Get(key string) string {
	if key == "traceparent" {
		return c.traceparent
	}
	return ""
}

func (c *traceparentCarrier) Set(key, value string) {
	if key == "traceparent" {
		c.traceparent = value
	}
}

func (c *traceparentCarrier) Keys() []string { return []string{"traceparent"} }

// result turns an existing message into the Result of a retry, or an ErrConflict.
//
// Every conflict is the bare ErrConflict: the id may be held by a message in another
// conversation, and whoever sends into this one must not learn that it exists, whose it is or
// what it says. A message without outbox row was not written by this package (it always writes
// both); recreating the row could start a second turn for a message already answered, so it is
// a conflict too.
func (e existing) result() (Result, error) {
	if !e.same || e.outboxID == nil || e.createdAt == nil {
		return Result{}, ErrConflict
	}
	return Result{OutboxID: *e.outboxID, AlreadyAccepted: true, CreatedAt: *e.createdAt}, nil
}

// classify maps Postgres errors callers branch on to this package's errors, by SQLSTATE and
// constraint name.
func classify(err error) error {
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) && pgErr.Code == "23503" { // foreign_key_violation
		switch pgErr.ConstraintName {
		case "messages_conversation_id_fkey", "agent_outbox_conversation_id_fkey":
			return ErrConversationNotFound
		}
	}
	return err
}

// CreateConversation creates the conversation id if it does not exist, in a transaction of its
// own. created is false when it already existed. Invalid ids are an *InputError.
func (p *Producer) CreateConversation(ctx context.Context, db DB, id string) (created bool, err error) {
	return p.createConversation(ctx, db, id)
}

// CreateConversationTx is CreateConversation inside the caller's transaction.
func (p *Producer) CreateConversationTx(ctx context.Context, tx pgx.Tx, id string) (created bool, err error) {
	return p.createConversation(ctx, tx, id)
}

func (p *Producer) createConversation(ctx context.Context, q querier, id string) (bool, error) {
	if err := validateID("ConversationID", id); err != nil {
		return false, fmt.Errorf("create conversation: %w", err)
	}
	var created bool
	err := q.QueryRow(ctx, p.sql.createConversation, id).Scan(&created)
	switch {
	case errors.Is(err, pgx.ErrNoRows):
		return false, nil
	case err != nil:
		return false, fmt.Errorf("create conversation %q: %w", id, err)
	}
	p.logger.LogAttrs(ctx, slog.LevelDebug, "conversation created", slog.String("conversation_id", id))
	return true, nil
}

// validate checks msg against the schema and the size limit without I/O.
func (p *Producer) validate(msg Message) error {
	if err := validateID("ConversationID", msg.ConversationID); err != nil {
		return err
	}
	if err := validateID("ID", msg.ID); err != nil {
		return err
	}
	if hasReservedPrefix(msg.ID) {
		return &InputError{Field: "ID",
			Reason: fmt.Sprintf("starts with %q (in any letter case), a prefix reserved for Baton's own messages", ReservedIDPrefix)}
	}
	return validateContent(msg.Content, p.maxContentBytes)
}

func validateID(field, id string) error {
	switch {
	case id == "":
		return &InputError{Field: field, Reason: "is empty"}
	case len(id) > MaxIDBytes:
		return &InputError{Field: field, Reason: fmt.Sprintf("is %d bytes, over the limit of %d", len(id), MaxIDBytes)}
	}
	return validateText(field, id)
}

// hasReservedPrefix reports whether id starts with ReservedIDPrefix in any ASCII letter case.
// EqualFold over exactly len(ReservedIDPrefix) bytes matches only ASCII: every rune that folds to
// an ASCII letter but is not one takes more than one byte, so it cannot fit.
func hasReservedPrefix(id string) bool {
	n := len(ReservedIDPrefix)
	return len(id) >= n && strings.EqualFold(id[:n], ReservedIDPrefix)
}

func validateContent(content string, maxBytes int) error {
	switch {
	case content == "":
		return &InputError{Field: "Content", Reason: "is empty"}
	case len(content) > maxBytes:
		return &InputError{Field: "Content", err: ErrContentTooLarge,
			Reason: fmt.Sprintf("is %d bytes, over the limit of %d", len(content), maxBytes)}
	}
	return validateText("Content", content)
}

// validateText rejects what a Postgres text value in a UTF8 database cannot hold.
func validateText(field, s string) error {
	switch {
	case !utf8.ValidString(s):
		return &InputError{Field: field, Reason: "is not valid UTF-8"}
	case strings.IndexByte(s, 0) >= 0:
		return &InputError{Field: field, Reason: "contains a NUL byte"}
	}
	return nil
}
