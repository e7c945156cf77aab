package testsvc

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"net/url"
	"os"
	"path/filepath"
	"regexp"
	"runtime"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
)

// Production runs each Baton process as its role of deploy/postgres/roles.sql, so tests do too:
// the shared cluster's template database gets roles.sql after its migrations, and every test
// database cloned from it has the roles' ownership, grants and row-level security. A test logs
// a process in with Database.RoleURL or Database.RolePool; Database.Pool and Database.URL are
// the owner's (a superuser on the throwaway cluster), for setting up and observing.
//
// Roles are cluster-wide. Each test binary names its roles after its template database
// (<template>_app, …), so packages that share a server (BATON_TEST_DATABASE_URL) never touch
// each other's roles and never a deployment's baton_* roles; the roles are created, altered
// and dropped by that binary alone, so no two binaries race on pg_authid. Against
// BATON_TEST_DATABASE_URL the URL's user needs CREATEROLE and REPLICATION (to create the relay's
// role WITH REPLICATION; a superuser has both); the roles are dropped when the binary ends.

// Role is one of roles.sql's roles.
type Role string

// roles.sql's roles, named without their "baton_" prefix.
const (
	RoleApp      Role = "app"      // the producer: user messages and their outbox rows
	RoleRelay    Role = "relay"    // baton relay: REPLICATION, the outbox's queue columns
	RoleWorker   Role = "worker"   // workers: claims, leases, final commits
	RoleMigrator Role = "migrator" // owns the schema; baton migrate
	RoleConsole  Role = "console"  // baton console
)

var allRoles = []Role{RoleApp, RoleRelay, RoleWorker, RoleMigrator, RoleConsole}

// RoleNameRE finds roles.sql's role names in its text; \b keeps table names such as
// baton_relay_slots intact.
var RoleNameRE = regexp.MustCompile(`\bbaton_(app|relay|worker|migrator|console)\b`)

// rolesSQLPath is deploy/postgres/roles.sql, found from this file's place in the repository
// (tests run from a checkout).
func rolesSQLPath() string {
	_, file, _, _ := runtime.Caller(0)
	return filepath.Join(filepath.Dir(file), "..", "..", "deploy", "postgres", "roles.sql")
}

// RolesSQL returns deploy/postgres/roles.sql with its roles named prefix_app, prefix_relay, ….
func RolesSQL(prefix string) (string, error) {
	raw, err := os.ReadFile(rolesSQLPath())
	if err != nil {
		return "", fmt.Errorf("read roles.sql: %w", err)
	}
	if !RoleNameRE.Match(raw) {
		return "", fmt.Errorf("roles.sql names none of Baton's roles")
	}
	return RoleNameRE.ReplaceAllString(string(raw), prefix+"_$1"), nil
}

// setupRoles applies roles.sql to the template database (reached as conn) under the binary's
// role names, and gives each role the binary's password.
func setupRoles(ctx context.Context, conn *pgx.Conn) error {
	sql, err := RolesSQL(shared.template)
	if err != nil {
		return err
	}
	pw := make([]byte, 16)
	if _, err := rand.Read(pw); err != nil {
		return fmt.Errorf("role password: %w", err)
	}
	shared.rolePassword = hex.EncodeToString(pw)
	shared.rolesCreated = true
	if _, err := conn.Exec(ctx, sql); err != nil {
		return fmt.Errorf("apply roles.sql to the template database (the test user needs CREATEROLE and REPLICATION): %w", err)
	}
	for _, r := range allRoles {
		if _, err := conn.Exec(ctx, "ALTER ROLE "+roleIdent(r)+" PASSWORD '"+shared.rolePassword+"'"); err != nil {
			return fmt.Errorf("set the password of %s: %w", roleName(r), err)
		}
	}
	return nil
}

