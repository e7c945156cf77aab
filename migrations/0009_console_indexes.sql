-- Indexes for the console's periodic reads (internal/console), so that none of them reads a
-- whole table that grows with every message or turn.
--
-- agent_runs_started: the system view's workers list and chart read the runs started in the last
-- hour (minutes). started_at is never updated, so runs' final updates stay HOT.
-- conversations_created: the chat lists the newest conversations by creation. created_at is
-- never updated; an index on last_message_at instead would make every worker commit's update of
-- conversations non-HOT.
--
-- Columns the workers' hot path updates (agent_outbox.reply_id, processed_at, status;
-- conversations.last_message_at) get no index here, for the same reason.
--
-- Each index is built under a SHARE lock on its table: workers (agent_runs) and new
-- conversations wait while it is built.
CREATE INDEX agent_runs_started ON agent_runs (started_at);
CREATE INDEX conversations_created ON conversations (created_at);
