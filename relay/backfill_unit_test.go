package relay

import (
	"encoding/json"
	"strings"
	"testing"

	"github.com/jackc/pglogrepl"
	"github.com/nats-io/nats.go"
	"github.com/stretchr/testify/require"

	"github.com/batonhq/baton/wire"
)

// The backfill and the stream agree: a row the stream publishes is published by the backfill
// as the same event, and a row the stream sets aside is set aside by the backfill too (no
// poison loop there either), under a record id of its own per row.
func TestBackfillAndStreamAgree(t *testing.T) {
	row := func(id, conv, created string) outboxText {
		return outboxText{ID: id, ConversationID: conv, MessageID: "m" + id, Status: "pending", Attempts: "0", CreatedAt: created}
	}
	for name, tc := range map[string]struct {
		row        outboxText
		maxPayload int
		dead       bool
	}{
		"ordinary":                 {row("7", "c", "2026-11-30 01:02:03.123456+00"), 1 << 20, false},
		"hostile conversation":     {row("7", "a.b *", "2026-11-30 01:02:03+00"), 1 << 20, false},
		"year 1":                   {row("7", "c", "0001-01-01 00:00:00+00"), 1 << 20, false},
		"infinity":                 {row("7", "c", "infinity"), 1 << 20, true},
		"-infinity":                {row("8", "c", "-infinity"), 1 << 20, true},
		"past 9999":                {row("9", "c", "10000-01-01 00:00:00+00"), 1 << 20, true},
		"BC":                       {row("10", "c", "0044-03-15 12:00:00+00 BC"), 1 << 20, true},
		"empty created_at (NULL)":  {row("11", "c", ""), 1 << 20, true},
		"conversation id too long": {row("12", strings.Repeat("x", 201), "2026-11-30 01:02:03+00"), 1 << 20, true},
		"empty conversation id":    {row("13", "", "2026-11-30 01:02:03+00"), 1 << 20, true},
		"larger than max payload":  {row("14", strings.Repeat("c", 100)+strings.Repeat("m", 300), "2026-11-30 01:02:03+00"), 600, true},
	} {
		t.Run(name, func(t *testing.T) {
			r := tc.row
			d := decoderWithRelations(t, tc.maxPayload)
			streamed, err := d.decodeAt(0x2000, append([]byte{'I'}, insertBody(16384,
				textCols(r.ID, r.ConversationID, r.MessageID, r.Status, r.Attempts, r.CreatedAt)...)...))
			require.NoError(t, err)
			var id int64
			require.NoError(t, json.Unmarshal([]byte(r.ID), &id))
			back := backfillItem("agent", "public.agent_outbox", tc.maxPayload, id, &r)
			require.Equal(t, itemEvent, back.kind)
			require.Equal(t, tc.dead, streamed.deadLetter != "", "the stream sets it aside")
			require.Equal(t, tc.dead, back.deadLetter != "", "the backfill sets it aside")
			if !tc.dead {
				require.Equal(t, streamed.msg, back.msg, "the same event")
				var ev wire.TurnEvent
				require.NoError(t, json.Unmarshal(back.msg.Data, &ev))
				return
			}
			require.Equal(t, wire.DeadLetterTurn, back.deadLetter)
			require.Equal(t, streamed.reason, back.reason, "the same reason")
			require.Equal(t, "agent.deadletter.turn", back.msg.Subject)
			require.Equal(t, wire.DeadLetterBackfillMsgID(id), back.msg.Header.Get(nats.MsgIdHdr))
			require.LessOrEqual(t, msgSize(back.msg.Header, back.msg.Data), max(tc.maxPayload, 1<<10))
			var rec wire.DeadLetter
			require.NoError(t, json.Unmarshal(back.msg.Data, &rec))
			require.Equal(t, "0/0", rec.LSN)
			require.Equal(t, wire.DeadLetterTurn, rec.Kind)
			require.Equal(t, "public.agent_outbox", rec.Table)
			require.Equal(t, back.reason, rec.Reason)
			full, err := json.Marshal(r)
			require.NoError(t, err)
			require.Equal(t, len(full), rec.RawBytes)
			require.Equal(t, full[:len(rec.Raw)], rec.Raw, "raw is the row as JSON, cut to fit the max payload")
			if tc.maxPayload >= 1<<10 {
				var raw outboxText
				require.NoError(t, json.Unmarshal(rec.Raw, &raw))
				require.Equal(t, r, raw)
			}
		})
	}
}

// Records of different rows never share a Nats-Msg-Id (JetStream would drop all but the
// first), with each other or with the stream's records.
func TestDeadLetterBackfillMsgIDs(t *testing.T) {
	seen := map[string]bool{}
	for _, id := range []int64{0, 1, 2, 10, 1 << 40} {
		s := wire.DeadLetterBackfillMsgID(id)
		require.False(t, seen[s], s)
		seen[s] = true
		require.NotEqual(t, wire.DeadLetterMsgID(pglogrepl.LSN(0).String()), s)
	}
}

// The slot is a failover slot where the server has them (PostgreSQL 17 and newer), so that a
// promoted standby keeps it; older servers get the command they understand.
func TestCreateSlotCommand(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		version string
		want    string
	}{
		{"15.19 (Debian 15.19-0+deb12u1)", "CREATE_REPLICATION_SLOT baton LOGICAL pgoutput EXPORT_SNAPSHOT"},
		{"16.4", "CREATE_REPLICATION_SLOT baton LOGICAL pgoutput EXPORT_SNAPSHOT"},
		{"17.2", "CREATE_REPLICATION_SLOT baton LOGICAL pgoutput (SNAPSHOT 'export', FAILOVER true)"},
		{"17beta1", "CREATE_REPLICATION_SLOT baton LOGICAL pgoutput (SNAPSHOT 'export', FAILOVER true)"},
		{"18.0", "CREATE_REPLICATION_SLOT baton LOGICAL pgoutput (SNAPSHOT 'export', FAILOVER true)"},
		{"", "CREATE_REPLICATION_SLOT baton LOGICAL pgoutput EXPORT_SNAPSHOT"},
		{"devel", "CREATE_REPLICATION_SLOT baton LOGICAL pgoutput EXPORT_SNAPSHOT"},
	} {
		require.Equal(t, tc.want, createSlotCommand("baton", serverMajor(tc.version)), "server_version %q", tc.version)
	}
}
