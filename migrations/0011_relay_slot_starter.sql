-- The relay that runs a slot's first start (creating it and backfilling, or backfilling again
-- after a first start that did not finish) claims it here: a token of its session, the pid of
-- the backend that renews the claim, and when it last did. Another relay leaves the first start
-- to the claimant while the claim is renewed and that backend lives. The slot itself decides
-- which relay streams (only REPLICATION roles can use it); until it streams, this claim does,
-- and only Baton's roles write this table. NULL: no first start under way, or one by a relay
-- of an earlier version.
ALTER TABLE baton_relay_slots ADD COLUMN starter_token text;
ALTER TABLE baton_relay_slots ADD COLUMN starter_pid integer;
ALTER TABLE baton_relay_slots ADD COLUMN starter_seen timestamptz;
