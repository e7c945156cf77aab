package consumer_test

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"os"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go"
	"github.com/stretchr/testify/require"

	"github.com/batonhq/baton/consumer"
	"github.com/batonhq/baton/internal/testsvc"
	"github.com/batonhq/baton/producer"
	"github.com/batonhq/baton/relay"
)

func TestMain(m *testing.M) { os.Exit(testsvc.MainNoLeaks(m)) }

type testWriter struct{ t *testing.T }

func (w testWriter) Write(p []byte) (int, error) {
	w.t.Log(strings.TrimSpace(string(p)))
	return len(p), nil
}

func testLogger(t *testing.T) *slog.Logger {
	if os.Getenv("BATON_TEST_LOG") == "" {
		return slog.New(slog.NewTextHandler(io.Discard, nil))
	}
	return slog.New(slog.NewTextHandler(testWriter{t}, &slog.HandlerOptions{Level: slog.LevelDebug}))
}

// source names the two ways a worker is fed; every behaviour test runs over both.
type source string

const (
	polling   source = "polling"
	jetStream source = "jetstream"
)

var sources = []source{polling, jetStream}

// bundle is a test's database, NATS and relay. Its processes and libraries log in as their
// roles of deploy/postgres/roles.sql, as deployed: workers as the worker role (unless a test
// gives a pool), the producer as the app role, the relay as the relay role; db.Pool is the
// owner's, for setting up and observing.
type bundle struct {
	db      *testsvc.Database
	nc      *nats.Conn // nil for polling
	prod    *producer.Producer
	app     *pgxpool.Pool // the producer's: the app role
	workers *pgxpool.Pool // workers': the worker role
	t       *testing.T
}

// setup gives a test its own database and, for the JetStream source, a NATS server and a relay.
func setup(t *testing.T, src source) *bundle {
	t.Helper()
	b := &bundle{db: testsvc.NewDatabase(t), t: t}
	p, err := producer.New(producer.Config{})
	require.NoError(t, err)
	b.prod = p
	b.app = b.db.RolePool(t, testsvc.RoleApp)
	b.workers = b.db.RolePool(t, testsvc.RoleWorker)
	if src == jetStream {
		ns := testsvc.StartNATS(t)
		nc, err := nats.Connect(ns.URL(), nats.MaxReconnects(-1))
		require.NoError(t, err)
		t.Cleanup(nc.Close)
		b.nc = nc
		r, err := relay.New(relay.Config{DatabaseURL: b.db.RoleURL(testsvc.RoleRelay), NATS: nc, Slot: b.db.Name,
			StatusInterval: 100 * time.Millisecond, Logger: testLogger(t)})
		require.NoError(t, err)
		ctx, cancel := context.WithCancel(context.Background())
		done := make(chan error, 1)
		go func() { done <- r.Run(ctx) }()
		t.Cleanup(func() { cancel(); require.NoError(t, <-done) })
		require.Eventually(t, r.Active, time.Minute, 5*time.Millisecond)
	}
	return b
}

// worker starts a worker with cfg (Pool, NATS and Logger filled in) until the test ends or
// the returned stop is called.
func (b *bundle) worker(cfg consumer.Config) (stop func()) {
	t := b.t
	t.Helper()
	if cfg.Pool == nil {
		cfg.Pool = b.workers
	}
	if cfg.NATS == nil {
		cfg.NATS = b.nc
	}
	if cfg.Handler == nil {
		cfg.Handler = echo
	}
	if cfg.Logger == nil {
		cfg.Logger = testLogger(t)
	}
	if cfg.PollInterval == 0 {
		cfg.PollInterval = 20 * time.Millisecond
	}
	w, err := consumer.New(cfg)
	require.NoError(t, err)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- w.Run(ctx) }()
	var once sync.Once
	stop = func() {
		once.Do(func() {
			cancel()
			select {
			case err := <-done:
				require.NoError(t, err)
			case <-time.After(time.Minute):
				t.Error("worker did not stop within a minute")
			}
		})
	}
	t.Cleanup(stop)
	return stop
}

func (b *bundle) conversation(id string) {
	_, err := b.prod.CreateConversation(context.Background(), b.app, id)
	require.NoError(b.t, err)
}

func (b *bundle) send(conv, id, content string) int64 {
	res, err := b.prod.Send(context.Background(), b.app, producer.Message{ConversationID: conv, ID: id, Content: content})
	require.NoError(b.t, err)
	return res.OutboxID
}

// waitTerminal waits until no outbox row is pending or processing.
func (b *bundle) waitTerminal(within time.Duration) {
	b.t.Helper()
	require.Eventually(b.t, func() bool {
		var n int
		err := b.db.Pool.QueryRow(context.Background(), `SELECT count(*) FROM agent_outbox WHERE status IN ('pending', 'processing')`).Scan(&n)
		return err == nil && n == 0
	}, within, 10*time.Millisecond, "rows still pending or processing")
}

func echo(_ context.Context, t *consumer.Turn) (consumer.Reply, error) {
	parts := make([]string, len(t.Messages))
	for i, m := range t.Messages {
		parts[i] = m.Content
	}
	return consumer.Reply{Content: "echo: " + strings.Join(parts, " | ")}, nil
}

func TestEveryMessageAnsweredOnce(t *testing.T) {
	for _, src := range sources {
		t.Run(string(src), func(t *testing.T) {
			t.Parallel()
			b := setup(t, src)
			b.worker(consumer.Config{})
			b.worker(consumer.Config{})
			var wg sync.WaitGroup
			for c := range 20 {
				conv := fmt.Sprintf("c%d", c)
				b.conversation(conv)
				wg.Go(func() {
					for i := range 5 {
						b.send(conv, fmt.Sprintf("%s-m%d", conv, i), fmt.Sprintf("hello %d", i))
					}
				})
			}
			wg.Wait()
			b.waitTerminal(time.Minute)
			require.Equal(t, []int{100}, testsvc.Query[int](t, b.db, `SELECT count(*)::int FROM agent_outbox WHERE status = 'done' AND reply_id IS NOT NULL`))
			// Each user message appears in exactly one reply.
			require.Equal(t, []int{0}, testsvc.Query[int](t, b.db, `SELECT count(*)::int FROM (
				SELECT o.id FROM agent_outbox o JOIN messages r ON r.id = o.reply_id
				WHERE r.role = 'assistant' GROUP BY o.id HAVING count(*) <> 1) x`))
		})
	}
}
