package statusreport

import (
	"regexp"
	"slices"
	"strings"
)

// HBACheckSQL lists pg_hba.conf's lines for physical replication connections, the check an
// operator runs as a superuser (PostgreSQL lets only superusers read pg_hba_file_rules by
// default): the first line naming the relay's role (or all) must be its reject line.
const HBACheckSQL = `SELECT line_number, type, database, user_name, address, auth_method, error FROM pg_hba_file_rules WHERE 'replication' = ANY (database) ORDER BY line_number;`

// RejectLine is the pg_hba.conf line that refuses role's physical replication connections
// (pg_basebackup) over TCP from every address. It goes before the file's other lines: the first
// line that matches a connection decides. The relay's logical replication connections match
// the database lines, not this one.
func RejectLine(role string) string {
	return "host replication " + hbaQuote(role) + " all reject"
}

// hbaQuote quotes a role name for pg_hba.conf when it is not a plain lowercase name.
func hbaQuote(name string) string {
	plain := name != "" && strings.IndexFunc(name, func(r rune) bool {
		return (r < 'a' || r > 'z') && (r < '0' || r > '9') && r != '_'
	}) < 0
	if plain && name != "all" && name != "replication" {
		return name
	}
	return `"` + strings.ReplaceAll(name, `"`, `""`) + `"`
}

// hbaRule is one line of pg_hba.conf as pg_hba_file_rules shows it.
type hbaRule struct {
	Line     int
	Type     string // local, host, hostssl, hostnossl, hostgssenc or hostnogssenc
	Database []string
	User     []string
	Address  string // "all", "samehost", "samenet", an address or a host name; "" for local
	Method   string
	Error    string
}

// physicalAccess decides whether rules refuse role's physical replication connections over
// TCP from every address, and which line decides (0 when none does). memberOf are the roles
// role is a member of (for +group entries).
//
// Rules apply in order, and the first line whose connection type, database, user and address
// match a connection decides it. Only `replication` in a line's database list matches a physical
// replication connection (`all` does not); local lines (Unix sockets, reachable only on the
// server's host) are left aside. A reject line refuses every TCP connection only when it is a
// `host` line (SSL or not, GSS or not) for all addresses naming the role surely (by name, +group
// or all): a narrower reject line leaves other connections to the lines after it. Any other
// line for the role lets some connections in. No line at all refuses them.
func physicalAccess(rules []hbaRule, role string, memberOf []string) (refused bool, line int) {
	for _, r := range rules {
		if r.Type == "local" || !slices.Contains(r.Database, "replication") {
			continue
		}
		if r.Method == "reject" {
			if r.Type == "host" && r.Address == "all" && hbaUserMatches(r.User, role, memberOf, false) {
				return true, r.Line
			}
			continue
		}
		if hbaUserMatches(r.User, role, memberOf, true) {
			return false, r.Line
		}
	}
	return true, 0
}

// hbaUserMatches reports whether a line's user list names role: all, its name, +group of a
// role it is a member of (or itself), or a /regular expression (PostgreSQL 16) matching it. A
// regular expression Go cannot read matches when unsure is true.
func hbaUserMatches(users []string, role string, memberOf []string, unsure bool) bool {
	for _, u := range users {
		switch {
		case u == "all" || u == role:
			return true
		case strings.HasPrefix(u, "+"):
			if g := u[1:]; g == role || slices.Contains(memberOf, g) {
				return true
			}
		case strings.HasPrefix(u, "/"):
			re, err := regexp.Compile(u[1:])
			if err != nil {
				if unsure {
					return true
				}
				continue
			}
			if re.MatchString(role) {
				return true
			}
		}
	}
	return false
}
