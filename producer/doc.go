// Package producer is how an application hands a user message to Baton: it writes the message
// and its agent_outbox row, the trigger for one agent turn, in one Postgres transaction.
//
//	p, err := producer.New(producer.Config{})
//	...
//	created, err := p.CreateConversation(ctx, pool, "conv-1")
//	res, err := p.Send(ctx, pool, producer.Message{ConversationID: "conv-1", ID: requestID, Content: text})
//
// Send uses a transaction of its own; SendTx writes inside the caller's pgx.Tx, so the message
// commits together with the application's own state or not at all.
//
// # Guarantees
//
//   - Atomic: the message and its outbox row commit together or neither does. Send writes both
//     with a single statement (one round trip, one transaction); a dropped connection, a crash
//     or any error before the commit leaves nothing behind, and an error returned by Send means
//     this call wrote nothing. A network error may hide a commit that happened: retrying with
//     the same message settles it (below).
//   - Idempotent by message id. Message.ID is the client's request id and becomes messages.id.
//     Sending the same id again with the same conversation and content writes nothing and
//     returns the existing outbox row with Result.AlreadyAccepted set (a second round trip reads
//     it); this holds for any number of concurrent retries too (at READ COMMITTED; see SendTx for
//     stricter levels): exactly one of them writes, the others wait for it and then report
//     AlreadyAccepted. The same id with a different conversation or different content, or held
//     by a message this package did not write, is ErrConflict. So one message id never makes a
//     second message, outbox row or turn.
//   - A conflict reveals nothing: ErrConflict is one error with one text for every case, naming
//     only the caller's own ids. A caller sending id X into conversation B cannot tell whether X
//     is held in another conversation, by a message of another role or with other content.
//   - Baton's ids are reserved: message ids starting with ReservedIDPrefix ("baton:") belong to
//     the messages Baton writes itself (worker replies and errors). Send refuses them, in any
//     ASCII letter case ("BATON:", "Baton:", ...), as an *InputError for field ID
//     (ErrInvalidInput) before any I/O, so a client message never takes one of those ids.
//     Conversation ids have no reserved prefix.
//   - No queue fields from callers: the outbox insert names only conversation_id and
//     message_id, so every row starts as the schema's default (pending, zero attempts, no
//     claim). Message has no field that could say otherwise. The message's role is always user.
//   - No implicit conversations: Send into a conversation that does not exist is
//     ErrConversationNotFound and writes nothing. CreateConversation is explicit and idempotent.
//     Deleting a conversation deletes its messages and outbox rows (ON DELETE CASCADE).
//   - Input is checked before any I/O: ids must be 1 to 200 bytes, content 1 to
//     Config.MaxContentBytes bytes (default 1 MiB), all valid UTF-8 without NUL bytes (Postgres
//     text cannot hold them). Empty content is rejected: it is no message for an agent to answer.
//     A violation is an *InputError, errors.Is ErrInvalidInput (and ErrContentTooLarge for size).
//   - The caller's OpenTelemetry span, when ctx carries one, is stored as the outbox row's W3C
//     traceparent (trace_context), so the turn and its outcome join the caller's trace.
//
// Errors from the database are wrapped with the message and conversation ids; test errors with
// errors.Is and errors.As. Postgres errors are classified by SQLSTATE and constraint name, never by text.
package producer
