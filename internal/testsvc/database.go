package testsvc

import (
	"context"
	"errors"
	"fmt"
	"net/url"
	"os"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"go.uber.org/goleak"

	"github.com/batonhq/baton/internal/throwaway"
	"github.com/batonhq/baton/migrations"
)

// EnvDatabaseURL points tests at an existing server instead of a throwaway cluster. The server
// must run with wal_level=logical and the role must be allowed to create databases.
const EnvDatabaseURL = "BATON_TEST_DATABASE_URL"

// shared is the cluster a test binary's NewDatabase calls share, started on first use and
// stopped by Main. Databases are cloned from a migrated template, which costs a few
// milliseconds instead of an initdb.
var shared struct {
	once     sync.Once
	err      error
	pg       *Postgres // nil when EnvDatabaseURL is used
	base     *url.URL
	admin    *pgxpool.Pool
	template string
	seq      atomic.Int64
	// rolePassword logs in roles.sql's roles (see roles.go); rolesCreated: dropRoles has work.
	rolePassword string
	rolesCreated bool
}

// Main runs the tests of a package, then stops the shared cluster, if one was started, and
// removes the programs Binary built.
// Call it from TestMain: os.Exit(testsvc.Main(m)).
func Main(m *testing.M) int {
	code := m.Run()
	for _, err := range []error{closeShared(), removeBinaries()} {
		if err != nil {
			fmt.Fprintln(os.Stderr, "testsvc:", err)
			if code == 0 {
				code = 1
			}
		}
	}
	return code
}

// MainNoLeaks is Main followed, when the tests passed, by a check that no goroutine outlived
// them (go.uber.org/goleak), for packages whose code starts goroutines. The shared cluster's
// pools are closed first, so they do not count.
func MainNoLeaks(m *testing.M) int {
	code := Main(m)
	if code == 0 {
		if err := goleak.Find(); err != nil {
			fmt.Fprintln(os.Stderr, "goleak:", err)
			code = 1
		}
	}
	return code
}

func closeShared() error {
	if shared.admin != nil {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		var err error
		if shared.pg == nil && shared.template != "" {
			_, _ = shared.admin.Exec(ctx, "DROP DATABASE IF EXISTS "+pgx.Identifier{shared.template}.Sanitize()+" WITH (FORCE)")
			err = dropRoles(ctx)
		}
		shared.admin.Close()
		if err != nil {
			return err
		}
	}
	if shared.pg != nil {
		return shared.pg.Close()
	}
	return nil
}

func setupShared() error {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	shared.template = fmt.Sprintf("baton_tpl_%d_%d", os.Getpid(), time.Now().UnixNano()%1e6)
	raw := os.Getenv(EnvDatabaseURL)
	if raw == "" {
		// pg_hba.conf as roles.sql asks a deployment to have it: the relay's role, which has
		// REPLICATION, may not make physical replication connections (baton status checks).
		pg, err := StartPostgresWith(ctx, throwaway.PostgresOptions{HBA: []string{
			"local replication " + roleName(RoleRelay) + " reject",
			"host replication " + roleName(RoleRelay) + " all reject",
		}})
		if errors.Is(err, throwaway.ErrNoPostgres) {
			return ErrNoPostgres
		}
		if err != nil {
			return err
		}
		shared.pg = pg
		raw = pg.URL("postgres")
	}
	base, err := url.Parse(raw)
	if err != nil || (base.Scheme != "postgres" && base.Scheme != "postgresql") {
		return fmt.Errorf("%s must be a postgres:// URL", EnvDatabaseURL)
	}
	shared.base = base
	admin, err := pgxpool.New(ctx, raw)
	if err != nil {
		return fmt.Errorf("connect to test postgres: %w", err)
	}
	shared.admin = admin
	var walLevel string
	if err := admin.QueryRow(ctx, "SHOW wal_level").Scan(&walLevel); err != nil {
		return fmt.Errorf("test postgres: %w", err)
	}
	if walLevel != "logical" {
		return fmt.Errorf("test postgres runs with wal_level=%s; Baton needs wal_level=logical", walLevel)
	}
	if _, err := admin.Exec(ctx, "CREATE DATABASE "+pgx.Identifier{shared.template}.Sanitize()); err != nil {
		return fmt.Errorf("create template database: %w", err)
	}
	conn, err := pgx.Connect(ctx, withDatabase(base, shared.template))
	if err != nil {
		return fmt.Errorf("connect to template database: %w", err)
	}
	defer func() { _ = conn.Close(ctx) }()
	if _, err := migrations.Up(ctx, conn); err != nil {
		return fmt.Errorf("migrate template database: %w", err)
	}
	return setupRoles(ctx, conn)
}

