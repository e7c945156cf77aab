package bench

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pglogrepl"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
)

// Every SQL statement of the bench is in this file.

// createDatabase creates database name on the server admin is connected to.
func createDatabase(ctx context.Context, admin *pgx.Conn, name string) error {
	if _, err := admin.Exec(ctx, "CREATE DATABASE "+pgx.Identifier{name}.Sanitize()); err != nil {
		return fmt.Errorf("create database %s: %w", name, err)
	}
	return nil
}

// dropDatabase terminates the walsenders of every slot of database name, drops those slots
// (a leaked slot holds WAL) and the database.
func dropDatabase(ctx context.Context, admin *pgx.Conn, name string) error {
	for deadline := time.Now().Add(30 * time.Second); ; {
		if _, err := admin.Exec(ctx, `SELECT pg_terminate_backend(active_pid)
			FROM pg_replication_slots WHERE database = $1 AND active_pid IS NOT NULL`, name); err != nil {
			return fmt.Errorf("stop the walsenders of %s: %w", name, err)
		}
		_, err := admin.Exec(ctx, `SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots WHERE database = $1`, name)
		if err == nil {
			break
		}
		// 55006: a slot is still active; its walsender is exiting.
		if time.Now().After(deadline) || !isSQLState(err, "55006") {
			return fmt.Errorf("drop the replication slots of %s: %w", name, err)
		}
		if err := sleepCtx(ctx, 20*time.Millisecond); err != nil {
			return err
		}
	}
	if _, err := admin.Exec(ctx, "DROP DATABASE IF EXISTS "+pgx.Identifier{name}.Sanitize()+" WITH (FORCE)"); err != nil {
		return fmt.Errorf("drop database %s: %w", name, err)
	}
	return nil
}

// serverFacts returns the server's version and max_replication_slots, and checks wal_level.
func serverFacts(ctx context.Context, conn *pgx.Conn) (version string, maxSlots int, err error) {
	var walLevel, slots string
	if err := conn.QueryRow(ctx, `SELECT current_setting('server_version'), current_setting('wal_level'),
		current_setting('max_replication_slots')`).Scan(&version, &walLevel, &slots); err != nil {
		return "", 0, fmt.Errorf("read server settings: %w", err)
	}
	if walLevel != "logical" {
		return "", 0, fmt.Errorf("the server runs with wal_level=%s; the relay needs wal_level=logical", walLevel)
	}
	if _, err := fmt.Sscan(slots, &maxSlots); err != nil {
		return "", 0, fmt.Errorf("max_replication_slots %q: %w", slots, err)
	}
	return version, maxSlots, nil
}

// usedSlots returns how many replication slots exist on the server.
func usedSlots(ctx context.Context, conn *pgx.Conn) (int, error) {
	var n int
	if err := conn.QueryRow(ctx, `SELECT count(*) FROM pg_replication_slots`).Scan(&n); err != nil {
		return 0, fmt.Errorf("count replication slots: %w", err)
	}
	return n, nil
}

// createConversations creates conversations c0000 … c<n-1>.
func createConversations(ctx context.Context, pool *pgxpool.Pool, n int) error {
	if _, err := pool.Exec(ctx, `INSERT INTO conversations (id)
		SELECT 'c' || lpad(g::text, 4, '0') FROM generate_series(0, $1 - 1) g`, n); err != nil {
		return fmt.Errorf("create %d conversations: %w", n, err)
	}
	return nil
}

// conversationID is the id of the i-th conversation of convs, as createConversations and
// writeBacklog name them.
func conversationID(i, convs int) string { return fmt.Sprintf("c%04d", i%convs) }

// clearOutbox removes every message and outbox row (and what refers to them). The
// publication publishes inserts only, so no relay sees it; call it while none runs, before
// the slots of the next phase exist, so that a relay's first-start backfill finds nothing.
func clearOutbox(ctx context.Context, pool *pgxpool.Pool) error {
	if _, err := pool.Exec(ctx, `TRUNCATE agent_outbox, messages CASCADE`); err != nil {
		return fmt.Errorf("clear the outbox: %w", err)
	}
	return nil
}

