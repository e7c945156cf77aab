// Package wire is Baton's contract on NATS JetStream: everything a program that is not Baton
// needs to read what Baton publishes, or to take part in it, without importing relay or
// consumer. The relay writes this contract, workers (package consumer) and any other
// subscriber read it; on NATS, the names and encodings below are all they share.
//
// # Subjects and streams
//
// For a subject prefix (BATON_SUBJECT_PREFIX, default DefaultSubjectPrefix "agent"):
//
//	<prefix>.turns.<conv>          turn events: a user message for a worker to answer (TurnSubject)
//	<prefix>.outcomes.<conv>       outcome events: a reply or a visible error (OutcomeSubject)
//	<prefix>.deadletter.<kind>     changes the relay set aside (DeadLetterSubject)
//
// stored in the streams <PREFIX>_TURNS, <PREFIX>_OUTCOMES and <PREFIX>_DEADLETTER (StreamName:
// AGENT_TURNS for the default prefix), each filtering <prefix>.<kind>.> (StreamFilter). The
// relay creates them with file storage, limits retention and discard old.
//
// <conv> is the token of a conversation id (Token):
//
//   - the id itself when it matches ^[A-Za-z0-9_-]{1,200}$ (a "plain" id);
//   - otherwise "~" followed by the unpadded base64url encoding
//     ([encoding/base64.RawURLEncoding]) of the id's bytes.
//
// No conversation id can reach another conversation's subject or a wildcard. Every token is
// one non-empty NATS subject token made only of [A-Za-z0-9_-] and, as its first byte only,
// "~", so it never contains ".", "*", ">" or whitespace. Plain ids never contain "~" and
// encoded tokens always start with "~", so the two spaces cannot collide. The mapping is a
// bijection between valid ids and canonical tokens: ParseToken accepts exactly the tokens
// Token produces, so every id has exactly one token and every accepted token names exactly
// one id; ParseSubject reverses TurnSubject and OutcomeSubject the same way. Ids are treated
// as bytes: invalid UTF-8 and NUL bytes are encoded like any other non-plain byte and
// round-trip exactly, although Postgres text columns cannot hold them.
//
// # Events
//
// A turn event is published for every row inserted into agent_outbox. Its body is the row as
// JSON (TurnEvent), without message content: the outbox is a trigger, the content stays in
// the messages table. Its headers:
//
//	Nats-Msg-Id            TurnMsgID: "turn:<outbox id>"
//	Baton-Outbox-Id        the outbox id (HeaderOutboxID)
//	Baton-Conversation-Id  HeaderID of the conversation id (HeaderConversationID)
//	Baton-Message-Id       HeaderID of the user message's id (HeaderMessageID)
//	traceparent            the sender's span, when it had one (HeaderTraceparent)
//
// An outcome event is published for every message inserted with role "assistant" or
// "error". Its body is OutcomeEvent; its headers:
//
//	Nats-Msg-Id               OutcomeMsgID: "outcome:" + HeaderID(message id)
//	Baton-Conversation-Id     HeaderID of the conversation id
//	Baton-Message-Id          HeaderID of the message id
//	Baton-Role                "assistant" or "error" (HeaderRole)
//	Baton-Outbox-Id           answered outbox ids when known, comma-separated (at most MaxHeaderOutboxIDs)
//	Baton-Outbox-Ids-Omitted  answered ids left out of Baton-Outbox-Id, when any
//	Baton-Content-Omitted     "true" when the content was left out (HeaderContentOmitted)
//	traceparent               the worker's turn span, when the turn was traced (HeaderTraceparent)
//
// A traceparent header is W3C Trace Context, always valid (ValidTraceparent): one user message
// is one trace, from the span that sent it through the worker's turn to its outcome.
//
// An outcome is sized to the server's max payload, headers and body: past it, the event is
// published without its content (read it from messages by id) and, if it is still too
// large, with fewer answered ids. One that cannot fit even so becomes a dead-letter record.
//
// Header values that carry ids use HeaderID: the id itself when it is non-empty printable
// ASCII without spaces and does not start with "~", otherwise "~" and the unpadded base64url
// of its bytes; ParseHeaderID reverses it. Distinct ids never share a header value or an
// outcome Nats-Msg-Id, also after nats.go trims the value, so a hostile id can neither break
// the header block nor make JetStream drop another message's outcome as a duplicate. The JSON
// bodies always carry the exact ids.
//
// # Delivery
//
// Events of one conversation reach their stream in commit order. Delivery is at least once:
// a relay that restarts republishes with the same Nats-Msg-Id, which JetStream drops within
// the stream's duplicate window (default 2 minutes); beyond it, readers dedupe by outbox id
// (turns) or message id (outcomes), the idempotency keys of this contract.
//
// # The answers message
//
// A worker tells the relay which outbox rows a reply answers with a transactional logical
// decoding message, emitted in the transaction that inserts the reply and before the insert:
//
//	SELECT pg_logical_emit_message(true, 'baton.answers', '{"message_id":"r1","outbox_ids":[1,2]}')
//
// (prefix AnswersPrefix). The relay puts the ids on that reply's outcome event
// (OutcomeEvent.OutboxIDs, Baton-Outbox-Id). The ids are integers; a message that is not this
// JSON object costs only the ids: it is set aside as a dead-letter record of kind
// DeadLetterAnswers, and the reply's outcome goes without them.
//
// Any role may emit such a message, of any size the relay receives (its MaxChangeBytes), so
// the relay bounds what it holds of them. Of one message it keeps the first MaxBodyOutboxIDs
// ids, all an event carries, and counts the rest without storing them: the outcome carries
// those ids and counts the others in OutboxIDsOmitted and Baton-Outbox-Ids-Omitted, as for
// any reply that answers more rows than an event carries (read them from agent_outbox by
// reply id). Of one transaction it holds at most 16 MiB of answers messages, each costing its
// message id's bytes, 8 bytes per id kept and 64: a message past that bound is set aside like
// a malformed one (a worker's transaction holds a few KiB per reply it commits).
//
// # Dead letters
//
// A change the relay can never publish (a malformed answers message, a row value it cannot
// parse, an event that cannot fit the max payload) is published instead as a DeadLetter
// record on <prefix>.deadletter.<kind>, kind DeadLetterAnswers, DeadLetterTurn or
// DeadLetterOutcome, with Nats-Msg-Id DeadLetterMsgID ("deadletter:<lsn>"; DeadLetterNthMsgID
// "deadletter:<lsn>:<n>" for a further change at the same position) or, for a row the
// relay's first-start backfill set aside, DeadLetterBackfillMsgID
// ("deadletter:backfill:<outbox id>"). A sharded relay (baton relay --shard K/N) names its
// records of changes with DeadLetterShardMsgID instead ("deadletter:shard:<K>/<N>:<lsn>", and
// "deadletter:shard:<K>/<N>:<lsn>:<n>"): a shard numbers the changes at a position among the
// ones its publication sends it, so two shards' records at one position (two rows of one COPY)
// would otherwise share an id, and JetStream would drop the second as a duplicate. A record
// keeps its id when the same shard replays its change, and is deduplicated. A logical decoding
// message reaches every shard's slot: a malformed answers message gives one record per shard
// (N records, each with its shard's id), whenever each shard decodes it; one id for all would
// merge them only within the duplicate window.
//
// # Subscribing to outcomes
//
// OutcomeSubscriber reads every conversation's outcomes, or one conversation's, through a
// durable JetStream consumer of its own, decodes each OutcomeEvent, skips duplicates by
// message id and calls a handler, acking an outcome only after the handler returned nil. Its
// delivery rules are on its doc comment; examples/subscriber is a program built on it.
//
// # Compatibility
//
// What this package names is a wire format other programs rely on, kept within a major
// version of the module:
//
//   - A minor version may add: optional JSON fields to the bodies (absent or zero meaning what
//     they meant before), optional headers, dead-letter kinds, subject kinds under the prefix
//     (with streams of their own), and exported names in this package. Readers ignore fields,
//     headers and kinds they do not know, as encoding/json does.
//   - Only a new major version changes: existing subject forms and the token encoding, header
//     names and the HeaderID encoding, Nats-Msg-Id forms, JSON field names, types and
//     meanings, the default stream names, AnswersPrefix and its JSON, the values of the
//     constants here, and the exported names and signatures of this package.
//
// The encoding functions are pure: no I/O, no shared state, no regular expressions. Besides
// the standard library, the package imports only the NATS client (github.com/nats-io/nats.go
// and its jetstream package), for OutcomeSubscriber.
package wire