func withDatabase(base *url.URL, db string) string {
	u := *base
	u.Path = "/" + db
	return u.String()
}

// Database is a migrated database of its own for one test, with roles.sql applied (see
// roles.go): URL and Pool log in as the owner, RoleURL and RolePool as a Baton role.
type Database struct {
	Name string
	URL  string
	Pool *pgxpool.Pool

	allowPrivilegeErrors atomic.Bool // see AllowPrivilegeErrors
}

// NewDatabase returns a fresh, migrated database, dropped when the test ends together with any
// replication slot the test left in it (a leaked slot holds WAL).
func NewDatabase(t testing.TB) *Database {
	t.Helper()
	shared.once.Do(func() { shared.err = setupShared() })
	if shared.err != nil {
		t.Fatalf("test database: %v", shared.err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	name := fmt.Sprintf("%s_%d", strings.Replace(shared.template, "_tpl_", "_t_", 1), shared.seq.Add(1))
	if _, err := shared.admin.Exec(ctx, "CREATE DATABASE "+pgx.Identifier{name}.Sanitize()+
		" TEMPLATE "+pgx.Identifier{shared.template}.Sanitize()); err != nil {
		t.Fatalf("create test database: %v", err)
	}
	db := &Database{Name: name, URL: withDatabase(shared.base, name)}
	if err := grantDatabase(ctx, name); err != nil {
		t.Fatalf("%v", err)
	}
	pcfg, err := pgxpool.ParseConfig(db.URL)
	if err != nil {
		t.Fatalf("parse test database url: %v", err)
	}
	pcfg.MaxConns = 20 // tests run writers and observers side by side; 2 cores would give 4
	pool, err := pgxpool.NewWithConfig(ctx, pcfg)
	if err != nil {
		t.Fatalf("connect to test database: %v", err)
	}
	db.Pool = pool
	t.Cleanup(func() {
		pool.Close()
		db.checkPrivilegeErrors(t)
		ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		defer cancel()
		if err := DropSlots(ctx, shared.admin, name); err != nil {
			t.Errorf("drop replication slots of %s: %v", name, err)
		}
		if _, err := shared.admin.Exec(ctx, "DROP DATABASE IF EXISTS "+pgx.Identifier{name}.Sanitize()+" WITH (FORCE)"); err != nil {
			t.Errorf("drop test database %s: %v", name, err)
		}
	})
	return db
}

// DropSlots terminates the walsenders of, and drops, every replication slot of database db.
func DropSlots(ctx context.Context, admin *pgxpool.Pool, db string) error {
	deadline := time.Now().Add(30 * time.Second)
	for {
		if _, err := admin.Exec(ctx, `SELECT pg_terminate_backend(active_pid)
			FROM pg_replication_slots WHERE database = $1 AND active_pid IS NOT NULL`, db); err != nil {
			return err
		}
		var left int
		if err := admin.QueryRow(ctx, `SELECT count(*) FROM pg_replication_slots WHERE database = $1`, db).Scan(&left); err != nil {
			return err
		}
		if left == 0 {
			return nil
		}
		// A terminated walsender releases its slot asynchronously; dropping an active slot fails
		// with 55006 (object in use), so retry until the deadline.
		_, _ = admin.Exec(ctx, `SELECT pg_drop_replication_slot(slot_name)
			FROM pg_replication_slots WHERE database = $1 AND active_pid IS NULL`, db)
		if time.Now().After(deadline) {
			return fmt.Errorf("%d slots of %s still active after 30s", left, db)
		}
		time.Sleep(20 * time.Millisecond)
	}
}