// writeBacklog commits rows user messages with their outbox rows, rowsPerTx of them per
// transaction, round-robin over convs conversations. Each of `workers` sessions runs one DO
// block that commits inside its loop: no round trip per transaction, so 200k one-row
// transactions take seconds. Worker w owns the conversations ≡ w (mod workers) and inserts
// in id order, so each conversation's rows commit in id order.
//
// The sessions skip the commit's WAL flush wait (synchronous_commit = off): it slows the load
// and changes nothing in the WAL the relay decodes. The foreign-key checks stay: their row
// locks are WAL records too, which the walsender reads past, as it would behind real producers.
func writeBacklog(ctx context.Context, pool *pgxpool.Pool, rows, rowsPerTx, workers, convs int) error {
	if rows%(workers*rowsPerTx) != 0 || convs%workers != 0 {
		return fmt.Errorf("%d rows over %d conversations do not split into %d workers × whole transactions of %d",
			rows, convs, workers, rowsPerTx)
	}
	txs := rows / workers / rowsPerTx
	errs := make(chan error, workers)
	for w := range workers {
		go func() {
			conn, err := pool.Acquire(ctx)
			if err != nil {
				errs <- err
				return
			}
			defer conn.Release()
			if _, err := conn.Exec(ctx, `SET synchronous_commit = off`); err != nil {
				errs <- err
				return
			}
			// Row k of worker w: message 'w<w>-<k>' in conversation (w + workers·k) mod convs.
			_, err = conn.Exec(ctx, fmt.Sprintf(`DO $$
BEGIN
	FOR i IN 0..%[1]d - 1 LOOP
		INSERT INTO messages (id, conversation_id, role, content)
			SELECT 'w%[3]d-' || k, 'c' || lpad(((%[3]d + %[4]d * k) %% %[5]d)::text, 4, '0'), 'user', 'hello'
			FROM generate_series(i * %[2]d, i * %[2]d + %[2]d - 1) k;
		INSERT INTO agent_outbox (conversation_id, message_id)
			SELECT 'c' || lpad(((%[3]d + %[4]d * k) %% %[5]d)::text, 4, '0'), 'w%[3]d-' || k
			FROM generate_series(i * %[2]d, i * %[2]d + %[2]d - 1) k ORDER BY k;
		COMMIT;
	END LOOP;
END $$`, txs, rowsPerTx, w, workers, convs))
			errs <- err
		}()
	}
	var err error
	for range workers {
		if werr := <-errs; err == nil {
			err = werr
		}
	}
	if err != nil {
		return fmt.Errorf("write the backlog: %w", err)
	}
	var n int
	if err := pool.QueryRow(ctx, `SELECT count(*) FROM agent_outbox`).Scan(&n); err != nil {
		return fmt.Errorf("count the backlog: %w", err)
	}
	if n != rows {
		return fmt.Errorf("the backlog holds %d outbox rows, want %d", n, rows)
	}
	return nil
}

// walInsertLSN returns the server's current WAL insert position.
func walInsertLSN(ctx context.Context, pool *pgxpool.Pool) (pglogrepl.LSN, error) {
	var s string
	if err := pool.QueryRow(ctx, `SELECT pg_current_wal_insert_lsn()::text`).Scan(&s); err != nil {
		return 0, fmt.Errorf("read the WAL insert position: %w", err)
	}
	return pglogrepl.ParseLSN(s)
}

// createBareSlot creates a pgoutput slot for a client other than the relay.
func createBareSlot(ctx context.Context, pool *pgxpool.Pool, name string) error {
	if _, err := pool.Exec(ctx, `SELECT pg_create_logical_replication_slot($1, 'pgoutput')`, name); err != nil {
		return fmt.Errorf("create slot %s: %w", name, err)
	}
	return nil
}

// dropSlot drops slot name, waiting until its walsender released it.
func dropSlot(ctx context.Context, pool *pgxpool.Pool, name string) error {
	for deadline := time.Now().Add(30 * time.Second); ; {
		_, err := pool.Exec(ctx, `SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots WHERE slot_name = $1`, name)
		if err == nil {
			return nil
		}
		if time.Now().After(deadline) || !isSQLState(err, "55006") {
			return fmt.Errorf("drop slot %s: %w", name, err)
		}
		if err := sleepCtx(ctx, 10*time.Millisecond); err != nil {
			return err
		}
	}
}

// waitSlotsIdle waits until no walsender holds a slot of the database, so the next client
// does not wait for a slot its predecessor's walsender is still releasing.
func waitSlotsIdle(ctx context.Context, pool *pgxpool.Pool) error {
	for deadline := time.Now().Add(30 * time.Second); ; {
		var busy int
		if err := pool.QueryRow(ctx, `SELECT count(*) FROM pg_replication_slots
			WHERE database = current_database() AND active`).Scan(&busy); err != nil {
			return fmt.Errorf("read the slots: %w", err)
		}
		if busy == 0 {
			return nil
		}
		if time.Now().After(deadline) {
			return errors.New("replication slots still active after 30s")
		}
		if err := sleepCtx(ctx, 5*time.Millisecond); err != nil {
			return err
		}
	}
}

// slotConfirmed returns slot's confirmed_flush_lsn.
func slotConfirmed(ctx context.Context, pool *pgxpool.Pool, slot string) (pglogrepl.LSN, error) {
	var s string
	if err := pool.QueryRow(ctx, `SELECT coalesce(confirmed_flush_lsn::text, '0/0') FROM pg_replication_slots
		WHERE slot_name = $1`, slot).Scan(&s); err != nil {
		return 0, fmt.Errorf("read slot %s: %w", slot, err)
	}
	return pglogrepl.ParseLSN(s)
}

// walsenderPID returns the pid of the walsender streaming slot, 0 when none does.
func walsenderPID(ctx context.Context, pool *pgxpool.Pool, slot string) (int, error) {
	var pid int
	if err := pool.QueryRow(ctx, `SELECT coalesce(active_pid, 0) FROM pg_replication_slots WHERE slot_name = $1`,
		slot).Scan(&pid); err != nil {
		return 0, fmt.Errorf("read slot %s: %w", slot, err)
	}
	return pid, nil
}
