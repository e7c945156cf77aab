package relay_test

import (
	"bufio"
	"context"
	"fmt"
	"os"
	"os/exec"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/batonhq/baton/relay"
)

type slotRow struct {
	plugin, confirmed, catalogXmin string
}

func readSlotRow(t *testing.T, b *bundle) (slotRow, bool) {
	t.Helper()
	var s slotRow
	var n int
	err := b.db.Pool.QueryRow(slotCtx(t), `SELECT count(*) OVER (), plugin, confirmed_flush_lsn::text, catalog_xmin::text
		FROM pg_replication_slots WHERE slot_name = $1`, b.cfg.Slot).Scan(&n, &s.plugin, &s.confirmed, &s.catalogXmin)
	if err != nil {
		return s, false
	}
	return s, true
}

func slotCtx(t *testing.T) context.Context { return ctxT(t, time.Minute) }

// A slot with the relay's name that Baton did not create (no row in baton_relay_slots) belongs
// to someone else: an operator, another tool, another deployment. The relay refuses it, says how
// to proceed, and leaves it as it was.
func TestForeignSlotIsRefusedAndKept(t *testing.T) {
	t.Parallel()
	for _, plugin := range []string{"pgoutput", "test_decoding"} {
		t.Run(plugin, func(t *testing.T) {
			t.Parallel()
			b := setup(t)
			_, err := b.db.Pool.Exec(slotCtx(t), `SELECT pg_create_logical_replication_slot($1, $2)`, b.cfg.Slot, plugin)
			require.NoError(t, err)
			before, ok := readSlotRow(t, b)
			require.True(t, ok)

			r, err := relay.New(b.cfg)
			require.NoError(t, err)
			err = r.Run(ctxT(t, 20*time.Second))
			require.ErrorIs(t, err, relay.ErrSetup)
			require.ErrorContains(t, err, "Baton did not create it")
			require.ErrorContains(t, err, "--recreate-slot")
			require.False(t, r.Active())

			after, ok := readSlotRow(t, b)
			require.True(t, ok, "the foreign slot was dropped")
			require.Equal(t, before, after, "the foreign slot was changed")
		})
	}
}

// With RecreateSlot the relay drops the foreign slot and creates its own, with the first-start
// backfill: every pending row is published once.
func TestRecreateSlotReplacesForeignSlot(t *testing.T) {
	t.Parallel()
	b := setup(t)
	createConversations(t, b.db.Pool, "c")
	for i := range 5 {
		_, err := send(slotCtx(t), b.db.Pool, "c", fmt.Sprintf("old-%d", i))
		require.NoError(t, err)
	}
	_, err := b.db.Pool.Exec(slotCtx(t), `SELECT pg_create_logical_replication_slot($1, 'pgoutput')`, b.cfg.Slot)
	require.NoError(t, err)
	b.cfg.RecreateSlot = true
	b.startActive(t)
	_, err = send(slotCtx(t), b.db.Pool, "c", "new")
	require.NoError(t, err)
	want := truth(t, b.db.Pool)
	assertExactlyOnceInOrder(t, b.waitStream(t, "AGENT_TURNS", len(want), time.Minute), want)
	var done bool
	require.NoError(t, b.db.Pool.QueryRow(slotCtx(t), `SELECT backfill_done FROM baton_relay_slots WHERE slot_name = $1`, b.cfg.Slot).Scan(&done))
	require.True(t, done)
}

// The same through the command: refused with a non-zero exit, then accepted with --recreate-slot.
func TestRecreateSlotFlag(t *testing.T) {
	t.Parallel()
	b := setup(t)
	_, err := b.db.Pool.Exec(slotCtx(t), `SELECT pg_create_logical_replication_slot($1, 'pgoutput')`, b.cfg.Slot)
	require.NoError(t, err)
	env := append(os.Environ(), "BATON_DATABASE_URL="+b.cfg.DatabaseURL, "BATON_NATS_URL="+b.nats.URL(), "BATON_SLOT="+b.cfg.Slot)

	cmd := exec.CommandContext(ctxT(t, time.Minute), batonBinary(t), "relay")
	cmd.Env = env
	out, err := cmd.CombinedOutput()
	require.Error(t, err, "a foreign slot must end the relay with a non-zero exit")
	require.Contains(t, string(out), "--recreate-slot")

	cmd = exec.Command(batonBinary(t), "relay", "--recreate-slot")
	cmd.Env = env
	stderr, err := cmd.StderrPipe()
	require.NoError(t, err)
	require.NoError(t, cmd.Start())
	t.Cleanup(func() { _ = cmd.Process.Kill(); _ = cmd.Wait() })
	streaming := make(chan struct{})
	go func() {
		sc := bufio.NewScanner(stderr)
		closed := false
		for sc.Scan() {
			if !closed && strings.Contains(sc.Text(), "msg=streaming") {
				close(streaming)
				closed = true
			}
		}
	}()
	select {
	case <-streaming:
	case <-time.After(time.Minute):
		t.Fatal("relay --recreate-slot never streamed")
	}
}

// A relay killed during its first-start backfill leaves a slot it created with an unfinished
// backfill. The next start recreates that slot and backfills again: nothing is skipped.
func TestKillDuringBackfillHeals(t *testing.T) {
	t.Parallel()
	b := setup(t)
	c := ctxT(t, 3*time.Minute)
	convs := conversationIDs(5)
	createConversations(t, b.db.Pool, convs...)
	// Enough rows that the backfill takes seconds: the kill lands in it.
	const rows = 100000
	_, err := b.db.Pool.Exec(c, `WITH m AS (INSERT INTO messages (id, conversation_id, role, content)
			SELECT 'old-' || i, 'c00' || (i % 5), 'user', 'hello' FROM generate_series(1, $1) i RETURNING id, conversation_id)
		INSERT INTO agent_outbox (conversation_id, message_id) SELECT conversation_id, id FROM m ORDER BY id`, rows)
	require.NoError(t, err)

	p := b.startProcess(t)
	require.Eventually(t, func() bool {
		_, exists := readSlotRow(t, b)
		return exists
	}, time.Minute, 2*time.Millisecond, "the relay never created its slot")
	p.kill(t)
	var published uint64
	if s, err := b.js.Stream(c, "AGENT_TURNS"); err == nil {
		info, err := s.Info(c)
		require.NoError(t, err)
		published = info.State.Msgs
	}
	require.Less(t, published, uint64(rows), "the kill came after the backfill")
	t.Logf("killed after %d of %d backfilled rows", published, rows)

	// Rows committed after the killed relay's slot was created are in it too.
	for i := range 20 {
		_, err := send(c, b.db.Pool, convs[i%len(convs)], fmt.Sprintf("new-%d", i))
		require.NoError(t, err)
	}
	b.startProcess(t)
	want := truth(t, b.db.Pool)
	assertExactlyOnceInOrder(t, b.waitStream(t, "AGENT_TURNS", len(want), 2*time.Minute), want)
	require.Eventually(t, func() bool {
		var done bool
		err := b.db.Pool.QueryRow(c, `SELECT backfill_done FROM baton_relay_slots WHERE slot_name = $1`, b.cfg.Slot).Scan(&done)
		return err == nil && done
	}, 30*time.Second, 20*time.Millisecond)
}
