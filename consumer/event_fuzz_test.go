package consumer

import (
	"encoding/json"
	"strconv"
	"testing"
	"time"

	"github.com/batonhq/baton/wire"
)

// FuzzDecodeTurnEvent feeds decodeTurnEvent arbitrary outbox id headers and bodies, as any
// publisher with rights on the turns subjects could send them. It must never panic; what it
// accepts names the header's outbox row and a conversation id a claim can use. A turn event
// as the relay writes it (valid ids) must decode back to itself.
func FuzzDecodeTurnEvent(f *testing.F) {
	f.Add("7", []byte(`{"outbox_id":7,"conversation_id":"c1","message_id":"m1","status":"pending","attempts":0,"created_at":"2026-12-01T00:00:00Z"}`), int64(7), "c1", "m1")
	f.Add("7", []byte(`{"outbox_id":8,"conversation_id":"c1"}`), int64(8), "c1", "m1")
	f.Add("", []byte(`{}`), int64(0), "", "")
	f.Add("-1", []byte(`{"outbox_id":-1,"conversation_id":"\u0000"}`), int64(-1), "a\x00b", "m")
	f.Add("9223372036854775807", []byte(`{"outbox_id":9223372036854775807,"conversation_id":"a.b *>"}`), int64(9223372036854775807), "a.b *>", "m")
	f.Add("1", []byte(`null`), int64(1), "\xff", "m")
	f.Fuzz(func(t *testing.T, header string, body []byte, id int64, conv, messageID string) {
		if ev, err := decodeTurnEvent(header, body); err == nil {
			if !headerMeans(header, ev.OutboxID) {
				t.Fatalf("accepted body for row %d under header %q", ev.OutboxID, header)
			}
			if !validID(ev.ConversationID) {
				t.Fatalf("accepted conversation id %q", ev.ConversationID)
			}
		}

		if !validID(conv) {
			return // Postgres text and the schema's check refuse it: no relay writes it
		}
		want := wire.TurnEvent{OutboxID: id, ConversationID: conv, MessageID: messageID, Status: "pending",
			CreatedAt: time.Unix(1_700_000_000, 0).UTC()}
		data, err := json.Marshal(want)
		if err != nil {
			t.Fatalf("marshal %+v: %v", want, err)
		}
		var roundTrip wire.TurnEvent
		if err := json.Unmarshal(data, &roundTrip); err != nil {
			t.Fatalf("unmarshal %s: %v", data, err)
		}
		got, err := decodeTurnEvent(strconv.FormatInt(id, 10), data)
		if err != nil {
			t.Fatalf("decodeTurnEvent(%d, %s): %v", id, data, err)
		}
		if got != roundTrip {
			t.Fatalf("decodeTurnEvent = %+v, want %+v", got, roundTrip)
		}
	})
}

// headerMeans reports whether header parses as the outbox id (strconv accepts "+7" and "007").
func headerMeans(header string, id int64) bool {
	n, err := strconv.ParseInt(header, 10, 64)
	return err == nil && n == id
}
