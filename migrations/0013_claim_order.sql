-- Claim order: a turn's history is the turns of its conversation that ended before it was
-- claimed, in the order they were claimed (consumer.Turn.History). Messages' created_at cannot
-- give that order: it is the sender's transaction's start, and a message sent inside a long
-- transaction may have an earlier created_at than one sent, claimed and answered before it
-- committed.
--
-- claim_order numbers a conversation's claims 1, 2, 3, …: a claim writes one more than the
-- conversation's largest. Claims of a conversation are serialised by the lock each takes on the
-- conversation's row until it commits, and each reads with a snapshot taken after that lock,
-- so no two claims of a conversation get the same number and later claims get larger ones.
-- NULL: a run claimed before this version, or by a worker of an earlier version (a rolling
-- upgrade); its turns come first in histories, by their messages' created_at.
ALTER TABLE agent_runs ADD COLUMN claim_order bigint
    CONSTRAINT agent_runs_claim_order_check CHECK (claim_order > 0);

-- A conversation's runs in claim order: the claim's probe for the largest number, and
-- histories, which walk back from a turn's own claim. Runs of earlier versions have no entry.
-- The column is written once, at the claim, so the final commit's update of the run stays a
-- heap-only (HOT) update.
--
-- agent_outbox_reply: the row a message answers. Histories tell a reply of a claim-ordered
-- turn from an earlier one by it, and deleting a conversation needs it too: each deleted
-- message's foreign key action (reply_id ON DELETE SET NULL) looked for rows naming it with a
-- scan of the whole outbox.
--
-- Each index is built in this version's transaction under a SHARE lock on its table: while it
-- is built, claims (agent_runs) or every outbox write (agent_outbox) wait; reads go on. On large
-- tables, build them beforehand with the same definitions (in Baton's schema), without blocking
-- writes, and this version then skips them; a concurrent build that failed leaves an invalid
-- index of that name: drop it and build again before migrating.
--   CREATE INDEX CONCURRENTLY IF NOT EXISTS agent_runs_claim_order ON agent_runs (conversation_id, claim_order) WHERE claim_order IS NOT NULL;
--   CREATE INDEX CONCURRENTLY IF NOT EXISTS agent_outbox_reply ON agent_outbox (reply_id) WHERE reply_id IS NOT NULL;
CREATE INDEX IF NOT EXISTS agent_runs_claim_order ON agent_runs (conversation_id, claim_order) WHERE claim_order IS NOT NULL;
CREATE INDEX IF NOT EXISTS agent_outbox_reply ON agent_outbox (reply_id) WHERE reply_id IS NOT NULL;
