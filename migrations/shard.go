package migrations

import (
	"context"
	"errors"
	"fmt"
	"io"
	"regexp"
	"strconv"
	"strings"

	"github.com/jackc/pgx/v5"
)

// MaxShards is the largest shard count EnsureShards accepts: each shard is a relay process, a
// walsender and a replication slot, and 256 is far past what one Postgres serves.
const MaxShards = 256

// ErrShards wraps the refusals of EnsureShards and the errors of ParseShard: a shard count or
// name out of bounds, or a change of the shard count while shard slots exist.
var ErrShards = errors.New("shards")

// ShardName returns the name of shard k of a publication or slot named base: base_k
// (baton_0, baton_1, …).
func ShardName(base string, k int) string { return base + "_" + strconv.Itoa(k) }

// ShardPredicate is the SQL condition, on an agent_outbox or messages row, that puts the
// row's conversation in shard k of n:
//
//	(((hashtextextended(conversation_id, 0) & 9223372036854775807) % n) = k)
//
// hashtextextended is immutable and built in (so a publication's row filter may use it), and
// masking off the sign bit keeps the value non-negative without abs(), which raises on the
// smallest bigint: nothing any row holds can make the expression fail inside the walsender.
// Every conversation id matches exactly one k in 0…n−1, so all of a conversation's rows, in
// both tables, travel through one shard, in commit order. It is written with every operation
// in parentheses, as PostgreSQL prints a row filter back (see SameFilter). n and k are
// written as literals: callers pass checked integers (see CheckShard).
func ShardPredicate(n, k int) string {
	return fmt.Sprintf("(((hashtextextended(conversation_id, 0) & 9223372036854775807) %% %d) = %d)", n, k)
}

// ShardFilters returns, by table name, the row filter of shard k of n's publication: the
// outbox by ShardPredicate, and messages as the base publication filters them (no user
// messages) and by ShardPredicate.
func ShardFilters(n, k int) map[string]string {
	return map[string]string{
		"agent_outbox": ShardPredicate(n, k),
		"messages":     "((role <> 'user') AND " + ShardPredicate(n, k) + ")",
	}
}

// SameFilter reports whether rowfilter, a row filter as pg_publication_tables.rowfilter shows
// it, is the filter want as ShardFilters writes it. PostgreSQL prints an expression back with
// casts, quoted constants and parentheses around single values of its own ("(0)::bigint",
// "'9223372036854775807'::bigint"), and with every operation in parentheses, as ShardFilters
// writes it. Both are compared without spaces, those casts, quotes and parentheses around a
// single value: the grouping of the operations is kept, so a filter regrouped by hand is
// another filter.
func SameFilter(rowfilter, want string) bool {
	return normalizeFilter(rowfilter) == normalizeFilter(want)
}

// atomInParens is a single value in parentheses, not a function's argument list.
var atomInParens = regexp.MustCompile(`(^|[^A-Za-z0-9_])\(([A-Za-z0-9_]+)\)`)

func normalizeFilter(s string) string {
	s = strings.ToLower(s)
	for _, cast := range []string{"::bigint", "::integer", "::smallint", "::text"} {
		s = strings.ReplaceAll(s, cast, "")
	}
	s = strings.Map(func(r rune) rune {
		switch r {
		case '\'', '"', ' ', '\t', '\n':
			return -1
		}
		return r
	}, s)
	for {
		t := atomInParens.ReplaceAllString(s, "$1$2")
		if t == s {
			return s
		}
		s = t
	}
}

// ShardOfSQL is the SQL condition that the name in column is <base>_<K>, a shard's name
// (ShardName) with K of 0…999 written without leading zeros, where the parameter $1 is base.
// substr(column, length($1) + 2)::int is then K.
func ShardOfSQL(column string) string {
	return "left(" + column + ", length($1) + 1) = $1 || '_' AND substr(" + column + ", length($1) + 2) ~ '^(0|[1-9][0-9]{0,2})$'"
}

// CheckShard returns an error (ErrShards) unless 0 ≤ k < n ≤ MaxShards.
func CheckShard(k, n int) error {
	if n < 1 || n > MaxShards {
		return fmt.Errorf("%w: shard count %d is out of 1…%d", ErrShards, n, MaxShards)
	}
	if k < 0 || k >= n {
		return fmt.Errorf("%w: shard %d is out of 0…%d", ErrShards, k, n-1)
	}
	return nil
}

// ParseShard reads a shard as `baton relay --shard` takes it: "K/N", shard K of N.
func ParseShard(s string) (k, n int, err error) {
	ks, ns, ok := strings.Cut(strings.TrimSpace(s), "/")
	k, kerr := strconv.Atoi(ks)
	n, nerr := strconv.Atoi(ns)
	if !ok || kerr != nil || nerr != nil {
		return 0, 0, fmt.Errorf("%w: %q is not K/N (shard K of N, e.g. 0/2)", ErrShards, s)
	}
	if err := CheckShard(k, n); err != nil {
		return 0, 0, err
	}
	return k, n, nil
}

