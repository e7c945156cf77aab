// Package relay carries committed outbox rows from Postgres to NATS JetStream.
//
// A Relay tails a publication with logical replication (pgoutput) and publishes every insert
// into agent_outbox as a turn event on <prefix>.turns.<conv>, and every reply or error message
// as an outcome event on <prefix>.outcomes.<conv>. What those events are on NATS (subjects,
// headers, bodies, Nats-Msg-Ids, stream names) is the contract of package wire.
//
// Guarantees, each kept by the code named:
//   - Nothing is lost (pipeline.advance): the LSN confirmed to Postgres is the end of the
//     newest transaction whose events, with every transaction before it, JetStream
//     acknowledged. Write, flush and apply positions are all set to it explicitly.
//   - Nothing is doubled within JetStream's duplicate window: each event carries a
//     Nats-Msg-Id derived from its row (wire.TurnMsgID, wire.OutcomeMsgID), and a replay
//     after a crash republishes the same ids. Consumers dedupe by outbox id beyond the window.
//   - Per-conversation order (pipeline.handle): an event is published only after every
//     earlier event of its subject has a PubAck, and any publish error restarts the session
//     from the confirmed LSN.
//   - No poison loop (decoder, backfillItem, pipeline): a change no retry can publish (a malformed
//     wire.AnswersPrefix message, a value that cannot be parsed, an event that cannot fit the
//     server's max payload) becomes a wire.DeadLetter record on <prefix>.deadletter.<kind>, in the
//     stream Config.DeadLetterStream, published in the change's place like any event: its
//     transaction is confirmed only after the record's PubAck. The rest of the transaction
//     is published; a skipped outbox row stays pending in Postgres for the workers' sweep.
//     Each record is logged at ERROR and counted (baton_relay_deadletter_total{kind}).
//     Retryable failures (NATS down, timeouts) skip nothing.
//   - A quiet outbox holds no WAL: keepalive WAL ends are confirmed between transactions when
//     nothing is in flight.
//   - First start migrates a polling backlog: the slot's exported snapshot is used to
//     publish every pending or processing row before streaming from the consistent point.
//     A row the stream would set aside is set aside by the backfill too (backfillItem).
//   - One relay per slot streams; others stand by (the slot's own exclusivity, and a claim of
//     its first start: standby.go) and take over when it goes away.
//   - No unfinished turn event is dropped by JetStream (ensureStreams, StreamSettings): the
//     turns stream has work-queue retention, no age limit and discard new, so only the
//     workers' acknowledgement removes an event, and a full stream refuses new ones. Such a
//     refusal (streamFullError) ends the session like any failed publish, with the LSN held;
//     Run retries within streamFullMaxBackoff, raises baton_relay_stream_full{stream} and
//     logs once per episode, and the gauge falls back once the stream stores an event again.
package relay
