package statusreport

import (
	"bytes"
	"encoding/json"
	"testing"

	"github.com/stretchr/testify/require"
)

// sharded is healthy() run by two shard relays: no main slot, both shard slots streaming.
func sharded() *Report {
	r := healthy()
	r.Slot = Slot{Name: "baton"}
	shard := func(name string, pid int) Slot {
		s := healthy().Slot
		s.Name, s.ActivePID = name, ptr(pid)
		return s
	}
	r.Shards = &Shards{Publication: "baton", Count: 2, Missing: []string{}, Stray: []Slot{},
		Slots: []Slot{shard("baton_0", 5000), shard("baton_1", 5001)}}
	return r
}

func TestStatusEvaluateShards(t *testing.T) {
	for _, tt := range []struct {
		name      string
		change    func(r *Report)
		attention []string
		warnings  []string
	}{
		{name: "healthy without a main slot", change: func(*Report) {}},
		{name: "main slot too", change: func(r *Report) { r.Slot = healthy().Slot }},
		{name: "shard slot missing", change: func(r *Report) { r.Shards.Slots[1] = Slot{Name: "baton_1"} },
			attention: []string{"replication slot \"baton_1\" does not exist", "start `baton relay --shard 1/2`"}},
		{name: "shard slot lost", change: func(r *Report) { r.Shards.Slots[0].WALStatus = "lost" },
			attention: []string{"pg_drop_replication_slot('baton_0')"}},
		{name: "shard slot lagging past its reserve", change: func(r *Report) { r.Shards.Slots[1].WALStatus = "unreserved" },
			attention: []string{`replication slot "baton_1" is about to be lost`}},
		{name: "shard slot extended", change: func(r *Report) { r.Shards.Slots[0].WALStatus = "extended" },
			warnings: []string{`replication slot "baton_0" retains more WAL than max_wal_size`}},
		{name: "shard slot inactive", change: func(r *Report) { r.Shards.Slots[0].Active = false },
			warnings: []string{`slot "baton_0" is inactive and retains 32 B of WAL; start ` + "`baton relay --shard 0/2`"}},
		{name: "shard slot unreadable", change: func(r *Report) { r.Shards.Slots[0].Error = "read slot baton_0: boom" },
			attention: []string{"slot: read slot baton_0: boom"}},
		{name: "shard publication missing", change: func(r *Report) { r.Shards.Missing = []string{"baton_0"} },
			attention: []string{`shard publication "baton_0" does not exist`}},
		{name: "stray slot", change: func(r *Report) {
			r.Shards.Stray = []Slot{{Name: "baton_2", Exists: true, RetainedWALBytes: ptr(int64(2048))}}
		},
			warnings: []string{`replication slot "baton_2" is not one of the 2 shards' and retains 2.0 KiB of WAL`}},
		{name: "shards unreadable", change: func(r *Report) { r.Shards.Error = "read shard slots: boom" },
			attention: []string{"shards: read shard slots: boom"}},
		{name: "not sharded: the main slot missing needs attention", change: func(r *Report) { r.Shards = nil },
			attention: []string{`replication slot "baton" does not exist`}},
	} {
		t.Run(tt.name, func(t *testing.T) {
			r := sharded()
			tt.change(r)
			r.Evaluate()
			require.Len(t, r.Attention, min(len(tt.attention), 1), "attention: %q", r.Attention)
			for _, want := range tt.attention {
				require.Contains(t, r.Attention[0], want)
			}
			requireEach(t, "warnings", r.Warnings, tt.warnings)
			var text bytes.Buffer
			require.NoError(t, WriteText(&text, r))
		})
	}
}

func TestStatusWriteShards(t *testing.T) {
	r := sharded()
	r.Shards.Slots[1] = Slot{Name: "baton_1"}
	r.Shards.Stray = []Slot{{Name: "baton_2", Exists: true, WALStatus: "reserved", ConfirmedLSN: "0/5", LagBytes: ptr(int64(4096)),
		RetainedWALBytes: ptr(int64(8192))}}
	r.Evaluate()
	var b bytes.Buffer
	require.NoError(t, WriteText(&b, r))
	require.Contains(t, b.String(), `Replication slot
  slot    baton
  exists  no (sharded: the shard relays' slots are below)

Shards   2 (publications baton_0 … baton_1)
  SHARD  SLOT     ACTIVE          WAL STATUS  CONFIRMED LSN  LAG      RETAINED WAL
  0/2    baton_0  yes (pid 5000)  reserved    0/20           16 B     32 B
  1/2    baton_1  does not exist  -           -              -        -
  stray  baton_2  no              reserved    0/5            4.0 KiB  8.0 KiB
`)

	b.Reset()
	require.NoError(t, WriteJSON(&b, r))
	var raw map[string]any
	require.NoError(t, json.Unmarshal(b.Bytes(), &raw))
	shards := raw["shards"].(map[string]any)
	require.Equal(t, 2.0, shards["count"])
	require.Equal(t, "baton", shards["publication"])
	slots := shards["slots"].([]any)
	require.Len(t, slots, 2)
	require.Equal(t, "baton_0", slots[0].(map[string]any)["name"])
	require.Equal(t, 16.0, slots[0].(map[string]any)["lag_bytes"])
	require.Equal(t, false, slots[1].(map[string]any)["exists"])
	var back Report
	require.NoError(t, json.Unmarshal(b.Bytes(), &back))
	require.Equal(t, *r, back)

	// Not sharded: "shards": null and no section.
	r = healthy()
	b.Reset()
	require.NoError(t, WriteJSON(&b, r))
	require.NoError(t, json.Unmarshal(b.Bytes(), &raw))
	require.Contains(t, raw, "shards")
	require.Nil(t, raw["shards"])
	b.Reset()
	require.NoError(t, WriteText(&b, r))
	require.NotContains(t, b.String(), "Shards")
}