// grantDatabase gives the roles what roles.sql grants on the database itself, which a clone
// of the template does not inherit (pg_database's ACL is per database).
func grantDatabase(ctx context.Context, name string) error {
	db := pgx.Identifier{name}.Sanitize()
	_, err := shared.admin.Exec(ctx, fmt.Sprintf("GRANT CONNECT ON DATABASE %s TO %s, %s, %s, %s, %s; GRANT CREATE ON DATABASE %s TO %s",
		db, roleIdent(RoleMigrator), roleIdent(RoleApp), roleIdent(RoleRelay), roleIdent(RoleWorker), roleIdent(RoleConsole),
		db, roleIdent(RoleMigrator)))
	if err != nil {
		return fmt.Errorf("grant the roles the test database: %w", err)
	}
	return nil
}

// dropRoles drops the binary's roles; every database they had privileges in is gone by then.
func dropRoles(ctx context.Context) error {
	if !shared.rolesCreated {
		return nil
	}
	for _, r := range allRoles {
		if _, err := shared.admin.Exec(ctx, "DROP ROLE IF EXISTS "+roleIdent(r)); err != nil {
			return fmt.Errorf("drop role %s: %w", roleName(r), err)
		}
	}
	return nil
}

// rolesMu serialises the binary's runs of roles.sql: each alters the roles (pg_authid), and two
// at once fail with "tuple concurrently updated".
var rolesMu sync.Mutex

// ApplyRoles runs roles.sql again in the test's database with Baton's schema and publication
// named as BATON_SCHEMA and BATON_PUBLICATION would ("" for the defaults), for a test that moved
// or renamed them.
func (db *Database) ApplyRoles(t testing.TB, schema, publication string) {
	t.Helper()
	sql, err := RolesSQL(shared.template)
	if err != nil {
		t.Fatalf("%v", err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	conn, err := pgx.Connect(ctx, db.URL)
	if err != nil {
		t.Fatalf("connect to apply roles.sql: %v", err)
	}
	defer func() { _ = conn.Close(ctx) }()
	if _, err := conn.Exec(ctx, `SELECT set_config('baton.schema', $1, false), set_config('baton.publication', $2, false)`,
		schema, publication); err != nil {
		t.Fatalf("apply roles.sql: %v", err)
	}
	rolesMu.Lock()
	defer rolesMu.Unlock()
	if _, err := conn.Exec(ctx, sql); err != nil {
		t.Fatalf("apply roles.sql with schema %q and publication %q: %v", schema, publication, err)
	}
}

func roleName(r Role) string  { return shared.template + "_" + string(r) }
func roleIdent(r Role) string { return pgx.Identifier{roleName(r)}.Sanitize() }

// RoleName returns the name role has in this test binary's cluster.
func (db *Database) RoleName(role Role) string { return roleName(role) }

// RoleURL returns the database's URL logging in as role.
func (db *Database) RoleURL(role Role) string {
	u, err := url.Parse(db.URL)
	if err != nil {
		panic(fmt.Sprintf("test database URL: %v", err)) // NewDatabase made it
	}
	u.User = url.UserPassword(roleName(role), shared.rolePassword)
	return u.String()
}

// RolePool returns a pool on the database logged in as role, closed when the test ends.
func (db *Database) RolePool(t testing.TB, role Role) *pgxpool.Pool {
	t.Helper()
	cfg, err := pgxpool.ParseConfig(db.RoleURL(role))
	if err != nil {
		t.Fatalf("role pool: %v", err)
	}
	cfg.MaxConns = 20
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	p, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		t.Fatalf("connect as %s: %v", roleName(role), err)
	}
	t.Cleanup(func() {
		// Close waits for every connection to be released: a test that failed with a
		// transaction open would wait for ever.
		closed := make(chan struct{})
		go func() { p.Close(); close(closed) }()
		select {
		case <-closed:
		case <-time.After(10 * time.Second):
			t.Errorf("the pool logged in as %s still had a connection in use 10s after the test (a transaction left open?)", roleName(role))
		}
	})
	return p
}
