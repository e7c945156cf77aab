package testsvc

import (
	"context"
	"testing"

	"github.com/jackc/pgx/v5"
)

// Query runs sql on db and returns the first column of every row, failing t on any error.
func Query[T any](t testing.TB, db *Database, sql string, args ...any) []T {
	t.Helper()
	rows, err := db.Pool.Query(context.Background(), sql, args...)
	if err != nil {
		t.Fatalf("query %q: %v", sql, err)
	}
	out, err := pgx.CollectRows(rows, pgx.RowTo[T])
	if err != nil {
		t.Fatalf("query %q: %v", sql, err)
	}
	return out
}
