-- W3C trace context, so that one user message is one connected trace (README, "Traces").
--
-- agent_outbox.trace_context is the traceparent of the span that sent the message
-- (producer.Send writes it when the caller's context carries one); the relay puts it on the turn
-- event's traceparent header and the worker starts its turn span as a child of it.
-- messages.trace_context is, on a worker's reply or error message, the traceparent of the
-- worker's turn span; the relay puts it on the outcome event. NULL means no trace.
--
-- The value is what the writer says, so everyone who reads it checks it (wire.ValidTraceparent):
-- a malformed value is dropped, never an error. The CHECK only bounds the size any role can make
-- the relay read per row; a valid version-00 traceparent is 55 bytes. Nullable columns without
-- default: adding them rewrites nothing and takes only a brief ACCESS EXCLUSIVE lock.
ALTER TABLE agent_outbox ADD COLUMN trace_context text
    CONSTRAINT agent_outbox_trace_context_check CHECK (octet_length(trace_context) <= 512);

ALTER TABLE messages ADD COLUMN trace_context text
    CONSTRAINT messages_trace_context_check CHECK (octet_length(trace_context) <= 512);
