package migrations

import (
	"context"
	"embed"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"sort"
	"strconv"
	"strings"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
)

//go:embed *.sql
var files embed.FS

// Migrators are serialised by a lock on the migrations table (lockMode, taken in every
// migration's transaction), which only roles that may write that table can take. Earlier
// versions took an advisory lock on a constant key instead: any role that can connect can take
// that key and sit on it, and migrations waited for ever.
const lockMode = "SHARE ROW EXCLUSIVE"

// lockStatement locks the migrations table of o against other migrators. The mode conflicts
// with itself and with writers, not with readers (ACCESS SHARE): a role that may only read
// the table cannot hold migrations back with it.
func lockStatement(o Options) string {
	return "LOCK TABLE " + o.table() + " IN " + lockMode + " MODE"
}

// Table records applied versions.
const Table = "baton_schema_migrations"

// Migration is one versioned SQL file.
type Migration struct {
	Version int
	Name    string
	// SQL is the file's text, with the publication's name written as psql's variable
	// :"publication"; Options.Render substitutes it.
	SQL string
}

// Options says where the schema lives. The zero value is Baton's default: schema public,
// publication baton.
type Options struct {
	// Schema holds every Baton table and function (BATON_SCHEMA): created when missing, and
	// first on the search_path of each migration's transaction. Default "public".
	Schema string
	// Publication is the name of the publication the relay streams (BATON_PUBLICATION).
	// Default "baton".
	Publication string
}

func (o Options) withDefaults() Options {
	if o.Schema == "" {
		o.Schema = "public"
	}
	if o.Publication == "" {
		o.Publication = "baton"
	}
	return o
}

// Render returns the SQL of m with the publication's name substituted.
func (o Options) Render(m Migration) string {
	o = o.withDefaults()
	return strings.ReplaceAll(m.SQL, `:"publication"`, pgx.Identifier{o.Publication}.Sanitize())
}

// table returns the migrations table's name, qualified with the schema.
func (o Options) table() string {
	return pgx.Identifier{o.withDefaults().Schema, Table}.Sanitize()
}

// Print writes every migration as one script for tools that apply SQL themselves: each
// version in its own transaction, with the statements Up runs around it (creating the schema,
// setting the search_path, recording the version), so that Up later finds them applied.
func Print(w io.Writer, o Options) error {
	o = o.withDefaults()
	all, err := All()
	if err != nil {
		return err
	}
	schema := pgx.Identifier{o.Schema}.Sanitize()
	if _, err := fmt.Fprintf(w, "-- Baton schema, versions 1 to %d, in schema %s, publication %s.\n"+
		"-- Each version is one transaction; a version already recorded in %s is skipped by baton migrate, not by this script.\n",
		Latest(), o.Schema, o.Publication, Table); err != nil {
		return err
	}
	for _, m := range all {
		_, err := fmt.Fprintf(w, "\n-- Version %d: %s\nBEGIN;\nCREATE SCHEMA IF NOT EXISTS %s;\nSET LOCAL search_path TO %s;\n%s;\n%s;\n%s\nINSERT INTO %s (version, name) VALUES (%d, '%s');\nCOMMIT;\n",
			m.Version, m.Name, schema, schema, createTable(o), lockStatement(o), strings.TrimSpace(o.Render(m)), o.table(), m.Version, m.Name)
		if err != nil {
			return err
		}
	}
	return nil
}

