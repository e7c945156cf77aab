// Package console is `baton console`: a web console over one Baton database (and, optionally,
// its NATS), for people who run agent chat and want to see where a message is.
//
// It serves three pages from embedded static files (plain HTML, CSS and JavaScript; nothing is
// fetched from elsewhere): the chat (/), the system view (/system) and a message's timeline
// (/messages/{id}), over a JSON API under /api/ and a Server-Sent Events stream per watched
// conversation. Its rules:
//
//   - Postgres is the authority. A message's state (queued, running, replied, failed) is derived
//     from its outbox row, the run holding it and its reply, never from elapsed time; the
//     browser adds only local (typed) and synchronized (the send returned).
//   - The only write is sending a user message with producer.Send (and creating a conversation
//     with producer.CreateConversation), idempotent by the client's message id: a retry is the
//     same message. Everything else is read-only.
//   - Internal error text (agent_outbox.last_error, agent_runs.error, operations.error) is never
//     read into a page or an answer; a failed message shows the error message the worker stored
//     for users. Server errors answer a generic JSON error and are logged.
//   - Everything is bounded: request bodies, message contents, ids (the producer's rules),
//     open event streams (in all and per client IP address), rows per read, the text read of
//     each value (a prefix, never a whole large message), and each write to a stream (a client
//     that stops reading is dropped). Every stream ends with its request's context, so Serve
//     stops them all. A stream's poll reads its messages' small columns; contents are read
//     only for the messages that are new or changed.
//   - Basic auth, when configured, guards everything but /healthz, compared in constant time;
//     without it, Settings.Resolve refuses a non-loopback address.
//
// The DOM the pages expose (ids, data-* attributes) is a contract the browser tests rely on;
// see static/.
package console
