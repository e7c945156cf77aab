-- Claim order: a turn's history is the turns of its conversation that ended before it was
-- claimed, in the order they were claimed (consumer.Turn.History). Messages' created_at cannot
-- give that order: it is the sender's transaction's start, and a message sent inside a long
-- transaction may have an earlier created_at than one sent, claimed and answered before it
-- committed.
--
-- claim_order numbers a conversation's claims 1, 2, 3, …: each run's record gets one more than
-- the conversation's largest, from a trigger, so that workers of every version record it (a
-- rolling upgrade leaves no run without one) and no role needs a new privilege. Claims of a
-- conversation are serialised by the lock each takes on the conversation's row until it
-- commits, and each reads with a snapshot taken after that lock, so later claims get larger
-- numbers; the unique index turns a claim that was not serialised into an error (23505)
-- instead of a history out of order. NULL: a run claimed before this version; its turns come
-- first in histories, by their messages' created_at.
ALTER TABLE agent_runs ADD COLUMN claim_order bigint
    CONSTRAINT agent_runs_claim_order_check CHECK (claim_order > 0);

CREATE FUNCTION baton_claim_order() RETURNS trigger
LANGUAGE plpgsql SET search_path FROM CURRENT AS $$
BEGIN
    IF NEW.claim_order IS NULL THEN
        NEW.claim_order := coalesce((SELECT max(r.claim_order) FROM agent_runs r
                                     WHERE r.conversation_id = NEW.conversation_id), 0) + 1;
    END IF;
    RETURN NEW;
END
$$;

CREATE TRIGGER agent_runs_claim_order BEFORE INSERT ON agent_runs
    FOR EACH ROW EXECUTE FUNCTION baton_claim_order();

-- agent_runs_claim_order: a conversation's runs in claim order, for the trigger's probe for the
-- largest number and for histories, which walk back from a turn's own claim. The column is
-- written once, at the insert, so the final commit's update of the run stays a heap-only (HOT)
-- update.
--
-- agent_outbox_reply: the row a message answers. Histories tell a reply of a claim-ordered
-- turn from an earlier one by it, and deleting a conversation needs it too: each deleted
-- message's foreign key action (reply_id ON DELETE SET NULL) looked for rows naming it with a
-- scan of the whole outbox. agent_outbox_unrun: finished rows that name no run (rows of an
-- adopted outbox, or recovered without a run), also from before claim order: no row Baton
-- writes now enters it.
--
-- Each index is built in this version's transaction under a SHARE lock on its table: while it
-- is built, claims (agent_runs) or every outbox write (agent_outbox) wait; reads go on. On large
-- tables, build them beforehand with the same definitions (in Baton's schema), without blocking
-- writes, and this version then skips them; a concurrent build that failed leaves an invalid
-- index of that name: drop it and build again before migrating.
--   CREATE UNIQUE INDEX CONCURRENTLY IF NOT EXISTS agent_runs_claim_order ON agent_runs (conversation_id, claim_order) WHERE claim_order IS NOT NULL;
--   CREATE INDEX CONCURRENTLY IF NOT EXISTS agent_outbox_reply ON agent_outbox (reply_id) WHERE reply_id IS NOT NULL;
--   CREATE INDEX CONCURRENTLY IF NOT EXISTS agent_outbox_unrun ON agent_outbox (conversation_id) WHERE run_id IS NULL AND status IN ('done', 'error');
CREATE UNIQUE INDEX IF NOT EXISTS agent_runs_claim_order ON agent_runs (conversation_id, claim_order) WHERE claim_order IS NOT NULL;
CREATE INDEX IF NOT EXISTS agent_outbox_reply ON agent_outbox (reply_id) WHERE reply_id IS NOT NULL;
CREATE INDEX IF NOT EXISTS agent_outbox_unrun ON agent_outbox (conversation_id) WHERE run_id IS NULL AND status IN ('done', 'error');
