-- What workers need beyond version 1: backoff for retried rows and a record of every run.

-- A pending row is not claimed before available_at (backoff after a failed attempt).
ALTER TABLE agent_outbox ADD COLUMN available_at timestamptz NOT NULL DEFAULT now();

-- One row per claimed turn: which rows it took, when it ran, how it ended. Runs of one
-- conversation never overlap; this table lets anyone check that.
CREATE TABLE agent_runs (
    run_id          uuid PRIMARY KEY,
    conversation_id text NOT NULL REFERENCES conversations (id) ON DELETE CASCADE,
    outbox_ids      bigint[] NOT NULL,
    worker          text NOT NULL,
    started_at      timestamptz NOT NULL DEFAULT clock_timestamp(),
    finished_at     timestamptz,
    outcome         text CHECK (outcome IN ('done', 'retry', 'error', 'recovered', 'released', 'cancelled')),
    error           text
);

CREATE INDEX agent_runs_conversation ON agent_runs (conversation_id, started_at);
CREATE INDEX agent_runs_open ON agent_runs (started_at) WHERE finished_at IS NULL;

-- baton_fence raises SQLSTATE BT001 unless ok: a worker's final commit asserts with it that
-- every claimed row is still its run's, so a run whose lease was taken over commits nothing,
-- even when the whole commit is sent as one pipelined batch.
CREATE FUNCTION baton_fence(ok boolean, what text) RETURNS boolean
LANGUAGE plpgsql AS $$
BEGIN
    IF NOT ok THEN
        RAISE EXCEPTION 'fenced: %', what USING ERRCODE = 'BT001';
    END IF;
    RETURN true;
END
$$;
