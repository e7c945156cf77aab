package producer_test

import (
	"context"
	"runtime"
	"strconv"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/batonhq/baton/internal/testsvc"
	"github.com/batonhq/baton/producer"
)

// benchClients is how many clients send at once, each with a connection of its own.
const benchClients = 8

const benchConversations = 64

// benchContent is a typical short chat message.
const benchContent = "Could you summarise the last three messages and suggest a reply to the customer?"

// BenchmarkSend measures Send, and SendTx in a transaction of its own, against a plain
// transaction with the two INSERTs and no idempotency (BEGIN; INSERT; INSERT; COMMIT). All run
// with benchClients parallel clients, each on a fresh database with the same conversations, and
// report sends/s.
func BenchmarkSend(b *testing.B) {
	b.Run("Send", func(b *testing.B) {
		pool, p := benchSetup(b)
		runSends(b, func(ctx context.Context, conv, id string) error {
			_, err := p.Send(ctx, pool, producer.Message{ConversationID: conv, ID: id, Content: benchContent})
			return err
		})
	})
	b.Run("SendTx", func(b *testing.B) {
		pool, p := benchSetup(b)
		runSends(b, func(ctx context.Context, conv, id string) error {
			return pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
				_, err := p.SendTx(ctx, tx, producer.Message{ConversationID: conv, ID: id, Content: benchContent})
				return err
			})
		})
	})
	b.Run("PlainTwoInsertTx", func(b *testing.B) {
		pool, _ := benchSetup(b)
		runSends(b, func(ctx context.Context, conv, id string) error {
			return pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
				if _, err := tx.Exec(ctx, `INSERT INTO messages (id, conversation_id, role, content)
					VALUES ($1, $2, 'user', $3)`, id, conv, benchContent); err != nil {
					return err
				}
				_, err := tx.Exec(ctx, `INSERT INTO agent_outbox (conversation_id, message_id) VALUES ($1, $2)`, conv, id)
				return err
			})
		})
	})
}

var benchConvs = func() []string {
	ids := make([]string, benchConversations)
	for i := range ids {
		ids[i] = "bench-conv-" + strconv.Itoa(i)
	}
	return ids
}()

// benchSetup gives a sub-benchmark run a fresh database with the conversations and a pool of
// benchClients connections, opened before the timer starts.
func benchSetup(b *testing.B) (*pgxpool.Pool, *producer.Producer) {
	b.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	db := testsvc.NewDatabase(b)
	cfg, err := pgxpool.ParseConfig(db.URL)
	require.NoError(b, err)
	cfg.MaxConns, cfg.MinConns = benchClients, benchClients
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	require.NoError(b, err)
	b.Cleanup(pool.Close)
	p, err := producer.New(producer.Config{})
	require.NoError(b, err)
	for _, id := range benchConvs {
		_, err := p.CreateConversation(ctx, pool, id)
		require.NoError(b, err)
	}
	// Open every connection now rather than inside the measurement.
	conns := make([]*pgxpool.Conn, benchClients)
	for i := range conns {
		conns[i], err = pool.Acquire(ctx)
		require.NoError(b, err)
	}
	for _, c := range conns {
		c.Release()
	}
	return pool, p
}

// runSends runs send b.N times from benchClients goroutines, each message with a new id, and
// reports sends/s.
func runSends(b *testing.B, send func(ctx context.Context, conv, id string) error) {
	b.Helper()
	ctx := context.Background()
	var seq atomic.Int64
	var failed atomic.Pointer[error]
	b.SetParallelism((benchClients + runtime.GOMAXPROCS(0) - 1) / runtime.GOMAXPROCS(0))
	b.ResetTimer()
	b.RunParallel(func(pb *testing.PB) {
		for pb.Next() {
			n := seq.Add(1)
			if err := send(ctx, benchConvs[n%benchConversations], "bench-msg-"+strconv.FormatInt(n, 10)); err != nil {
				failed.CompareAndSwap(nil, &err)
				return
			}
		}
	})
	b.StopTimer()
	if err := failed.Load(); err != nil {
		b.Fatal(*err)
	}
	b.ReportMetric(float64(b.N)/b.Elapsed().Seconds(), "sends/s")
}
