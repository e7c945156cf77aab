-- An outbox row names a user message of its own conversation, for every writer.
--
-- Version 1 checked conversation_id and message_id separately, so a row could name a message of
-- conversation A as a turn of conversation B (the worker would lock and answer B with A's
-- message), or name an assistant or error message as a turn (the worker would answer the agent's
-- own words as a request: the app role could queue one). The foreign key below checks the
-- conversation, the message and its role together. agent_outbox gains message_role, always
-- 'user' (its default, which no role may insert another value into, and a CHECK), so the key
-- can name the role; messages gains a unique constraint on (conversation_id, id, role), which id
-- alone already makes unique: its index costs one more entry per message written and can never
-- fail to build. The composite key covers everything the key on message_id alone did (all its
-- columns are NOT NULL), including ON DELETE CASCADE, so that key is dropped once the new one is
-- validated. Adding a column with a constant default rewrites nothing.
--
-- Building the index takes a SHARE lock on messages and adding the key a SHARE ROW EXCLUSIVE
-- lock on both tables: producers wait while messages is indexed and agent_outbox checked, as for
-- version 4's index. Rows written before this version are not rewritten: the key is added
-- NOT VALID (new and changed rows are checked from now on) and then validated. When an old row
-- names a message of another conversation, or one that is not a user message, validation fails
-- and the key stays NOT VALID (still enforced on writes) with a WARNING, and the key on
-- message_id stays too. Such a row is the writer's error to look at: find it with
--   SELECT o.* FROM agent_outbox o JOIN messages m ON m.id = o.message_id
--   WHERE m.conversation_id <> o.conversation_id OR m.role <> 'user';
-- then fix or delete it, validate by hand and drop the key the new one replaces:
--   ALTER TABLE agent_outbox VALIDATE CONSTRAINT agent_outbox_user_message_fkey;
--   ALTER TABLE agent_outbox DROP CONSTRAINT agent_outbox_message_id_fkey;
ALTER TABLE messages ADD CONSTRAINT messages_conversation_id_id_role_key UNIQUE (conversation_id, id, role);

ALTER TABLE agent_outbox ADD COLUMN message_role text NOT NULL DEFAULT 'user'
    CONSTRAINT agent_outbox_message_role_check CHECK (message_role = 'user');

ALTER TABLE agent_outbox ADD CONSTRAINT agent_outbox_user_message_fkey
    FOREIGN KEY (conversation_id, message_id, message_role) REFERENCES messages (conversation_id, id, role)
    ON DELETE CASCADE NOT VALID;

DO $$
BEGIN
    BEGIN
        ALTER TABLE agent_outbox VALIDATE CONSTRAINT agent_outbox_user_message_fkey;
    EXCEPTION WHEN foreign_key_violation THEN
        RAISE WARNING 'agent_outbox: rows that do not name a user message of their conversation exist; '
            'constraint agent_outbox_user_message_fkey is enforced on new rows but not validated '
            '(see migrations/0007_outbox_message_conversation.sql)';
        RETURN;
    END;
    ALTER TABLE agent_outbox DROP CONSTRAINT agent_outbox_message_id_fkey;
END
$$;