// ShardOptions names what EnsureShards creates and checks.
type ShardOptions struct {
	Options
	// Slot is the relay's slot name (BATON_SLOT): shard K's relay streams from slot Slot_K.
	// EnsureShards changes no shard publication while a slot Slot_<K> exists. Default "baton".
	Slot string
}

// check checks the shard count and that every shard's publication name stays a valid identifier.
func (o ShardOptions) check(n int) error {
	if err := CheckShard(0, n); err != nil {
		return err
	}
	if last := ShardName(o.Publication, n-1); len(last) > 63 {
		return fmt.Errorf("%w: publication name %q is longer than 63 bytes; choose a shorter BATON_PUBLICATION", ErrShards, last)
	}
	if last := ShardName(o.Slot, n-1); len(last) > 63 {
		return fmt.Errorf("%w: slot name %q is longer than 63 bytes; choose a shorter BATON_SLOT", ErrShards, last)
	}
	return nil
}

func (o ShardOptions) withDefaults() ShardOptions {
	o.Options = o.Options.withDefaults()
	if o.Slot == "" {
		o.Slot = "baton"
	}
	return o
}

// shardSQL returns the statement that makes publication name shard k of n: CREATE, or ALTER …
// SET TABLE for one that exists with other filters.
func (o ShardOptions) shardSQL(n, k int, exists bool) string {
	f := ShardFilters(n, k)
	tables := pgx.Identifier{o.Schema, "agent_outbox"}.Sanitize() + " WHERE (" + f["agent_outbox"] + "), " +
		pgx.Identifier{o.Schema, "messages"}.Sanitize() + " WHERE (" + f["messages"] + ")"
	name := pgx.Identifier{ShardName(o.Publication, k)}.Sanitize()
	if exists {
		return "ALTER PUBLICATION " + name + " SET TABLE " + tables
	}
	return "CREATE PUBLICATION " + name + " FOR TABLE " + tables + " WITH (publish = 'insert')"
}

// PrintShards writes the statements that create the n shard publications, for tools that
// apply SQL themselves (baton migrate --print --shards N). Applied by hand, they create; they
// do not compare with shard publications that exist (EnsureShards does).
func PrintShards(w io.Writer, o ShardOptions, n int) error {
	o = o.withDefaults()
	if err := o.check(n); err != nil {
		return err
	}
	if _, err := fmt.Fprintf(w, "\n-- Shard publications %s to %s: one per relay (baton relay --shard K/%d).\nBEGIN;\n",
		ShardName(o.Publication, 0), ShardName(o.Publication, n-1), n); err != nil {
		return err
	}
	for k := range n {
		if _, err := fmt.Fprintf(w, "%s;\n", o.shardSQL(n, k, false)); err != nil {
			return err
		}
	}
	_, err := fmt.Fprint(w, "COMMIT;\n")
	return err
}

// ShardResult says what EnsureShards did.
type ShardResult struct {
	// Created, Altered and Dropped are the shard publications it created, redefined for the
	// new shard count, and dropped (shards K ≥ N of an earlier, larger count). All empty when
	// the n shard publications were already there, as asked.
	Created, Altered, Dropped []string
}

// Changed reports whether EnsureShards changed anything.
func (r ShardResult) Changed() bool { return len(r.Created)+len(r.Altered)+len(r.Dropped) > 0 }

