package statusreport

import (
	"testing"

	"github.com/stretchr/testify/require"
)

// rule is a pg_hba_file_rules row for the table below: database replication, one user.
func rule(line int, typ, user, address, method string) hbaRule {
	return hbaRule{Line: line, Type: typ, Database: []string{"replication"}, User: []string{user}, Address: address, Method: method}
}

// initdbRules are the replication lines initdb writes, after its database lines.
var initdbRules = []hbaRule{
	{Line: 89, Type: "local", Database: []string{"all"}, User: []string{"all"}, Method: "trust"},
	{Line: 91, Type: "host", Database: []string{"all"}, User: []string{"all"}, Address: "127.0.0.1", Method: "trust"},
	rule(96, "local", "all", "", "trust"),
	rule(97, "host", "all", "127.0.0.1", "trust"),
	rule(98, "host", "all", "::1", "trust"),
}

func TestPhysicalAccess(t *testing.T) {
	t.Parallel()
	for _, tt := range []struct {
		name     string
		rules    []hbaRule
		memberOf []string
		refused  bool
		line     int
	}{
		{name: "initdb's file lets every role in", rules: initdbRules, line: 97},
		{name: "the reject line first", rules: append([]hbaRule{rule(1, "host", "baton_relay", "all", "reject")}, initdbRules...),
			refused: true, line: 1},
		{name: "a reject line for all", rules: append([]hbaRule{rule(1, "host", "all", "all", "reject")}, initdbRules...),
			refused: true, line: 1},
		{name: "a reject line for a group of the role's", memberOf: []string{"relays"},
			rules: append([]hbaRule{rule(1, "host", "+relays", "all", "reject")}, initdbRules...), refused: true, line: 1},
		{name: "a reject line for +the role itself",
			rules: append([]hbaRule{rule(1, "host", "+baton_relay", "all", "reject")}, initdbRules...), refused: true, line: 1},
		{name: "a reject line for a group it is not in",
			rules: append([]hbaRule{rule(1, "host", "+others", "all", "reject")}, initdbRules...), line: 97},
		{name: "a reject line for another role",
			rules: append([]hbaRule{rule(1, "host", "someone", "all", "reject")}, initdbRules...), line: 97},
		{name: "a reject line for SSL connections only leaves the others",
			rules: append([]hbaRule{rule(1, "hostssl", "baton_relay", "all", "reject")}, initdbRules...), line: 97},
		{name: "a reject line for one address leaves the others",
			rules: append([]hbaRule{rule(1, "host", "baton_relay", "10.0.0.0", "reject")}, initdbRules...), line: 97},
		{name: "a line letting it in before the reject line decides",
			rules: []hbaRule{rule(5, "hostssl", "baton_relay", "all", "scram-sha-256"), rule(6, "host", "baton_relay", "all", "reject")}, line: 5},
		{name: "database lines, all included, never match physical replication",
			rules: initdbRules[:2], refused: true},
		{name: "local lines are left aside", rules: initdbRules[:3], refused: true},
		{name: "a regular expression naming it rejects", rules: append([]hbaRule{rule(1, "host", "/^baton_", "all", "reject")}, initdbRules...),
			refused: true, line: 1},
		{name: "a regular expression Go cannot read rejects nothing",
			rules: append([]hbaRule{rule(1, "host", "/(?<x>", "all", "reject")}, initdbRules...), line: 97},
		{name: "a regular expression Go cannot read may let it in",
			rules: []hbaRule{rule(3, "host", "/(?<x>", "all", "md5")}, line: 3},
		{name: "a user list naming it among others",
			rules: []hbaRule{{Line: 2, Type: "hostnossl", Database: []string{"baton", "replication"}, User: []string{"app", "baton_relay"}, Address: "samenet", Method: "md5"}},
			line:  2},
	} {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			refused, line := physicalAccess(tt.rules, "baton_relay", tt.memberOf)
			require.Equal(t, tt.refused, refused, "refused")
			require.Equal(t, tt.line, line, "line")
		})
	}
}

func TestRejectLine(t *testing.T) {
	t.Parallel()
	require.Equal(t, "host replication baton_relay all reject", RejectLine("baton_relay"))
	require.Equal(t, `host replication "Relay" all reject`, RejectLine("Relay"))
	require.Equal(t, `host replication "all" all reject`, RejectLine("all"))
	require.Equal(t, `host replication "a ""b""" all reject`, RejectLine(`a "b"`))
}

// TestEvaluateReplicationAccess: a relay role pg_hba.conf lets in is a warning naming the line
// and the reject line; refused, or not checked, it is none. It never needs attention.
func TestEvaluateReplicationAccess(t *testing.T) {
	t.Parallel()
	yes, no, line := true, false, 97
	r := &Report{Schema: Schema{Version: 1, BinaryVersion: 1}, Slot: Slot{Name: "baton", Exists: true, Active: true},
		ReplicationAccess: ReplicationAccess{HBAChecked: true, Roles: []ReplicationRole{
			{Name: "baton_relay", PhysicalRefused: &no, HBALine: &line},
			{Name: "other_relay", PhysicalRefused: &yes},
		}}}
	r.Evaluate()
	require.True(t, r.OK)
	require.Equal(t, []string{"role baton_relay may copy the whole cluster with pg_basebackup (every database, every role's password verifier): " +
		"pg_hba.conf line 97 lets its physical replication connections in; put `host replication baton_relay all reject` before it, then SELECT pg_reload_conf()"},
		r.Warnings)

	r.ReplicationAccess = ReplicationAccess{HBANote: "only superusers may read pg_hba_file_rules", Roles: []ReplicationRole{{Name: "baton_relay"}}}
	r.Evaluate()
	require.Empty(t, r.Warnings)
}
