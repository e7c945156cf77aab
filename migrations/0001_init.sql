-- Baton schema, version 1. Names and columns here are a contract (DESIGN.md):
-- later versions may add columns and tables, never drop these.

CREATE TABLE conversations (
    id              text PRIMARY KEY
                    CHECK (octet_length(id) BETWEEN 1 AND 200),
    created_at      timestamptz NOT NULL DEFAULT now(),
    -- Ordering and unread metadata, maintained by the worker's final commit.
    last_message_at timestamptz,
    unread_count    integer NOT NULL DEFAULT 0
);

CREATE TABLE messages (
    id              text PRIMARY KEY
                    CHECK (octet_length(id) BETWEEN 1 AND 200),
    conversation_id text NOT NULL REFERENCES conversations (id) ON DELETE CASCADE,
    role            text NOT NULL CHECK (role IN ('user', 'assistant', 'error')),
    content         text NOT NULL,
    created_at      timestamptz NOT NULL DEFAULT now()
);

CREATE INDEX messages_conversation ON messages (conversation_id, created_at);

-- The outbox is a trigger record: it never holds message content.
CREATE TABLE agent_outbox (
    id               bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    conversation_id  text NOT NULL REFERENCES conversations (id) ON DELETE CASCADE,
    message_id       text NOT NULL UNIQUE REFERENCES messages (id) ON DELETE CASCADE,
    status           text NOT NULL DEFAULT 'pending'
                     CHECK (status IN ('pending', 'processing', 'done', 'error')),
    attempts         integer NOT NULL DEFAULT 0 CHECK (attempts >= 0),
    created_at       timestamptz NOT NULL DEFAULT now(),
    processed_at     timestamptz,
    -- Ownership of the current claim: the run that holds it and until when.
    run_id           uuid,
    lease_expires_at timestamptz,
    -- The assistant or error message that answered this row.
    reply_id         text REFERENCES messages (id) ON DELETE SET NULL,
    last_error       text
);

-- Claims scan pending rows of one conversation in order.
CREATE INDEX agent_outbox_pending
    ON agent_outbox (conversation_id, created_at)
    WHERE status = 'pending';

-- Recovery scans expired leases.
CREATE INDEX agent_outbox_processing
    ON agent_outbox (lease_expires_at)
    WHERE status = 'processing';

-- One row per tool call of a turn, owned by the run that made it.
CREATE TABLE operations (
    id              bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    run_id          uuid NOT NULL,
    conversation_id text NOT NULL REFERENCES conversations (id) ON DELETE CASCADE,
    -- The reply this operation contributed to; NULL until the final commit attaches it.
    message_id      text REFERENCES messages (id) ON DELETE CASCADE,
    tool            text NOT NULL,
    effect          text NOT NULL CHECK (effect IN ('read', 'write')),
    status          text NOT NULL DEFAULT 'running'
                    CHECK (status IN ('running', 'done', 'error')),
    input           jsonb,
    output          jsonb,
    error           text,
    started_at      timestamptz NOT NULL DEFAULT now(),
    finished_at     timestamptz
);

CREATE INDEX operations_run ON operations (run_id);
CREATE INDEX operations_conversation ON operations (conversation_id);
CREATE INDEX operations_message ON operations (message_id) WHERE message_id IS NOT NULL;

-- What the relay streams: every new outbox row (a turn to run) and every reply
-- (an outcome for subscribers). User messages stay out: their outbox row is the trigger.
-- Its name (BATON_PUBLICATION, default baton) is written in psql's variable syntax:
-- `baton migrate` substitutes it, and so does psql -v publication=baton -f 0001_init.sql.
CREATE PUBLICATION :"publication"
    FOR TABLE agent_outbox, messages WHERE (role <> 'user')
    WITH (publish = 'insert');
