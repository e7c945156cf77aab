-- The relay's record of the slots it created. A slot whose first-start backfill finished has a
-- row here; a slot without one was left by a relay that died during its backfill and is
-- recreated, so no pre-existing row is skipped.
CREATE TABLE baton_relay_slots (
    slot_name        text PRIMARY KEY,
    consistent_point pg_lsn NOT NULL,
    backfill_rows    bigint NOT NULL,
    created_at       timestamptz NOT NULL DEFAULT now()
);