// createTable is the statement creating the migrations table.
func createTable(o Options) string {
	return `CREATE TABLE IF NOT EXISTS ` + o.table() + ` (
	version    integer PRIMARY KEY,
	name       text NOT NULL,
	applied_at timestamptz NOT NULL DEFAULT now())`
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
// so a failed version leaves nothing behind. Every transaction first locks the migrations table
// (lockStatement: only roles that may write it can) and then re-reads what is applied, so
// concurrent Up calls from any number of processes apply each version exactly once; the losers
// wait and find nothing left to do.
func Up(ctx context.Context, db Beginner) ([]int, error) {
	return UpWith(ctx, db, Options{})
}

// UpWith is Up into the schema and with the publication of o.
func UpWith(ctx context.Context, db Beginner, o Options) ([]int, error) {
	o = o.withDefaults()
	all, err := All()
	if err != nil {
		return nil, err
	}
	var applied []int
	for _, m := range all {
		did, err := apply(ctx, db, m, o)
		if err != nil {
			return applied, err
		}
		if did {
			applied = append(applied, m.Version)
		}
	}
	return applied, nil
}

func apply(ctx context.Context, db Beginner, m Migration, o Options) (bool, error) {
	for attempt := 1; ; attempt++ {
		did, err := applyOnce(ctx, db, m, o)
		var pgErr *pgconn.PgError
		// Two first migrators create the schema or the migrations table at once: the loser's
		// statement fails on the catalog's unique index (or as a duplicate) and the next
		// attempt finds them made.
		if errors.As(err, &pgErr) && attempt < 5 &&
			(pgErr.Code == "23505" || pgErr.Code == "42P06" || pgErr.Code == "42P07") {
			continue
		}
		return did, err
	}
}

func applyOnce(ctx context.Context, db Beginner, m Migration, o Options) (bool, error) {
	tx, err := db.Begin(ctx)
	if err != nil {
		return false, fmt.Errorf("migration %d: begin: %w", m.Version, err)
	}
	defer func() { _ = tx.Rollback(ctx) }()

	// CREATE SCHEMA IF NOT EXISTS needs CREATE on the database even when the schema exists:
	// only a missing schema is created.
	schema := pgx.Identifier{o.Schema}.Sanitize()
	var haveSchema bool
	if err := tx.QueryRow(ctx, `SELECT to_regnamespace($1) IS NOT NULL`, schema).Scan(&haveSchema); err != nil {
		return false, fmt.Errorf("migration %d: look up schema %s: %w", m.Version, o.Schema, err)
	}
	if !haveSchema {
		if _, err := tx.Exec(ctx, `CREATE SCHEMA `+schema); err != nil {
			return false, fmt.Errorf("migration %d: create schema %s: %w", m.Version, o.Schema, err)
		}
	}
	if _, err := tx.Exec(ctx, `SET LOCAL search_path TO `+schema); err != nil {
		return false, fmt.Errorf("migration %d: search_path: %w", m.Version, err)
	}
	if _, err := tx.Exec(ctx, createTable(o)); err != nil {
		return false, fmt.Errorf("migration %d: create %s: %w", m.Version, Table, err)
	}
	if _, err := tx.Exec(ctx, lockStatement(o)); err != nil {
		return false, fmt.Errorf("migration %d: lock %s against other migrators: %w", m.Version, Table, err)
	}
	var exists bool
	if err := tx.QueryRow(ctx, `SELECT EXISTS (SELECT 1 FROM `+o.table()+` WHERE version = $1)`, m.Version).Scan(&exists); err != nil {
		return false, fmt.Errorf("migration %d: read %s: %w", m.Version, Table, err)
	}
	if exists {
		return false, nil
	}
	// Simple protocol: a migration file holds several statements.
	if _, err := tx.Exec(ctx, o.Render(m), pgx.QueryExecModeSimpleProtocol); err != nil {
		return false, fmt.Errorf("migration %d (%s): %w", m.Version, m.Name, err)
	}
	if _, err := tx.Exec(ctx, `INSERT INTO `+o.table()+` (version, name) VALUES ($1, $2)`, m.Version, m.Name); err != nil {
		return false, fmt.Errorf("migration %d: record: %w", m.Version, err)
	}
	if err := tx.Commit(ctx); err != nil {
		return false, fmt.Errorf("migration %d: commit: %w", m.Version, err)
	}
	return true, nil
}

// Applied returns the versions recorded in the database, in order; none when Up never ran.
func Applied(ctx context.Context, db Beginner) ([]int, error) {
	return AppliedIn(ctx, db, "")
}

// AppliedIn is Applied for a schema other than public ("" is public).
func AppliedIn(ctx context.Context, db Beginner, schema string) ([]int, error) {
	o := Options{Schema: schema}
	tx, err := db.Begin(ctx)
	if err != nil {
		return nil, fmt.Errorf("applied migrations: begin: %w", err)
	}
	defer func() { _ = tx.Rollback(ctx) }()
	var present bool
	if err := tx.QueryRow(ctx, `SELECT to_regclass($1) IS NOT NULL`, o.table()).Scan(&present); err != nil {
		return nil, fmt.Errorf("applied migrations: %w", err)
	}
	if !present {
		return nil, nil
	}
	rows, err := tx.Query(ctx, `SELECT version FROM `+o.table()+` ORDER BY version`)
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
	return CheckIn(ctx, db, "")
}

// CheckIn is Check for a schema other than public ("" is public).
func CheckIn(ctx context.Context, db Beginner, schema string) error {
	applied, err := AppliedIn(ctx, db, schema)
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
