package wire

import "strconv"

// Kinds of change the relay sets aside, the last token of their dead-letter subject
// <prefix>.deadletter.<kind>.
const (
	// DeadLetterAnswers is a transactional AnswersPrefix message that is not the JSON object
	// the relay expects. Any role can emit one. The outcome of its transaction is published
	// without the answered ids it would have added.
	DeadLetterAnswers = "answers"
	// DeadLetterTurn is an agent_outbox insert that cannot become a turn event (a value that
	// cannot be parsed, an event larger than the server's max payload). The row stays in
	// Postgres with its status: the workers' sweep of pending rows still finds it.
	DeadLetterTurn = "turn"
	// DeadLetterOutcome is a messages insert that cannot become an outcome event (a value that
	// cannot be parsed, an event that does not fit the max payload even without its content).
	DeadLetterOutcome = "outcome"
)

// MaxDeadLetterRaw is the most bytes of a change a dead-letter record carries in Raw (fewer
// when the server's max payload requires it); RawBytes gives the full size.
const MaxDeadLetterRaw = 64 << 10

// DeadLetter is the JSON body of a record in the dead-letter stream: one change of the
// replication stream that no retry could publish, which the relay set aside and skipped.
type DeadLetter struct {
	// LSN is the change's position in the WAL ("16/B374D848"); "0/0" for a row read by the
	// first-start backfill, which has none.
	LSN string `json:"lsn"`
	// Kind is DeadLetterAnswers, DeadLetterTurn or DeadLetterOutcome.
	Kind string `json:"kind"`
	// Table is the change's table as schema.name, "" for a logical decoding message.
	Table string `json:"table"`
	// Reason says why the change could not be published.
	Reason string `json:"reason"`
	// Raw is the change as the relay received it: the message content of a logical decoding
	// message, the pgoutput insert message (protocol version 1) of a row; for a row read by the
	// first-start backfill, a JSON object of its columns as text (id, conversation_id,
	// message_id, status, attempts, created_at). At most MaxDeadLetterRaw bytes; base64 in JSON.
	Raw []byte `json:"raw"`
	// RawBytes is the full size of the change, which Raw may cut.
	RawBytes int `json:"raw_bytes"`
}

// DeadLetterMsgID is the Nats-Msg-Id of the dead-letter record of the change at lsn, the WAL
// position in Postgres's text form ("16/B374D848", DeadLetter.LSN): a replay of the change is
// deduplicated like any event.
func DeadLetterMsgID(lsn string) string { return "deadletter:" + lsn }

// DeadLetterNthMsgID is the Nats-Msg-Id of the dead-letter record of the change at lsn that is
// the nth (from 0) change sharing that WAL position: the rows of one COPY (one multi-insert WAL
// record) all arrive at the same position. The first keeps DeadLetterMsgID's form; the others
// are "deadletter:<lsn>:<n>". A replay sends a position's changes again in the same order, so
// each record keeps its id and is deduplicated.
func DeadLetterNthMsgID(lsn string, n int) string {
	if n == 0 {
		return DeadLetterMsgID(lsn)
	}
	return DeadLetterMsgID(lsn) + ":" + strconv.Itoa(n)
}

// DeadLetterShardMsgID is the Nats-Msg-Id of the dead-letter record that shard shard of
// shards sharded relays (baton relay --shard <shard>/<shards>) makes of the nth (from 0) change
// at lsn in its own stream of changes: "deadletter:shard:<shard>/<shards>:<lsn>", and
// "deadletter:shard:<shard>/<shards>:<lsn>:<n>" for n > 0, DeadLetterNthMsgID's forms after the
// shard. A shard numbers only the changes its publication sends it, so two shards may each
// have an nth change at one position (two rows of one COPY, one in each shard): the shard in
// the id keeps their records apart, where DeadLetterNthMsgID's id would let JetStream drop the
// second as a duplicate. A replay of the shard's slot sends the same changes in the same
// order, so each record keeps its id and is deduplicated. A change every shard receives (a
// logical decoding message) gets one record per shard. A relay that is not sharded uses
// DeadLetterNthMsgID.
func DeadLetterShardMsgID(shard, shards int, lsn string, n int) string {
	id := "deadletter:shard:" + strconv.Itoa(shard) + "/" + strconv.Itoa(shards) + ":" + lsn
	if n == 0 {
		return id
	}
	return id + ":" + strconv.Itoa(n)
}

// DeadLetterBackfillMsgID is the Nats-Msg-Id of the dead-letter record of the outbox row
// outboxID when the first-start backfill set it aside: such a row has no WAL position, and a
// backfill run again (after a relay died during it) is deduplicated like its turn events.
func DeadLetterBackfillMsgID(outboxID int64) string {
	return "deadletter:backfill:" + strconv.FormatInt(outboxID, 10)
}

// DeadLetterSubject returns the subject of dead-letter records of kind: <prefix>.deadletter.<kind>.
// It does not validate its arguments; callers pass a prefix accepted by ValidatePrefix and
// DeadLetterAnswers, DeadLetterTurn or DeadLetterOutcome.
func DeadLetterSubject(prefix, kind string) string {
	return prefix + "." + KindDeadLetter + "." + kind
}
