-- Index the rows a run holds by conversation and run, instead of by lease expiry.
--
-- Every claim asks "is a row of this conversation processing?" and every final commit, lease
-- renewal and release asks "which rows does run R of conversation C hold?". The index of
-- version 1 (lease_expires_at WHERE status = 'processing') answered both by scanning every
-- processing row, and the entries of rows that have since finished stay in it until VACUUM: on
-- a busy outbox each claim read thousands of dead entries (measured: 11,000 per claim after
-- 23k turns). Keyed by (conversation_id, run_id), both questions are one index probe. The
-- recovery query (expired leases) scans this index, which holds only the processing rows.
--
-- The index is built under a SHARE lock: producers wait while agent_outbox is scanned once.
CREATE INDEX agent_outbox_running ON agent_outbox (conversation_id, run_id)
    WHERE status = 'processing';
DROP INDEX agent_outbox_processing;

-- Nothing reads agent_runs by "still open", and the index on finished_at made every run's
-- final update a non-HOT update that wrote three index entries.
DROP INDEX agent_runs_open;
