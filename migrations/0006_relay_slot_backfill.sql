-- The relay records a slot before it creates it, and marks the record when the slot's
-- first-start backfill finished.
--
-- Version 2 wrote a row only after the backfill, so a slot with no row could be Baton's own,
-- left by a relay killed during its backfill, or anyone else's: the relay dropped both. Now a
-- row with backfill_done = false is Baton's unfinished slot (recreated on the next start, which
-- backfills again), and a slot with no row is not Baton's: the relay refuses it unless started
-- with --recreate-slot.
--
-- Rows that exist were written after a finished backfill: they default to true, and so does a
-- row written by a relay of an earlier version. consistent_point is NULL until the slot exists.
ALTER TABLE baton_relay_slots ADD COLUMN backfill_done boolean NOT NULL DEFAULT true;
ALTER TABLE baton_relay_slots ALTER COLUMN consistent_point DROP NOT NULL;
