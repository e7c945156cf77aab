package migrations

import (
	"context"
	"embed"
	"errors"
	"fmt"
	"io/fs"
	"sort"
	"strconv"
	"strings"

	"github.com/jackc/pgx/v5"
)

//go:embed *.sql
var files embed.FS

// lockKey is the advisory lock that serialises migrators: the first 8 bytes of "baton.mi" read
// as a big-endian integer. Any process running Up takes it, so two at once are safe.
const lockKey int64 = 0x626174_6f6e2e6d69

// Table records applied versions.
const Table = "baton_schema_migrations"

// Migration is one versioned SQL file.
type Migration struct {
	Version int
	Name    string
	SQL     string
}

// Beginner starts transactions; *pgx.Conn, *pgxpool.Pool and pgx.Tx satisfy it.
type Beginner interface {
	Begin(ctx context.Context) (pgx.Tx, error)
}

// All returns the embedded migrations in version order.
func All() ([]Migration, error) {
	entries, err := fs.Glob(files, "*.sql")
	if err != nil {
		return nil, fmt.Errorf("list migrations: %w", err)
	}
	out := make([]Migration, 0, len(entries))
	seen := map[int]string{}
	for _, name := range entries {
		num, rest, ok := strings.Cut(strings.TrimSuffix(name, ".sql"), "_")
		v, err := strconv.Atoi(num)
		if !ok || err != nil || v <= 0 {
			return nil, fmt.Errorf("migration file %q: name must be NNNN_description.sql", name)
		}
		if prev, dup := seen[v]; dup {
			return nil, fmt.Errorf("migration version %d used by %q and %q", v, prev, name)
		}
		seen[v] = name
		body, err := files.ReadFile(name)
		if err != nil {
			return nil, fmt.Errorf("read migration %q: %w", name, err)
		}
		out = append(out, Migration{Version: v, Name: rest, SQL: string(body)})
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Version < out[j].Version })
	return out, nil
}

// Latest returns the highest embedded version.
func Latest() int {
	all, err := All()
	if err != nil || len(all) == 0 {
		return 0
	}
	return all[len(all)-1].Version
}

// Up applies every embedded migration not yet recorded, in version order, and returns the
// versions it applied (empty when the schema was current).
//
// Each version runs in its own transaction together with its record in baton_schema_migrations,
// so a failed version leaves nothing behind. Every transaction first takes a transaction-scoped
// advisory lock and then re-reads what is applied, so concurrent Up calls from any number of
// processes apply each version exactly once; the losers wait and find nothing left to do.
func Up(ctx context.Context, db Beginner) ([]int, error) {
	all, err := All()
	if err != nil {
		return nil, err
	}
	var applied []int
	for _, m := range all {
		did, err := apply(ctx, db, m)
		if err != nil {
			return applied, err
		}
		if did {
			applied = append(applied, m.Version)
		}
	}
	return applied, nil
}

func apply(ctx context.Context, db Beginner, m Migration) (bool, error) {
	tx, err := db.Begin(ctx)
	if err != nil {
		return false, fmt.Errorf("migration %d: begin: %w", m.Version, err)
	}
	defer func() { _ = tx.Rollback(ctx) }()

	if _, err := tx.Exec(ctx, "SELECT pg_advisory_xact_lock($1)", lockKey); err != nil {
		return false, fmt.Errorf("migration %d: take advisory lock: %w", m.Version, err)
	}
	if _, err := tx.Exec(ctx, `CREATE TABLE IF NOT EXISTS `+Table+` (
		version    integer PRIMARY KEY,
		name       text NOT NULL,
		applied_at timestamptz NOT NULL DEFAULT now())`); err != nil {
		return false, fmt.Errorf("migration %d: create %s: %w", m.Version, Table, err)
	}
	var exists bool
	if err := tx.QueryRow(ctx, `SELECT EXISTS (SELECT 1 FROM `+Table+` WHERE version = $1)`, m.Version).Scan(&exists); err != nil {
		return false, fmt.Errorf("migration %d: read %s: %w", m.Version, Table, err)
	}
	if exists {
		return false, nil
	}
	// Simple protocol: a migration file holds several statements.
	if _, err := tx.Exec(ctx, m.SQL, pgx.QueryExecModeSimpleProtocol); err != nil {
		return false, fmt.Errorf("migration %d (%s): %w", m.Version, m.Name, err)
	}
	if _, err := tx.Exec(ctx, `INSERT INTO `+Table+` (version, name) VALUES ($1, $2)`, m.Version, m.Name); err != nil {
		return false, fmt.Errorf("migration %d: record: %w", m.Version, err)
	}
	if err := tx.Commit(ctx); err != nil {
		return false, fmt.Errorf("migration %d: commit: %w", m.Version, err)
	}
	return true, nil
}

// Applied returns the versions recorded in the database, in order; none when Up never ran.
func Applied(ctx context.Context, db Beginner) ([]int, error) {
	tx, err := db.Begin(ctx)
	if err != nil {
		return nil, fmt.Errorf("applied migrations: begin: %w", err)
	}
	defer func() { _ = tx.Rollback(ctx) }()
	var present bool
	if err := tx.QueryRow(ctx, `SELECT to_regclass($1) IS NOT NULL`, Table).Scan(&present); err != nil {
		return nil, fmt.Errorf("applied migrations: %w", err)
	}
	if !present {
		return nil, nil
	}
	rows, err := tx.Query(ctx, `SELECT version FROM `+Table+` ORDER BY version`)
	if err != nil {
		return nil, fmt.Errorf("applied migrations: %w", err)
	}
	versions, err := pgx.CollectRows(rows, pgx.RowTo[int])
	if err != nil {
		return nil, fmt.Errorf("applied migrations: %w", err)
	}
	return versions, nil
}

// ErrSchemaBehind is returned by Check when the database lacks embedded versions.
var ErrSchemaBehind = errors.New("database schema is behind this binary: run `baton migrate`")

// Check reports ErrSchemaBehind (wrapped, with the versions) when the database lacks a
// version this binary embeds.
func Check(ctx context.Context, db Beginner) error {
	applied, err := Applied(ctx, db)
	if err != nil {
		return err
	}
	have := 0
	if len(applied) > 0 {
		have = applied[len(applied)-1]
	}
	if want := Latest(); have < want {
		return fmt.Errorf("schema version %d, want %d: %w", have, want, ErrSchemaBehind)
	}
	return nil
}
