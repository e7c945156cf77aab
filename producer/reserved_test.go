package producer_test

import (
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/batonhq/baton/producer"
)

// Message ids starting with "baton:", in any letter case, belong to the messages workers write
// (replies, errors). A client id there could collide with one, so Send and SendTx refuse it
// before any I/O, and nothing is written.
func TestSendReservedIDPrefixIsRefused(t *testing.T) {
	t.Parallel()
	b := setup(t)
	b.conversation(t, "c1")
	require.Equal(t, "baton:", producer.ReservedIDPrefix)

	for _, id := range []string{
		"baton:",
		"baton:reply:8f14e45f",
		"baton:error:8f14e45f",
		"BATON:reply:1",
		"Baton:1",
		"bAtOn:1",
	} {
		check := func(t *testing.T, err error) {
			t.Helper()
			require.ErrorIs(t, err, producer.ErrInvalidInput)
			require.NotErrorIs(t, err, producer.ErrConflict)
			var inputErr *producer.InputError
			require.ErrorAs(t, err, &inputErr)
			require.Equal(t, "ID", inputErr.Field)
			require.Contains(t, inputErr.Reason, `"baton:"`)
			require.Contains(t, inputErr.Reason, "reserved for Baton")
		}
		t.Run(id, func(t *testing.T) {
			m := msg("c1", id, "hello")
			_, err := b.p.Send(b.ctx, failDB{t: t}, m)
			check(t, err)
			_, err = b.p.SendTx(b.ctx, failDB{t: t}, m)
			check(t, err)

			_, err = b.p.Send(b.ctx, b.db.Pool, m)
			check(t, err)
			tx, err := b.db.Pool.Begin(b.ctx)
			require.NoError(t, err)
			defer func() { _ = tx.Rollback(b.ctx) }()
			_, err = b.p.SendTx(b.ctx, tx, m)
			check(t, err)
			require.NoError(t, tx.Commit(b.ctx), "a refused id leaves the caller's transaction usable")
			b.requireRows(t, 0, 0)
		})
	}

	// Only the prefix is reserved: ids that merely contain "baton" are messages like any other.
	allowed := []string{"baton", "baton-1", "batonx:1", "baton;1", " baton:1", "my-baton:1", "reply:1",
		"b\u0430ton:1"} // Cyrillic а: only ASCII case variants are refused
	for _, id := range allowed {
		res, err := b.p.Send(b.ctx, b.db.Pool, msg("c1", id, "hello"))
		require.NoError(t, err, id)
		require.False(t, res.AlreadyAccepted, id)
	}
	b.requireRows(t, len(allowed), len(allowed))

	// Conversation ids are the application's to choose: the prefix is not reserved there.
	b.conversation(t, "baton:conv")
	_, err := b.p.Send(b.ctx, b.db.Pool, msg("baton:conv", "m1", "hello"))
	require.NoError(t, err)
	b.requireRows(t, len(allowed)+1, len(allowed)+1)
}
