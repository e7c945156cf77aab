package consumer

import "time"

// event is one turn event a conversation loop holds until its row is terminal.
type event struct {
	outboxID int64
	// seq is the source's sequence number of the message (the stream sequence), by which a
	// redelivery is recognised; 0 when the source has none.
	seq uint64
	d   delivery
}

// delivery settles a held turn event with the source that delivered it. What the verbs mean
// for the request is the conversation loop's delivery rule: an event is acked only once its
// row is terminal (done or error) or gone; until then it is marked in progress while held, or
// nacked so that it comes back later.
type delivery interface {
	// ack tells the source the event is finished with: it is not delivered again.
	ack() error
	// nak gives the event back, to be delivered again after delay (at once when 0).
	nak(delay time.Duration) error
	// inProgress tells the source the event is still held, so it does not redeliver it yet.
	inProgress() error
	// storedAt is when the source stored the event; zero when unknown.
	storedAt() time.Time
}

// noDelivery is the delivery of an event that no source keeps a record of, as the polling
// source's would be: settling it does nothing and its age is unknown. (The polling source
// wakes conversations without events, so today only tests hold such events.)
type noDelivery struct{}

func (noDelivery) ack() error              { return nil }
func (noDelivery) nak(time.Duration) error { return nil }
func (noDelivery) inProgress() error       { return nil }
func (noDelivery) storedAt() time.Time     { return time.Time{} }
