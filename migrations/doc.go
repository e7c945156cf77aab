// Package migrations holds Baton's versioned SQL schema, embedded in the binary, and applies it.
//
// Up applies each version not yet recorded in baton_schema_migrations in its own transaction,
// holding a lock on that table that only roles that may write it can take (not an advisory lock,
// whose key any role could take and sit on), so it is safe to run at every start and from many
// processes at once. Versions only add: the tables and columns named in Baton's design
// (conversations, messages, agent_outbox, operations) and the publication "baton" are never dropped.
//
// EnsureShards adds, for sharded relays, the publications <publication>_0 … _<N−1>, each
// filtered on ShardPredicate so that every conversation is in exactly one of them; it is
// idempotent for the same N and changes N only while no shard slot exists (see its doc).
package migrations
