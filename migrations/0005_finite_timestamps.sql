-- created_at must be an instant: 'infinity' and '-infinity' are refused when written.
--
-- Events carry created_at as an RFC 3339 time, which has no form for infinity, so such a row
-- could never be published as it is. Refusing it at write time gives the writer a clear error
-- (SQLSTATE 23514, constraint <table>_created_at_finite) instead of a relay that has to set the
-- change aside later.
--
-- Rows written before this version are not rewritten: their created_at is the writer's data.
-- Each constraint is added NOT VALID (new and updated rows are checked from now on, nothing is
-- scanned under the ACCESS EXCLUSIVE lock the ALTER takes) and then validated, which scans the
-- table once while producers wait, as version 4 did for its index. When an old row is not
-- finite, validation fails and the constraint stays NOT VALID (still enforced on writes) with a
-- WARNING; fix the rows and validate by hand:
--   UPDATE messages SET created_at = now() WHERE NOT isfinite(created_at);
--   ALTER TABLE messages VALIDATE CONSTRAINT messages_created_at_finite;
ALTER TABLE agent_outbox ADD CONSTRAINT agent_outbox_created_at_finite
    CHECK (isfinite(created_at)) NOT VALID;
ALTER TABLE messages ADD CONSTRAINT messages_created_at_finite
    CHECK (isfinite(created_at)) NOT VALID;

DO $$
DECLARE
    t text;
BEGIN
    FOREACH t IN ARRAY ARRAY['agent_outbox', 'messages'] LOOP
        BEGIN
            EXECUTE format('ALTER TABLE %I VALIDATE CONSTRAINT %I', t, t || '_created_at_finite');
        EXCEPTION WHEN check_violation THEN
            RAISE WARNING '%: rows with a non-finite created_at exist; constraint %_created_at_finite '
                'is enforced on new rows but not validated (see migrations/0005_finite_timestamps.sql)', t, t;
        END;
    END LOOP;
END
$$;
