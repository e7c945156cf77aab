-- Room on each page of agent_runs and operations for the update that follows every insert.
--
-- A run's record is inserted by its claim and updated once by its end (finished_at, outcome);
-- a tool call's operation is inserted when it starts and its end (status, output, error,
-- finished_at) written soon after. Neither update changes an indexed column, so each can be a
-- HOT update (no new index entries), but only when the new version fits on the same page, and
-- with the default fillfactor (100) inserts fill every page first: in baton bench turns 48 % of
-- the runs' ends got a new entry in each of agent_runs' three indexes, and most tool ends one in
-- each of operations' four. (Attaching an operation to its reply sets message_id, which is
-- indexed: that update is never HOT.)
--
-- Rows inserted from now on leave 30 % of each page free; pages written before stay as they
-- are. Changing fillfactor takes a SHARE UPDATE EXCLUSIVE lock: reads and writes go on.
ALTER TABLE agent_runs SET (fillfactor = 70);
ALTER TABLE operations SET (fillfactor = 70);
