package e2e

import (
	"context"
	"fmt"
	"math/rand/v2"
	"strings"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
)

// Neighbour settings: another application's process on Baton's database, doing what an
// ordinary role may, never writing Baton's tables.
const (
	// neighbourRole is its role: LOGIN, CONNECT on the database, a schema of its own, and a
	// connection limit (what an operator gives an application: the connections Baton needs
	// stay free, see neighbourConns).
	neighbourRole = "neighbour"
	// neighbourConns is its CONNECTION LIMIT and its pool's size: the advisory-lock holder,
	// a long-open transaction, a bulk transaction and the other actions.
	neighbourConns = 4
	// neighbourMaxMessage is the largest logical decoding message it emits: past the chaos
	// relays' --max-change-bytes (8 MiB), where the relay cuts a message as it arrives.
	neighbourMaxMessage = 12 << 20
)

// neighbourActions are what the neighbour does at random moments, with their weights; each
// is counted in the run's figures as neighbour-<kind>.
var neighbourActions = []struct {
	kind   string
	weight int
}{
	{"bulk", 1},    // one transaction of neighbourBulkRows rows into its own table
	{"ddl", 2},     // create, alter and drop a table of its own
	{"open-tx", 2}, // a transaction that writes, then stays open 5-20s
	{"message", 3}, // a logical decoding message of its own prefix: small or large, transactional or not
	{"answers", 3}, // a baton.answers message: malformed, huge, or naming ids it does not own
}

// neighbourBulkRows is the size of a bulk transaction: the walsender decodes it (busy, silent)
// for longer than the relays' --min-silence. make test-long's run uses 10 million.
var neighbourBulkRows = 1_000_000

// advisoryKeys are the advisory lock keys Baton takes or took: earlier relays one per slot
// (hashtextextended('baton.relay.' || slot, 0)), earlier migrators a constant ("baton.mi").
// Baton takes none today; a neighbour holding them must change nothing.
var advisoryKeys = []string{`hashtextextended('baton.relay.baton', 0)`, `7089075310396599657`}

// neighbour runs beside the system until ctx ends.
type neighbour struct {
	s    *system
	pool *pgxpool.Pool
	rng  *rand.Rand

	mu     sync.Mutex
	counts map[string]int
	errs   int // actions that failed: expected while Postgres is down, logged
}

// createNeighbour makes the neighbour's role and schema, as its DBA would, on the system's
// database.
func createNeighbour(ctx context.Context, s *system) error {
	_, err := s.pool.Exec(ctx, fmt.Sprintf(`
		CREATE ROLE %[1]s LOGIN CONNECTION LIMIT %[2]d;
		GRANT CONNECT ON DATABASE postgres TO %[1]s;
		CREATE SCHEMA %[1]s AUTHORIZATION %[1]s;
		ALTER ROLE %[1]s SET search_path = %[1]s`, neighbourRole, neighbourConns))
	if err != nil {
		return fmt.Errorf("create the neighbour's role: %w", err)
	}
	return nil
}

// slotWaitLog starts the relay's warning that creating the slot waits for other transactions.
const slotWaitLog = "creating the slot waits for transactions"

