package demo

import (
	"context"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
)

// queryDatabase reads the run's rows back: outbox rows (no second row for a retry), the
// database-side commit→reply latency, the turns per worker and the recorded operations. A
// failed query leaves its figure unknown and is logged.
func (d *Demo) queryDatabase(ctx context.Context, pool *pgxpool.Pool) Database {
	db := unknownDatabase
	log := d.cfg.Logger
	if err := pool.QueryRow(ctx, `SELECT count(*) FROM agent_outbox WHERE starts_with(message_id, $1)`,
		d.msgPrefix()).Scan(&db.OutboxRows); err != nil {
		log.Warn("count the demo's outbox rows", "error", err)
		db.OutboxRows = -1
	}
	// created_at is set in the sending transaction (its start); finished_at in the worker's
	// final commit (clock time, just before it commits).
	var p50, p99 float64
	if err := pool.QueryRow(ctx, `SELECT count(*),
			coalesce(percentile_disc(0.5) WITHIN GROUP (ORDER BY s), 0),
			coalesce(percentile_disc(0.99) WITHIN GROUP (ORDER BY s), 0)
		FROM (SELECT extract(epoch FROM r.finished_at - o.created_at)::float8 AS s
			FROM agent_outbox o JOIN agent_runs r ON r.run_id = o.run_id
			WHERE starts_with(o.message_id, $1) AND o.status = 'done' AND r.finished_at IS NOT NULL) l`,
		d.msgPrefix()).Scan(&db.Replies, &p50, &p99); err != nil {
		log.Warn("database-side latency", "error", err)
		db.Replies = -1
	}
	db.ReplyP50 = time.Duration(p50 * float64(time.Second))
	db.ReplyP99 = time.Duration(p99 * float64(time.Second))
	rows, err := pool.Query(ctx, `SELECT worker, count(*) FROM agent_runs WHERE starts_with(conversation_id, $1)
		GROUP BY worker ORDER BY worker`, d.convPrefix())
	if err == nil {
		db.WorkerTurns, err = pgx.CollectRows(rows, func(row pgx.CollectableRow) (WorkerTurns, error) {
			var w WorkerTurns
			err := row.Scan(&w.Name, &w.Runs)
			return w, err
		})
	}
	if err != nil {
		log.Warn("count the workers' turns", "error", err)
		db.WorkerTurns = nil
	}
	if err := pool.QueryRow(ctx, `SELECT count(*) FROM operations WHERE starts_with(conversation_id, $1) AND tool = 'lookup'`,
		d.convPrefix()).Scan(&db.Lookups); err != nil {
		log.Warn("count the demo's operations", "error", err)
		db.Lookups = -1
	}
	return db
}