// EnsureShards makes publications <Publication>_0 … <Publication>_<n−1> exist, each
// publishing the inserts of agent_outbox and of the published messages (role <> 'user') whose
// conversation is in that shard (ShardPredicate). It runs after UpWith: the tables must exist.
//
// It is idempotent: with the same n it checks the row filters and changes nothing. With
// another n than the shard publications have, it redefines them (ALTER PUBLICATION … SET TABLE),
// creates the missing ones and drops those past n−1, all in one transaction — but only while
// no replication slot <Slot>_<K> of this database exists: a slot still streaming a shard would
// publish by the new filter from its old position and skip or repeat conversations. Resharding
// therefore drains first (README, "Sharded relays"): stop the shard relays once caught up,
// drop their slots, run EnsureShards with the new n, start the new shard relays, whose
// first-start backfill publishes every unfinished row once more (deduplicated by Nats-Msg-Id
// and by the workers' outbox ids). It refuses with ErrShards otherwise.
//
// The transaction locks the migrations table as Up does, so it is safe beside concurrent Up
// and EnsureShards calls.
func EnsureShards(ctx context.Context, db Beginner, o ShardOptions, n int) (ShardResult, error) {
	o = o.withDefaults()
	var res ShardResult
	if err := o.check(n); err != nil {
		return res, err
	}
	tx, err := db.Begin(ctx)
	if err != nil {
		return res, fmt.Errorf("shards: begin: %w", err)
	}
	defer func() { _ = tx.Rollback(ctx) }()
	if _, err := tx.Exec(ctx, lockStatement(o.Options)); err != nil {
		return res, fmt.Errorf("shards: lock %s against other migrators (run baton migrate first): %w", Table, err)
	}
	// Every publication named <publication>_<digits>, with its tables (of any schema) and
	// their row filters.
	rows, err := tx.Query(ctx, `SELECT p.pubname::text, substr(p.pubname, length($1) + 2)::int,
			coalesce(t.schemaname::text, ''), coalesce(t.tablename::text, ''), coalesce(t.rowfilter, '')
		FROM pg_publication p
		LEFT JOIN pg_publication_tables t ON t.pubname = p.pubname
		WHERE `+ShardOfSQL("p.pubname"),
		o.Publication)
	if err != nil {
		return res, fmt.Errorf("shards: read publications: %w", err)
	}
	type pub struct {
		name    string
		filters map[string]string // this schema's agent_outbox and messages
		others  []string          // any other table: not a shard publication of this installation
	}
	have := map[int]*pub{}
	for rows.Next() {
		var name, schema, table, filter string
		var k int
		if err := rows.Scan(&name, &k, &schema, &table, &filter); err != nil {
			rows.Close()
			return res, fmt.Errorf("shards: read publications: %w", err)
		}
		p := have[k]
		if p == nil {
			p = &pub{name: name, filters: map[string]string{}}
			have[k] = p
		}
		switch {
		case table == "":
		case schema == o.Schema && (table == "agent_outbox" || table == "messages"):
			p.filters[table] = filter
		default:
			p.others = append(p.others, schema+"."+table)
		}
	}
	if err := rows.Err(); err != nil {
		return res, fmt.Errorf("shards: read publications: %w", err)
	}
	// A publication of that name that publishes other tables, or none, is not one this
	// installation made (another schema's installation may be named so): never altered or
	// dropped. In the way of a shard, it is refused.
	for k, p := range have {
		if len(p.others) == 0 && len(p.filters) > 0 {
			continue
		}
		delete(have, k)
		if k < n {
			what := "no table"
			if len(p.others) > 0 {
				what = strings.Join(p.others, ", ")
			}
			return ShardResult{}, fmt.Errorf("%w: publication %s exists and publishes %s, not only %s's agent_outbox and "+
				"messages: it is not a shard publication of this installation; choose another BATON_PUBLICATION or drop it",
				ErrShards, p.name, what, o.Schema)
		}
	}
	matches := func(p *pub, k int) bool {
		want := ShardFilters(n, k)
		if len(p.filters) != len(want) {
			return false
		}
		for table, f := range want {
			if got, ok := p.filters[table]; !ok || !SameFilter(got, f) {
				return false
			}
		}
		return true
	}
	var stmts []string
	for k := range n {
		p, ok := have[k]
		switch {
		case !ok:
			res.Created = append(res.Created, ShardName(o.Publication, k))
			stmts = append(stmts, o.shardSQL(n, k, false))
		case !matches(p, k):
			res.Altered = append(res.Altered, p.name)
			stmts = append(stmts, o.shardSQL(n, k, true))
		}
	}
	for k, p := range have {
		if k >= n {
			res.Dropped = append(res.Dropped, p.name)
			stmts = append(stmts, "DROP PUBLICATION "+pgx.Identifier{p.name}.Sanitize())
		}
	}
	if len(stmts) == 0 {
		return res, nil
	}
	if len(have) > 0 { // a change of shards that exist: only with no shard slot left
		var slots []string
		rows, err := tx.Query(ctx, `SELECT slot_name::text FROM pg_replication_slots
			WHERE database = current_database() AND `+ShardOfSQL("slot_name")+` ORDER BY slot_name`, o.Slot)
		if err != nil {
			return res, fmt.Errorf("shards: read slots: %w", err)
		}
		if slots, err = pgx.CollectRows(rows, pgx.RowTo[string]); err != nil {
			return res, fmt.Errorf("shards: read slots: %w", err)
		}
		if len(slots) > 0 {
			return ShardResult{}, fmt.Errorf("%w: the shard publications of %s are not those of %d shards, and shard slots %s exist: "+
				"a relay streaming from them would skip or repeat conversations under new filters. To reshard, stop every "+
				"shard relay once caught up, drop the slots (SELECT pg_drop_replication_slot('%s')), migrate again, then "+
				"start the new shard relays (README, \"Resharding\")",
				ErrShards, o.Publication, n, strings.Join(slots, ", "), slots[0])
		}
	}
	for _, s := range stmts {
		if _, err := tx.Exec(ctx, s); err != nil {
			return ShardResult{}, fmt.Errorf("shards: %s: %w", s, err)
		}
	}
	if err := tx.Commit(ctx); err != nil {
		return ShardResult{}, fmt.Errorf("shards: commit: %w", err)
	}
	return res, nil
}
