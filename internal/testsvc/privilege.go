package testsvc

import (
	"bufio"
	"fmt"
	"os"
	"regexp"
	"strings"
	"testing"
)

// A privilege error of a Baton role can hide where the code drops the error (a rollback that
// undoes a release, a log line nobody reads): the test passes, and production fails under
// roles.sql. So a test's database is checked when the test ends: the throwaway cluster logs
// every error with its SQLSTATE, user and database (log_line_prefix), and a line with SQLSTATE
// 42501 (insufficient_privilege) by one of Baton's roles in the test's database fails the test.
// Against BATON_TEST_DATABASE_URL the server's log is not ours to read: the check is off there.

// batonRoleRE matches Baton's roles as roles.sql names them, and as tests name them after their
// database (<database>_app, ...).
var batonRoleRE = regexp.MustCompile(`^(baton|[a-z0-9_]+)_(app|relay|worker|migrator|console)$`)

// AllowPrivilegeErrors turns the check off for this database: for a test that provokes
// privilege errors of Baton's roles on purpose (a role test that requires a refusal).
func (db *Database) AllowPrivilegeErrors() { db.allowPrivilegeErrors.Store(true) }

// checkPrivilegeErrors fails t when the server logged SQLSTATE 42501 for a Baton role in db.
func (db *Database) checkPrivilegeErrors(t testing.TB) {
	t.Helper()
	if shared.pg == nil || db.allowPrivilegeErrors.Load() {
		return
	}
	lines, err := privilegeErrors(shared.pg.LogPath(), db.Name)
	if err != nil {
		t.Errorf("read the server's log for privilege errors: %v", err)
		return
	}
	if len(lines) > 0 {
		t.Errorf("Postgres refused a Baton role a privilege (SQLSTATE 42501) in this test's database; "+
			"a statement needs a grant roles.sql lacks, or the test expects the refusal (db.AllowPrivilegeErrors):\n%s",
			strings.Join(lines, "\n"))
	}
}

// PrivilegeErrors returns the lines of the throwaway cluster's log at path (Postgres.LogPath)
// that record SQLSTATE 42501 by one of Baton's roles (roles.sql's names, or a test binary's) in
// database db: for a test that runs Baton's processes as their roles on a cluster of its own.
func PrivilegeErrors(path, db string) ([]string, error) { return privilegeErrors(path, db) }

// privilegeErrors returns the log lines (and the statement lines after them) of SQLSTATE 42501
// by a Baton role in database db.
func privilegeErrors(path, db string) ([]string, error) {
	f, err := os.Open(path) //nolint:gosec // G304: the throwaway cluster's own log
	if err != nil {
		return nil, fmt.Errorf("open %s: %w", path, err)
	}
	defer func() { _ = f.Close() }()
	var out []string
	sc := bufio.NewScanner(f)
	sc.Buffer(make([]byte, 64<<10), 16<<20)
	for sc.Scan() {
		user, ok := privilegeErrorUser(sc.Text(), db)
		if ok && batonRoleRE.MatchString(user) {
			out = append(out, sc.Text())
		}
	}
	return out, sc.Err()
}

// privilegeErrorUser reports the user of a log line of SQLSTATE 42501 in database db.
func privilegeErrorUser(line, db string) (string, bool) {
	i := strings.Index(line, "] 42501 ")
	if i < 0 {
		return "", false
	}
	rest := line[i+len("] 42501 "):]
	who, _, ok := strings.Cut(rest, " ")
	if !ok {
		return "", false
	}
	user, database, ok := strings.Cut(who, "@")
	return user, ok && database == db
}
