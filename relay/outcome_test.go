package relay

import (
	"encoding/json"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/stretchr/testify/require"

	"github.com/batonhq/baton/wire"
)

// protocolSize is the size NATS checks against max_payload: the header block as the protocol
// writes it ("NATS/1.0\r\n", one "Key: value\r\n" per value, "\r\n") plus the body.
func protocolSize(m *nats.Msg) int {
	n := len("NATS/1.0\r\n") + len("\r\n")
	for k, vs := range m.Header {
		for _, v := range vs {
			n += len(k) + len(": ") + len(v) + len("\r\n")
		}
	}
	return n + len(m.Data)
}

// outcomeWire is an outcome body read by its wire names, as a subscriber reads it: the names
// are the contract, so they are spelled out here rather than taken from wire.OutcomeEvent.
type outcomeWire struct {
	Content          string  `json:"content"`
	ContentOmitted   bool    `json:"content_omitted"`
	ContentBytes     int     `json:"content_bytes"`
	OutboxIDs        []int64 `json:"outbox_ids"`
	OutboxIDsOmitted int     `json:"outbox_ids_omitted"`
}

func seqIDs(n int) []int64 {
	ids := make([]int64, n)
	for i := range ids {
		ids[i] = 10_000_000 + int64(i)
	}
	return ids
}

// requireOutcomeIDs checks the ids an outcome carries: a prefix of want in the header and in
// the body, each with the count of the rest.
func requireOutcomeIDs(t *testing.T, m *nats.Msg, body outcomeWire, want []int64, maxHeader, maxBody int) {
	t.Helper()
	var head []string
	if v := m.Header.Get(wire.HeaderOutboxID); v != "" {
		head = strings.Split(v, ",")
	}
	require.LessOrEqual(t, len(head), maxHeader)
	for i, s := range head {
		require.Equal(t, strconv.FormatInt(want[i], 10), s)
	}
	omitted := 0
	if v := m.Header.Get("Baton-Outbox-Ids-Omitted"); v != "" {
		var err error
		omitted, err = strconv.Atoi(v)
		require.NoError(t, err)
		require.Positive(t, omitted, "the header is there only when ids are left out")
	}
	require.Equal(t, len(want), len(head)+omitted, "header ids plus omitted count")

	require.LessOrEqual(t, len(body.OutboxIDs), maxBody)
	require.Equal(t, want[:len(body.OutboxIDs)], body.OutboxIDs)
	require.Equal(t, len(want), len(body.OutboxIDs)+body.OutboxIDsOmitted, "body ids plus omitted count")
}

func TestOutcomeMsgCapsAnsweredIDs(t *testing.T) {
	at := time.Date(2026, 11, 30, 1, 2, 3, 0, time.UTC)
	for _, tc := range []struct {
		name        string
		ids         int
		content     string
		maxPayload  int
		wantContent bool
		wantHeader  int // ids in Baton-Outbox-Id
		wantBody    int // ids in outbox_ids (-1: at most 1,000, whatever fits)
	}{
		{"few ids", 3, "hi", 1 << 20, true, 3, 3},
		{"exactly the caps", 1000, "hi", 1 << 20, true, 100, 1000},
		{"70,000 ids, content fits", 70_000, strings.Repeat("x", 500_000), 1 << 20, true, 100, 1000},
		{"70,000 ids, content does not fit", 70_000, strings.Repeat("<", 200_000), 1 << 20, false, 100, 1000},
		{"70,000 ids, tiny payload", 70_000, "hi", 4096, false, -1, -1},
		{"no max payload known", 70_000, "hi", 0, true, 100, 1000},
	} {
		t.Run(tc.name, func(t *testing.T) {
			ids := seqIDs(tc.ids)
			m, err := outcomeMsg("agent", wire.OutcomeEvent{MessageID: "r1", ConversationID: "c", Role: "assistant",
				Content: tc.content, CreatedAt: at, OutboxIDs: ids}, "", tc.maxPayload)
			require.NoError(t, err)
			if tc.maxPayload > 0 {
				require.LessOrEqual(t, protocolSize(m), tc.maxPayload)
			}
			var body outcomeWire
			require.NoError(t, json.Unmarshal(m.Data, &body))
			require.Equal(t, len(tc.content), body.ContentBytes)
			if tc.wantContent {
				require.Equal(t, tc.content, body.Content)
				require.False(t, body.ContentOmitted)
				require.Empty(t, m.Header.Get(wire.HeaderContentOmitted))
			} else {
				require.Empty(t, body.Content)
				require.True(t, body.ContentOmitted)
				require.Equal(t, "true", m.Header.Get(wire.HeaderContentOmitted))
			}
			maxHeader, maxBody := 100, 1000
			requireOutcomeIDs(t, m, body, ids, maxHeader, maxBody)
			if tc.wantHeader >= 0 {
				require.Equal(t, tc.wantHeader, len(strings.Split(m.Header.Get(wire.HeaderOutboxID), ",")))
			}
			if tc.wantBody >= 0 {
				require.Len(t, body.OutboxIDs, tc.wantBody)
			}
		})
	}
}

// Around the limit, an outcome keeps its content exactly when the whole message fits, and is
// never larger than the limit, whatever JSON escaping does to the content's size.
func TestOutcomeMsgSizeAtTheLimit(t *testing.T) {
	at := time.Date(2026, 11, 30, 1, 2, 3, 0, time.UTC)
	for _, content := range []string{strings.Repeat("a", 3000), strings.Repeat("<", 1000), strings.Repeat("\x01", 700)} {
		ev := wire.OutcomeEvent{MessageID: "r1", ConversationID: "c", Role: "assistant", Content: content, CreatedAt: at,
			OutboxIDs: seqIDs(150)}
		full, err := outcomeMsg("agent", ev, "", 0)
		require.NoError(t, err)
		size := protocolSize(full)
		for _, maxPayload := range []int{size - 1, size, size + 1} {
			m, err := outcomeMsg("agent", ev, "", maxPayload)
			require.NoError(t, err)
			require.LessOrEqual(t, protocolSize(m), maxPayload)
			require.Equal(t, maxPayload < size, m.Header.Get(wire.HeaderContentOmitted) == "true", "max %d, full %d", maxPayload, size)
		}
	}
}

// A max payload too small for an outcome without content and ids is an error, not a message
// the server would refuse on every retry.
func TestOutcomeMsgTooSmallPayloadIsAnError(t *testing.T) {
	_, err := outcomeMsg("agent", wire.OutcomeEvent{MessageID: "r1", ConversationID: "c", Role: "assistant",
		Content: "hi", OutboxIDs: seqIDs(10)}, "", 100)
	require.Error(t, err)
}