// openAcrossSlotCreation opens a neighbour's transaction that writes (so has an xid) before
// the relays start: creating the slot must wait for it to end. It ends once a relay said
// creating the slot waits (at most a minute), and the returned function waits for that and
// says what happened; the run fails if no relay said so.
func (s *system) openAcrossSlotCreation(ctx context.Context) func() string {
	conn, err := pgx.Connect(ctx, roleURL(s.pg, neighbourRole))
	if err != nil {
		s.t.Fatalf("connect as the neighbour: %v", err)
	}
	tx, err := conn.Begin(ctx)
	if err == nil {
		_, err = tx.Exec(ctx, `CREATE TABLE IF NOT EXISTS small (id bigint, at timestamptz DEFAULT now());
			INSERT INTO small (id) VALUES (0)`)
	}
	if err != nil {
		s.t.Fatalf("the neighbour's transaction: %v", err)
	}
	began := time.Now()
	done := make(chan string, 1)
	go func() { // owned by the returned function, which the run calls
		defer func() { _ = conn.Close(context.WithoutCancel(ctx)) }()
		deadline := time.Now().Add(time.Minute)
		said := ""
		for said == "" && time.Now().Before(deadline) && sleep(ctx, 100*time.Millisecond) {
			for _, name := range []string{"relay-0", "relay-1"} {
				if strings.Contains(s.named[name].log.lines(200), slotWaitLog) {
					said = name
				}
			}
		}
		err := tx.Commit(ctx)
		switch {
		case said == "":
			done <- fmt.Sprintf("no relay logged %q within a minute", slotWaitLog)
		case err != nil:
			done <- fmt.Sprintf("commit: %v", err)
		default:
			done <- fmt.Sprintf("ok: %s said creating the slot waited; committed after %v", said, time.Since(began).Round(time.Millisecond))
		}
	}()
	return func() string {
		what := <-done
		if !strings.HasPrefix(what, "ok: ") {
			s.t.Errorf("the neighbour's transaction open across the slot's creation: %s", what)
		}
		return what
	}
}

// startNeighbour starts the neighbour; its goroutines end with ctx, and wait returns its
// counts once they have.
func (s *system) startNeighbour(ctx context.Context, seed uint64) (wait func() map[string]int) {
	pool := rolePool(s.t, ctx, s.pg, neighbourRole, neighbourConns)
	n := &neighbour{s: s, pool: pool, rng: rand.New(rand.NewPCG(seed, 0x6e65696768)), counts: map[string]int{}}
	var wg sync.WaitGroup
	wg.Go(func() { n.holdAdvisoryLocks(ctx) })
	wg.Go(func() { n.act(ctx) })
	return func() map[string]int {
		wg.Wait()
		n.mu.Lock()
		defer n.mu.Unlock()
		s.t.Logf("neighbour: %d actions failed (Postgres down or restarted meanwhile)", n.errs)
		return n.counts
	}
}

// holdAdvisoryLocks holds every advisory key Baton uses or used for the whole run, on one
// connection of its own, which it checks every second: after a Postgres restart broke it, it
// takes the keys again on a new one (counted as neighbour-advisory).
func (n *neighbour) holdAdvisoryLocks(ctx context.Context) {
	for ctx.Err() == nil {
		err := n.withConn(ctx, func(conn *pgx.Conn) error {
			for _, k := range advisoryKeys {
				if _, err := conn.Exec(ctx, "SELECT pg_advisory_lock("+k+"::bigint)"); err != nil {
					return err
				}
			}
			n.count("advisory")
			for sleep(ctx, time.Second) {
				if _, err := conn.Exec(ctx, "SELECT 1"); err != nil {
					return err
				}
			}
			return nil
		})
		if err != nil {
			n.done(ctx, "advisory", err)
			if !sleep(ctx, time.Second) {
				return
			}
		}
	}
}

// withConn runs f on a connection of its own, for as long as f needs it.
func (n *neighbour) withConn(ctx context.Context, f func(*pgx.Conn) error) error {
	c, err := n.pool.Acquire(ctx)
	if err != nil {
		return err
	}
	defer c.Release()
	return f(c.Conn())
}

