-- An outbox row's conversation is its message's conversation, for every writer.
--
-- Version 1 checked conversation_id and message_id separately, so a row could name a message of
-- conversation A as a turn of conversation B: the worker would lock and answer B with A's
-- message. The foreign key below checks the pair. It needs a unique constraint on
-- messages (conversation_id, id), which id alone already makes unique: the new index costs one
-- more entry per message written (about the size of the primary key) and can never fail to
-- build. The composite key covers everything the key on message_id alone did (both columns are
-- NOT NULL), including ON DELETE CASCADE, so that key is dropped once the new one is validated.
--
-- Building the index takes a SHARE lock on messages and adding the key a SHARE ROW EXCLUSIVE
-- lock on both tables: producers wait while messages is indexed and agent_outbox checked, as for
-- version 4's index. Rows written before this version are not rewritten: the key is added
-- NOT VALID (new and changed rows are checked from now on) and then validated. When an old row
-- names a message of another conversation, validation fails and the key stays NOT VALID (still
-- enforced on writes) with a WARNING, and the key on message_id stays too. Such a row is the
-- writer's error to look at: find it with
--   SELECT o.* FROM agent_outbox o JOIN messages m ON m.id = o.message_id
--   WHERE m.conversation_id <> o.conversation_id;
-- then fix or delete it, validate by hand and drop the key the new one replaces:
--   ALTER TABLE agent_outbox VALIDATE CONSTRAINT agent_outbox_message_conversation_fkey;
--   ALTER TABLE agent_outbox DROP CONSTRAINT agent_outbox_message_id_fkey;
ALTER TABLE messages ADD CONSTRAINT messages_conversation_id_id_key UNIQUE (conversation_id, id);

ALTER TABLE agent_outbox ADD CONSTRAINT agent_outbox_message_conversation_fkey
    FOREIGN KEY (conversation_id, message_id) REFERENCES messages (conversation_id, id)
    ON DELETE CASCADE NOT VALID;

DO $$
BEGIN
    BEGIN
        ALTER TABLE agent_outbox VALIDATE CONSTRAINT agent_outbox_message_conversation_fkey;
    EXCEPTION WHEN foreign_key_violation THEN
        RAISE WARNING 'agent_outbox: rows whose conversation is not their message''s exist; constraint '
            'agent_outbox_message_conversation_fkey is enforced on new rows but not validated '
            '(see migrations/0007_outbox_message_conversation.sql)';
        RETURN;
    END;
    ALTER TABLE agent_outbox DROP CONSTRAINT agent_outbox_message_id_fkey;
END
$$;
