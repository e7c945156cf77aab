package relay

import (
	"errors"
	"testing"

	"github.com/stretchr/testify/require"
)

func TestDecideSlot(t *testing.T) {
	t.Parallel()
	baton := slotInfo{exists: true, plugin: "pgoutput", database: "app", ours: true, walStatus: "reserved",
		recorded: true, backfillDone: true}
	with := func(f func(*slotInfo)) slotInfo { s := baton; f(&s); return s }
	for _, tc := range []struct {
		name     string
		slot     slotInfo
		recreate bool
		want     slotAction
		err      error
		says     string
	}{
		{name: "no slot", slot: slotInfo{}, want: slotCreate},
		{name: "no slot, stale row", slot: slotInfo{recorded: true, backfillDone: true}, want: slotCreate},
		{name: "baton's, backfill done", slot: baton, want: slotStream},
		{name: "baton's, backfill done, recreate set", slot: baton, recreate: true, want: slotStream},
		{name: "baton's, backfill unfinished", slot: with(func(s *slotInfo) { s.backfillDone = false }), want: slotBackfill},
		{name: "no row", slot: with(func(s *slotInfo) { s.recorded, s.backfillDone = false, false }),
			err: ErrSetup, says: "no row in baton_relay_slots"},
		{name: "no row, recreate", slot: with(func(s *slotInfo) { s.recorded, s.backfillDone = false, false }),
			recreate: true, want: slotRecreate},
		{name: "another plugin", slot: with(func(s *slotInfo) { s.plugin = "test_decoding" }),
			err: ErrSetup, says: `plugin "test_decoding"`},
		{name: "another plugin, unfinished row", slot: with(func(s *slotInfo) { s.plugin, s.backfillDone = "wal2json", false }),
			err: ErrSetup, says: "--recreate-slot"},
		{name: "another plugin, recreate", slot: with(func(s *slotInfo) { s.plugin = "test_decoding" }),
			recreate: true, want: slotRecreate},
		{name: "another database", slot: with(func(s *slotInfo) { s.ours, s.database = false, "other" }),
			recreate: true, err: ErrSetup, says: `database "other"`},
		{name: "lost", slot: with(func(s *slotInfo) { s.walStatus = "lost" }), err: ErrSlotLost, says: "pg_drop_replication_slot"},
		{name: "lost, not baton's", slot: with(func(s *slotInfo) { s.walStatus, s.recorded = "lost", false }), err: ErrSlotLost},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got, err := decideSlot(tc.slot, "baton", tc.recreate)
			if tc.err != nil {
				require.True(t, errors.Is(err, tc.err), "got %v", err)
				require.ErrorContains(t, err, tc.says)
				return
			}
			require.NoError(t, err)
			require.Equal(t, tc.want, got)
		})
	}
}
