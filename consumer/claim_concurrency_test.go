package consumer

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// Workers claiming the same conversations at once, in opposite orders, claim each one exactly
// once: one run per conversation, every row taken once (attempt 1). The claim transaction is
// three statements (generic plans and lock_timeout, the conversations' locks, the claim); a
// claimer that did not get a conversation's lock leaves it to the one that did. (From an
// adversarial review of the claim's statement order, which it held.)
func TestConcurrentClaimersClaimEachConversationOnce(t *testing.T) {
	ctx := context.Background()
	db, s0 := storeFixture(t)
	const convs, workers, rounds = 30, 4, 8
	preloadTurns(t, db, convs)
	stores := make([]*store, workers)
	for i := range stores {
		s := *s0
		s.worker = fmt.Sprintf("w%d", i)
		stores[i] = &s
	}
	for round := range rounds {
		var mu sync.Mutex
		claimedBy := map[string][]string{}
		errs := make([]error, workers)
		var wg sync.WaitGroup
		for w := range workers {
			wg.Go(func() {
				reqs := make([]claimReq, convs)
				for j := range reqs {
					k := j
					if w%2 == 1 {
						k = convs - 1 - j
					}
					reqs[j] = claimReq{conversationID: "c" + strconv.Itoa(k+1), runID: newRunID()}
				}
				cctx, cancel := context.WithTimeout(ctx, 20*time.Second)
				defer cancel()
				got, err := stores[w].claimMany(cctx, reqs)
				if err != nil {
					errs[w] = err
					return
				}
				mu.Lock()
				defer mu.Unlock()
				for j, c := range got {
					if len(c.ids) > 0 {
						claimedBy[reqs[j].conversationID] = append(claimedBy[reqs[j].conversationID], reqs[j].runID)
					}
				}
			})
		}
		wg.Wait()
		require.NoError(t, errors.Join(errs...), "round %d", round)
		for conv, runs := range claimedBy {
			require.Len(t, runs, 1, "round %d: %s claimed by %v", round, conv, runs)
		}
		require.Len(t, claimedBy, convs, "round %d: every conversation claimed", round)
		require.Equal(t, convs, scalar[int](t, db, `SELECT count(*) FROM agent_runs WHERE finished_at IS NULL`))
		require.Zero(t, scalar[int](t, db, `SELECT count(*) FROM agent_outbox WHERE status = 'processing' AND attempts <> 1`))
		_, err := db.Pool.Exec(ctx, `UPDATE agent_outbox SET status = 'pending', run_id = NULL, lease_expires_at = NULL, attempts = 0`)
		require.NoError(t, err)
		_, err = db.Pool.Exec(ctx, `DELETE FROM agent_runs`)
		require.NoError(t, err)
	}
}
