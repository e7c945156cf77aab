package testsvc

import (
	"context"
	"fmt"
	"os"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
)

// ExampleDatabase is NewDatabase for Example functions, which have no testing.TB: a fresh,
// migrated database of the shared cluster (stopped by Main), and a cleanup that drops it with
// any replication slot left in it. Call cleanup before the example returns.
func ExampleDatabase() (url string, cleanup func(), err error) {
	shared.once.Do(func() { shared.err = setupShared() })
	if shared.err != nil {
		return "", nil, fmt.Errorf("example database: %w", shared.err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	name := fmt.Sprintf("%s_%d", strings.Replace(shared.template, "_tpl_", "_ex_", 1), shared.seq.Add(1))
	if _, err := shared.admin.Exec(ctx, "CREATE DATABASE "+pgx.Identifier{name}.Sanitize()+
		" TEMPLATE "+pgx.Identifier{shared.template}.Sanitize()); err != nil {
		return "", nil, fmt.Errorf("create example database: %w", err)
	}
	cleanup = func() {
		ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		defer cancel()
		if err := DropSlots(ctx, shared.admin, name); err != nil {
			fmt.Fprintf(os.Stderr, "testsvc: drop replication slots of %s: %v\n", name, err)
		}
		if _, err := shared.admin.Exec(ctx, "DROP DATABASE IF EXISTS "+pgx.Identifier{name}.Sanitize()+" WITH (FORCE)"); err != nil {
			fmt.Fprintf(os.Stderr, "testsvc: drop example database %s: %v\n", name, err)
		}
	}
	return withDatabase(shared.base, name), cleanup, nil
}
