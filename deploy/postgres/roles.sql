-- Least-privilege roles for Baton.
--
--   baton_migrator  owns Baton's tables, function and publication; runs `baton migrate`.
--   baton_app       your application (the producer): creates conversations, inserts user
--                   messages and their outbox rows with the default queue fields, reads state.
--   baton_relay     `baton relay`: REPLICATION, reads the outbox's queue columns (first-start
--                   backfill), records its slots. It cannot read messages.
--   baton_worker    agent workers (the consumer package): claims, leases and final commits.
--   baton_console   `baton console`: reads what its pages show (every message and the
--                   system's state, not the internal error text or tool data workers record)
--                   and sends user messages with baton_app's insert rights.
--
-- Run it as a superuser (or as the database owner with CREATEROLE and REPLICATION, who is also a
-- member of baton_migrator once the schema is owned by it), connected to the Baton database:
--
--   psql -v ON_ERROR_STOP=1 -d baton -f deploy/postgres/roles.sql
--
-- Baton's schema and publication other than public and baton (BATON_SCHEMA, BATON_PUBLICATION)
-- are given as the settings baton.schema and baton.publication; the shard publications
-- <publication>_<K> of `baton migrate --shards` are found by name:
--
--   PGOPTIONS='-c baton.schema=agents -c baton.publication=agents_pub' \
--     psql -v ON_ERROR_STOP=1 -d baton -f deploy/postgres/roles.sql
--
-- It is safe to run again, and must be run again after every `baton migrate` that adds tables or
-- columns Baton writes (version 8: trace_context):
-- roles are created when missing, and every table's privileges are reset to exactly what is
-- granted here. Run on a database without Baton's schema, it creates the roles and the schema
-- privileges the migrator needs and stops there (first install: roles.sql, `baton migrate` as
-- baton_migrator, roles.sql again). Run after `baton migrate` was applied by another role (a
-- superuser, say), it hands the schema's ownership to baton_migrator.
--
-- Passwords are never set here. Set them separately, from your secret store:
--
--   ALTER ROLE baton_relay PASSWORD '...';     -- or, in psql: \password baton_relay
--
-- The roles log in directly. The app and worker roles may instead be granted to users of your
-- own (GRANT baton_app TO myapp;), whose privileges are then inherited; REPLICATION is never
-- inherited, so the relay must log in as baton_relay (or as another role WITH REPLICATION).
-- Managed services: where REPLICATION cannot be granted, use the provider's role for it
-- (Amazon RDS: GRANT rds_replication TO baton_relay; Cloud SQL: ALTER ROLE ... WITH REPLICATION
-- as cloudsqlsuperuser, with cloudsql.logical_decoding on).
--
-- Notes on what each role needs:
--   * agent_outbox.id and operations.id are identity columns: inserting needs no privilege on
--     their sequences.
--   * SELECT ... FOR NO KEY UPDATE (the worker's conversation claim lock) needs UPDATE on a
--     column of conversations, which the worker has for its metadata columns anyway.
--   * pg_logical_emit_message (the worker's final commit names the answered outbox rows in the
--     WAL with it) is executable by every role by default and needs no REPLICATION. If your
--     cluster revoked it from PUBLIC, grant it to baton_worker.
--   * The relay reads pg_replication_slots, pg_stat_activity and pg_publication*, and
--     creates its slot over a replication connection: REPLICATION and CONNECT are all it needs
--     for that. Its replication connections are logical ones, to a database
--     (replication=database): in pg_hba.conf they match the lines for that database (or `all`),
--     as its other connections do, never the `replication` lines.
--   * baton_relay can copy the whole cluster unless pg_hba.conf stops it. REPLICATION also
--     admits physical replication connections, which match pg_hba.conf's `replication` lines,
--     and the default file lets every role in with them (`host replication all ...`): then
--     `pg_basebackup -U baton_relay` copies every database of the cluster and every role's
--     password verifier (pg_authid). The relay never makes such a connection. Refuse them to it
--     with a line above all others, then reload (SELECT pg_reload_conf()):
--       host    replication    baton_relay    all    reject
--     (and `local replication baton_relay reject` where others may log in on the server's
--     host). `host` covers TCP with or without SSL; `replication` matches physical connections
--     only, so the relay's logical ones still match your database lines and keep working.
--     This file cannot do it: pg_hba.conf is the server's file. Check it as a superuser (only
--     superusers may read pg_hba_file_rules): the first line naming baton_relay, or all, must
--     be its reject line:
--       SELECT line_number, type, database, user_name, address, auth_method, error
--       FROM pg_hba_file_rules WHERE 'replication' = ANY (database) ORDER BY line_number;
--     `baton status` shows this too: as a superuser it reads the rules and warns when one lets
--     the relay in; as any other role it prints the line and the check.
--   * Column privileges make the app's queue fields unwritable: an INSERT naming status,
--     attempts, run_id or any other queue column fails with SQLSTATE 42501.
--   * Privileges cannot restrict values, so messages has row-level security: baton_app may
--     insert only role 'user' messages and baton_worker only 'assistant' and 'error' ones (a
--     forged outcome fails with SQLSTATE 42501), and both may read every message. Each role
--     sees only what a policy gives it: a role of your own that reads messages (a reporting
--     role, a console) needs a policy besides its grant, such as
--       CREATE POLICY messages_reports_select ON public.messages FOR SELECT TO reports USING (true);
--     or it reads no rows. The owner (baton_migrator) and superusers are not subject to it.
--     Logical decoding ignores it: the relay publishes replies as before.
--   * An outbox row must name a user message of its own conversation: a foreign key (migration
--     7) checks it for every role, the owner included.
--   * baton_relay cannot read messages, but REPLICATION still lets it decode the changes
--     committed from its slot's creation on, whatever its table privileges: the replies it
--     publishes, and, with a slot of its own and another output plugin installed on the server
--     (test_decoding ships with PostgreSQL), every new row of every table, user messages'
--     content included. Guard its password like read access to all new data (to all data of
--     the cluster, old and new, where pg_hba.conf lets it make physical replication
--     connections: see above).
--   * CREATE on schema public is revoked from PUBLIC (the default since PostgreSQL 15; clusters
--     upgraded from older versions keep the old grant), so no role but the migrator creates
--     objects there. Grant it back to roles of your own that need it.

-- Roles, created when missing.
DO $$
BEGIN
    IF NOT EXISTS (SELECT FROM pg_roles WHERE rolname = 'baton_migrator') THEN
        CREATE ROLE baton_migrator LOGIN;
    END IF;
    IF NOT EXISTS (SELECT FROM pg_roles WHERE rolname = 'baton_app') THEN
        CREATE ROLE baton_app LOGIN;
    END IF;
    IF NOT EXISTS (SELECT FROM pg_roles WHERE rolname = 'baton_relay') THEN
        CREATE ROLE baton_relay LOGIN REPLICATION;
    END IF;
    IF NOT EXISTS (SELECT FROM pg_roles WHERE rolname = 'baton_worker') THEN
        CREATE ROLE baton_worker LOGIN;
    END IF;
    IF NOT EXISTS (SELECT FROM pg_roles WHERE rolname = 'baton_console') THEN
        CREATE ROLE baton_console LOGIN;
    END IF;
END
$$;

-- The relay's one role attribute; set again in case the role existed without it.
ALTER ROLE baton_relay WITH LOGIN REPLICATION;

-- A role that existed before keeps its attributes and memberships: take away those that would
-- let it past what this file grants (SUPERUSER and BYPASSRLS ignore row-level security,
-- CREATEROLE and CREATEDB reach beyond Baton's tables, REPLICATION decodes everything), and its
-- memberships in Baton's other roles and in pg_read_all_data and pg_write_all_data, whose
-- privileges and policies a member gets. Grants of Baton's roles to roles of your own stay.
DO $$
DECLARE
    r record;
    left_over text;
BEGIN
    FOR r IN SELECT rolname, rolreplication FROM pg_roles
             WHERE rolname IN ('baton_app', 'baton_relay', 'baton_worker', 'baton_console')
               AND (rolsuper OR rolbypassrls OR rolcreaterole OR rolcreatedb
                    OR (rolreplication AND rolname <> 'baton_relay')) LOOP
        EXECUTE format('ALTER ROLE %I WITH NOSUPERUSER NOBYPASSRLS NOCREATEROLE NOCREATEDB', r.rolname);
        IF r.rolname <> 'baton_relay' AND r.rolreplication THEN
            EXECUTE format('ALTER ROLE %I WITH NOREPLICATION', r.rolname);
        END IF;
    END LOOP;
    FOR r IN SELECT m.rolname AS member, g.rolname AS grp
             FROM pg_auth_members a JOIN pg_roles m ON m.oid = a.member JOIN pg_roles g ON g.oid = a.roleid
             WHERE m.rolname IN ('baton_app', 'baton_relay', 'baton_worker', 'baton_console')
               AND g.rolname IN ('baton_migrator', 'baton_app', 'baton_relay', 'baton_worker', 'baton_console',
                                 'pg_read_all_data', 'pg_write_all_data') LOOP
        EXECUTE format('REVOKE %I FROM %I', r.grp, r.member);
    END LOOP;
    -- A membership granted by another role than the one running this file may survive REVOKE.
    SELECT string_agg(g.rolname || ' to ' || m.rolname, ', ') INTO left_over
    FROM pg_auth_members a JOIN pg_roles m ON m.oid = a.member JOIN pg_roles g ON g.oid = a.roleid
    WHERE m.rolname IN ('baton_app', 'baton_relay', 'baton_worker', 'baton_console')
      AND g.rolname IN ('baton_migrator', 'baton_app', 'baton_relay', 'baton_worker', 'baton_console',
                        'pg_read_all_data', 'pg_write_all_data');
    IF left_over IS NOT NULL THEN
        RAISE EXCEPTION 'revoke these role grants by hand (as the role that granted them): %', left_over;
    END IF;
END
$$;

-- The database and the schema. CREATE on the database lets the migrator create and own the
-- publication; CREATE on the schema lets it create tables.
DO $$
BEGIN
    EXECUTE format('GRANT CONNECT ON DATABASE %I TO baton_migrator, baton_app, baton_relay, baton_worker, baton_console',
                   current_database());
    EXECUTE format('GRANT CREATE ON DATABASE %I TO baton_migrator', current_database());
END
$$;
-- Baton's schema is baton.schema (default public; see the top of this file). One that does not
-- exist yet is created by `baton migrate` (CREATE on the database), owned by the migrator.
REVOKE CREATE ON SCHEMA public FROM PUBLIC;
DO $$
DECLARE
    s text := coalesce(nullif(current_setting('baton.schema', true), ''), 'public');
BEGIN
    IF to_regnamespace(quote_ident(s)) IS NULL THEN
        RAISE NOTICE 'schema % does not exist yet: `baton migrate` creates it; run this file again after it', s;
        RETURN;
    END IF;
    EXECUTE format('REVOKE CREATE ON SCHEMA %I FROM PUBLIC', s);
    EXECUTE format('GRANT USAGE, CREATE ON SCHEMA %I TO baton_migrator', s);
    EXECUTE format('GRANT USAGE ON SCHEMA %I TO baton_app, baton_relay, baton_worker, baton_console', s);
END
$$;

-- Ownership and table privileges, once `baton migrate` created the schema.
DO $$
DECLARE
    s text := coalesce(nullif(current_setting('baton.schema', true), ''), 'public');
    pub text := coalesce(nullif(current_setting('baton.publication', true), ''), 'baton');
    missing text;
    p record;
BEGIN
    IF to_regnamespace(quote_ident(s)) IS NULL OR to_regclass(quote_ident(s) || '.agent_outbox') IS NULL THEN
        RAISE NOTICE 'Baton schema not found in schema % of database %: run `baton migrate` as baton_migrator, then run this file again',
            s, current_database();
        RETURN;
    END IF;
    -- Every name below is Baton's, in its schema: the search_path of this block is that schema
    -- alone (pg_catalog is searched first anyway).
    PERFORM set_config('search_path', quote_ident(s), true);
    SELECT string_agg(t, ', ') INTO missing
    FROM unnest(ARRAY['conversations', 'messages', 'agent_outbox', 'operations', 'agent_runs',
                      'baton_relay_slots', 'baton_schema_migrations']) AS t
    WHERE to_regclass(quote_ident(s) || '.' || t) IS NULL;
    IF missing IS NOT NULL THEN
        RAISE EXCEPTION 'Baton schema in database % is incomplete (missing %): run `baton migrate` first',
            current_database(), missing;
    END IF;

    -- The migrator owns everything Baton's migrations create (a no-op when it created them).
    -- Identity sequences follow their tables.
    ALTER TABLE conversations OWNER TO baton_migrator;
    ALTER TABLE messages OWNER TO baton_migrator;
    ALTER TABLE agent_outbox OWNER TO baton_migrator;
    ALTER TABLE operations OWNER TO baton_migrator;
    ALTER TABLE agent_runs OWNER TO baton_migrator;
    ALTER TABLE baton_relay_slots OWNER TO baton_migrator;
    ALTER TABLE baton_schema_migrations OWNER TO baton_migrator;
    ALTER FUNCTION baton_fence(boolean, text) OWNER TO baton_migrator;
    ALTER FUNCTION baton_claim_order() OWNER TO baton_migrator;
    -- The publication and the shard publications <publication>_<K> (baton migrate --shards).
    FOR p IN SELECT pubname FROM pg_publication
             WHERE pubname = pub OR (left(pubname, length(pub) + 1) = pub || '_'
                                     AND substr(pubname, length(pub) + 2) ~ '^[0-9]+$') LOOP
        EXECUTE format('ALTER PUBLICATION %I OWNER TO baton_migrator', p.pubname);
    END LOOP;

    -- Start from nothing, so running this file again converges on what it grants. Revoking a
    -- table's privileges also revokes its column privileges.
    REVOKE ALL ON conversations, messages, agent_outbox, operations,
        agent_runs, baton_relay_slots, baton_schema_migrations
        FROM PUBLIC, baton_app, baton_relay, baton_worker, baton_console;
    REVOKE ALL ON FUNCTION baton_fence(boolean, text) FROM PUBLIC, baton_app, baton_relay, baton_worker, baton_console;

    -- baton_app: producer.CreateConversation, producer.Send and SendTx (which read back the
    -- message and outbox row of a retried id), and reading the conversation. Queue fields keep
    -- their defaults: status, attempts, run_id, lease and reply columns are not insertable.
    -- Its messages are user messages (the policies below). trace_context is the sender's W3C
    -- traceparent (migration 8), which everyone who reads it checks.
    GRANT SELECT, INSERT (id) ON conversations TO baton_app;
    GRANT SELECT, INSERT (id, conversation_id, role, content) ON messages TO baton_app;
    GRANT SELECT, INSERT (conversation_id, message_id, trace_context) ON agent_outbox TO baton_app;

    -- baton_relay: the first-start backfill reads the unfinished outbox rows' queue columns
    -- (never last_error, nor any message); the slot record is its own. Streaming needs no table
    -- privilege: REPLICATION.
    GRANT SELECT (id, conversation_id, message_id, status, attempts, created_at)
        ON agent_outbox TO baton_relay;
    GRANT SELECT, INSERT, UPDATE ON baton_relay_slots TO baton_relay;

    -- baton_worker: claims (lock the conversation, take pending rows), leases, tool operations,
    -- the final commit, recovery. It deletes nothing. A reply's trace_context is the turn span's.
    GRANT SELECT, UPDATE (last_message_at, unread_count) ON conversations TO baton_worker;
    GRANT SELECT, INSERT (id, conversation_id, role, content, trace_context) ON messages TO baton_worker;
    GRANT SELECT, UPDATE (status, attempts, processed_at, run_id, lease_expires_at, reply_id,
                          last_error, available_at)
        ON agent_outbox TO baton_worker;
    GRANT SELECT, INSERT (run_id, conversation_id, tool, effect, input),
          UPDATE (message_id, status, output, error, finished_at)
        ON operations TO baton_worker;
    GRANT SELECT, INSERT (run_id, conversation_id, outbox_ids, worker),
          UPDATE (finished_at, outcome, error)
        ON agent_runs TO baton_worker;
    GRANT EXECUTE ON FUNCTION baton_fence(boolean, text) TO baton_worker;

    -- baton_console: reads what its pages show (conversations, messages, the schema version;
    -- of outbox rows, runs and operations exactly the columns its queries and the status
    -- report read: never the rows' last_error, the runs' error, nor the tools' input, output
    -- and error, internal text a worker wrote; the slot comes from pg_replication_slots,
    -- readable by all) and sends like baton_app: exactly its insert rights, user messages only
    -- (the policies below). It updates and deletes nothing.
    GRANT SELECT, INSERT (id) ON conversations TO baton_console;
    GRANT SELECT, INSERT (id, conversation_id, role, content) ON messages TO baton_console;
    GRANT SELECT (id, conversation_id, message_id, status, attempts, created_at, available_at,
                  processed_at, run_id, lease_expires_at, reply_id),
          INSERT (conversation_id, message_id, trace_context)
        ON agent_outbox TO baton_console;
    GRANT SELECT (run_id, conversation_id, outbox_ids, worker, started_at, finished_at, outcome)
        ON agent_runs TO baton_console;
    GRANT SELECT (id, run_id, conversation_id, tool, effect, status, started_at, finished_at)
        ON operations TO baton_console;
    GRANT SELECT ON baton_schema_migrations TO baton_console;

    -- Who may write which messages: the app user messages, the worker replies. Policies are
    -- dropped and created again, so running this file again converges; the owner is exempt.
    ALTER TABLE messages ENABLE ROW LEVEL SECURITY;
    DROP POLICY IF EXISTS messages_app_select ON messages;
    DROP POLICY IF EXISTS messages_app_insert ON messages;
    DROP POLICY IF EXISTS messages_worker_select ON messages;
    DROP POLICY IF EXISTS messages_worker_insert ON messages;
    DROP POLICY IF EXISTS messages_console_select ON messages;
    DROP POLICY IF EXISTS messages_console_insert ON messages;
    CREATE POLICY messages_app_select ON messages FOR SELECT TO baton_app USING (true);
    CREATE POLICY messages_app_insert ON messages FOR INSERT TO baton_app
        WITH CHECK (role = 'user');
    CREATE POLICY messages_worker_select ON messages FOR SELECT TO baton_worker USING (true);
    CREATE POLICY messages_worker_insert ON messages FOR INSERT TO baton_worker
        WITH CHECK (role IN ('assistant', 'error'));
    CREATE POLICY messages_console_select ON messages FOR SELECT TO baton_console USING (true);
    CREATE POLICY messages_console_insert ON messages FOR INSERT TO baton_console
        WITH CHECK (role = 'user');
END
$$;
