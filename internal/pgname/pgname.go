// Package pgname holds the rules for the Postgres names Baton is configured with, so that the
// command line (internal/config) and the libraries (relay) accept exactly the same names.
package pgname

import (
	"fmt"
	"regexp"
	"strings"
)

var (
	// slotRE is what Postgres accepts for a replication slot (ReplicationSlotValidateName):
	// lowercase letters, digits and underscores, at most NAMEDATALEN-1 bytes. A digit may come
	// first.
	slotRE = regexp.MustCompile(`^[a-z0-9_]{1,63}$`)
	// publicationRE is a lowercase SQL identifier that needs no quoting: `baton migrate` writes
	// it into CREATE PUBLICATION and the relay into pgoutput's publication_names.
	publicationRE = regexp.MustCompile(`^[a-z_][a-z0-9_]{0,62}$`)
)

// Slot returns an error, naming the rule, when name is not a valid replication slot name.
func Slot(name string) error {
	if !slotRE.MatchString(name) {
		return fmt.Errorf("must match %s (got %q)", slotRE, name)
	}
	return nil
}

// Publication returns an error, naming the rule, when name is not a valid publication
// name.
func Publication(name string) error {
	if !publicationRE.MatchString(name) {
		return fmt.Errorf("must match %s (got %q)", publicationRE, name)
	}
	return nil
}

// Schema returns an error, naming the rule, when name is not a schema Baton may live in: a
// lowercase SQL identifier that needs no quoting, and not one Postgres reserves (pg_*,
// information_schema).
func Schema(name string) error {
	if !publicationRE.MatchString(name) {
		return fmt.Errorf("must match %s (got %q)", publicationRE, name)
	}
	if strings.HasPrefix(name, "pg_") || name == "information_schema" {
		return fmt.Errorf("%q is reserved by PostgreSQL", name)
	}
	return nil
}