// act does one drawn action every 1-4s. Open transactions run beside the next actions.
func (n *neighbour) act(ctx context.Context) {
	var wg sync.WaitGroup
	defer wg.Wait()
	total := 0
	for _, a := range neighbourActions {
		total += a.weight
	}
	for sleep(ctx, time.Duration(1000+n.rng.IntN(3000))*time.Millisecond) {
		draw, kind := n.rng.IntN(total), ""
		for _, a := range neighbourActions {
			if draw < a.weight {
				kind = a.kind
				break
			}
			draw -= a.weight
		}
		hold := time.Duration(5+n.rng.IntN(16)) * time.Second
		size := n.messageSize()
		transactional := n.rng.IntN(2) == 0
		answers := n.answersBody()
		run := func() error {
			switch kind {
			case "bulk":
				// One implicit transaction (several statements, no arguments: the simple
				// protocol); the table is emptied first, so that it stays small.
				return n.exec(ctx, fmt.Sprintf(`CREATE TABLE IF NOT EXISTS bulk (id bigint, v text);
					TRUNCATE bulk;
					INSERT INTO bulk SELECT g, 'neighbour' FROM generate_series(1, %d) g`, neighbourBulkRows))
			case "ddl":
				t := fmt.Sprintf("t_%d", n.rng.IntN(1000))
				return n.exec(ctx, fmt.Sprintf(`CREATE TABLE %[1]s (id bigint PRIMARY KEY, v text);
					INSERT INTO %[1]s SELECT g, 'x' FROM generate_series(1, 1000) g;
					ALTER TABLE %[1]s ADD COLUMN w jsonb;
					CREATE INDEX ON %[1]s (v);
					DROP TABLE %[1]s`, t))
			case "open-tx":
				return n.withConn(ctx, func(conn *pgx.Conn) error {
					tx, err := conn.Begin(ctx)
					if err != nil {
						return err
					}
					defer func() { _ = tx.Rollback(context.WithoutCancel(ctx)) }()
					if _, err := tx.Exec(ctx, `CREATE TABLE IF NOT EXISTS small (id bigint, at timestamptz DEFAULT now());
						INSERT INTO small (id) VALUES (1)`); err != nil {
						return err
					}
					sleep(ctx, hold)
					return tx.Commit(ctx)
				})
			case "message":
				return n.exec(ctx, `SELECT pg_logical_emit_message($1, 'neighbour.app', repeat('m', $2))`, transactional, size)
			case "answers":
				return n.exec(ctx, `SELECT pg_logical_emit_message($1, 'baton.answers', $2::text)`, transactional, answers)
			}
			return nil
		}
		n.count(kind)
		if kind == "open-tx" || kind == "bulk" {
			wg.Go(func() { n.done(ctx, kind, run()) })
			continue
		}
		n.done(ctx, kind, run())
	}
}

// messageSize draws a logical message's size: mostly small, sometimes up to neighbourMaxMessage.
func (n *neighbour) messageSize() int {
	if n.rng.IntN(4) == 0 {
		return 1 + n.rng.IntN(neighbourMaxMessage)
	}
	return 1 + n.rng.IntN(4096)
}

// answersBody draws a baton.answers body: malformed, huge, or well formed naming a message and
// outbox ids the neighbour does not own (the relay attaches answers only to a reply inserted
// in the same transaction, which the neighbour cannot insert).
// Those the relay sets aside (transactional, malformed or too large) start with neighbourMark,
// by which the run's dead-letter check knows them.
func (n *neighbour) answersBody() string {
	switch n.rng.IntN(4) {
	case 0:
		return neighbourMark + `{"message_id": "half`
	case 1:
		return `{"message_id":"` + neighbourMark + `","outbox_ids":[` + strings.Repeat("1,", 1<<20) + `1]}`
	case 2:
		return neighbourMark + strings.Repeat("\x01", 1+n.rng.IntN(1000))
	default:
		return fmt.Sprintf(`{"message_id":"%s-%d","outbox_ids":[%d,%d]}`, neighbourMark, n.rng.IntN(1000), 1+n.rng.IntN(5000), 1+n.rng.IntN(5000))
	}
}

func (n *neighbour) exec(ctx context.Context, sql string, args ...any) error {
	_, err := n.pool.Exec(ctx, sql, args...)
	return err
}

func (n *neighbour) count(kind string) {
	n.mu.Lock()
	defer n.mu.Unlock()
	n.counts["neighbour-"+kind]++
}

// done logs an action's failure: Postgres stops and crashes during the run, and a long action
// meets that; the run's checks, not the neighbour, judge Baton.
func (n *neighbour) done(ctx context.Context, kind string, err error) {
	if err == nil || ctx.Err() != nil {
		return
	}
	n.mu.Lock()
	n.errs++
	n.mu.Unlock()
	n.s.t.Logf("neighbour %s: %v", kind, err)
}
