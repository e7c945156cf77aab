package main

import (
	"context"
	"fmt"
	"io"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/batonhq/baton/internal/config"
	"github.com/batonhq/baton/internal/statusreport"
)

const statusSummary = "show the slot, outbox, streams and schema; exit 1 when something needs attention"

func runStatus(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	fs := newFlagSet("status", `Status reports what an operator needs to know about a running Baton: the relay's replication
slot (active, wal_status, retained WAL, confirmed LSN and lag), outbox rows by status with
the age of the oldest pending row and the oldest claim, the turns and outcomes streams (with
each one's replica count, leader and other replicas) and the workers' durable consumer
(skipped without a NATS URL), and the schema version.

It prints the report, then an "attention:" list, and exits 1 when that list is not empty (0
when it is, 3 when it could not check: the database could not be reached; with --json it then
prints {"generated_at", "ok": false, "error"}): the
slot is missing or lost, the oldest pending request is older than --stale-after, a lease
expired longer ago than that with no worker recovering it, NATS or a stream is missing, a
stream has no leader (no quorum of its replicas), or a part could not be read. An inactive slot (no relay streaming) is a warning only: pending work
going stale is what pages.

--json prints the same report as JSON with stable field names: generated_at, database,
stale_after_seconds, ok, attention, warnings, slot {name, exists, active, active_pid, wal_status, restart_lsn, confirmed_lsn, current_lsn,
retained_wal_bytes, lag_bytes, safe_wal_size_bytes}, outbox {by_status {pending, processing,
done, error}, oldest_pending_at, oldest_pending_age_seconds, oldest_processing_at,
oldest_processing_age_seconds, expired_leases, expired_lease_age_seconds}, streams {checked,
note, url, turns and outcomes {name, exists, messages, bytes, first_seq, last_seq, last_time,
cluster {replicas, cluster, leader, peers [{name, current, offline, active_seconds, lag}]}},
consumer {name, stream, exists, num_pending, num_ack_pending, num_redelivered, num_waiting}},
schema {version, binary_version}, shards (null without shard publications) {publication,
count, missing, slots and stray: [slot objects as above]}, replication_access {roles [{name,
physical_refused, hba_line}], hba_checked, hba_note}. Sizes are bytes, ages seconds; a
section that could not be read has an "error" field.

Replication access: a role with REPLICATION that pg_hba.conf lets in over a physical
replication connection can copy the whole cluster with pg_basebackup, every database and every
role's password verifier; the relay needs logical replication connections only. For the
relay's roles (baton_relay, and the role streaming from each slot) the report says whether
pg_hba.conf refuses them, with the line that decides, and warns when a line lets one in. Only
superusers may read pg_hba_file_rules: run as another role, it prints the line to add
("host replication baton_relay all reject", before the others) and the query to check it with
as a superuser.

Sharded relays (baton migrate --shards N): the shard publications <BATON_PUBLICATION>_K are
found by name, and each shard's slot <BATON_SLOT>_K is shown and judged like the main slot
(missing or lost: attention; inactive or retaining much WAL: warning); the main slot may then
be missing. A missing shard publication needs attention; a slot <BATON_SLOT>_K of a shard
past N is a warning (it holds WAL).`, stderr)
	asJSON := fs.Bool("json", false, "print the report as JSON")
	staleAfter := fs.Duration("stale-after", statusreport.DefaultStaleAfter, "a pending request older than this needs attention")
	durable := fs.String("durable", statusreport.DefaultDurable, "the workers' durable consumer on the turns stream")
	timeout := fs.Duration("timeout", 30*time.Second, "how long reading the report may take")
	cfg, log, err := configure(fs, args, stderr, config.EnvDatabaseURL, config.EnvNATSURL,
		config.EnvSubjectPrefix, config.EnvSlot, config.EnvSchema, config.EnvPublication)
	if err != nil {
		return err
	}
	if err := cfg.Require(config.EnvDatabaseURL); err != nil {
		return err
	}
	if *staleAfter <= 0 {
		return usageError{msg: "--stale-after must be positive"}
	}
	log.Debug("configuration", "config", cfg)

	ctx, cancel := context.WithTimeout(ctx, *timeout)
	defer cancel()
	conn, err := connect(ctx, cfg)
	if err != nil {
		if *asJSON {
			// Monitors parse stdout: they get an object saying so, not nothing.
			if werr := statusreport.WriteJSONError(stdout, err); werr != nil {
				return fmt.Errorf("write report: %w", werr)
			}
		}
		return couldNotCheck{err: err}
	}
	defer func() { _ = conn.Close(context.WithoutCancel(ctx)) }()

	opts := statusreport.Options{Slot: cfg.Slot, SubjectPrefix: cfg.SubjectPrefix, Durable: *durable, StaleAfter: *staleAfter,
		Schema: cfg.Schema, Publication: cfg.Publication}
	rep := statusreport.Gather(ctx, conn, opts)
	rep.Streams = gatherStreams(ctx, cfg, opts)
	rep.Evaluate()

	if *asJSON {
		err = statusreport.WriteJSON(stdout, rep)
	} else {
		err = statusreport.WriteText(stdout, rep)
	}
	if err != nil {
		return fmt.Errorf("write report: %w", err)
	}
	if !rep.OK {
		return fmt.Errorf("%d %s attention (see the list above)", len(rep.Attention),
			plural(len(rep.Attention), "thing needs", "things need"))
	}
	return nil
}

// gatherStreams reads the streams section, or says why it was skipped or failed.
func gatherStreams(ctx context.Context, cfg *config.Config, opts statusreport.Options) statusreport.Streams {
	if cfg.NATSURL == "" {
		return statusreport.StreamsSkipped(config.EnvNATSURL + " is not set (pass --nats-url to include the streams)")
	}
	url := config.Redact(cfg.NATSURL)
	nc, err := connectNATS(cfg, "baton-status")
	if err != nil {
		return statusreport.StreamsUnreachable(url, err)
	}
	defer nc.Close()
	js, err := jetstream.New(nc)
	if err != nil {
		return statusreport.StreamsUnreachable(url, err)
	}
	return statusreport.GatherStreams(ctx, js, url, opts)
}

func plural(n int, one, many string) string {
	if n == 1 {
		return one
	}
	return many
}
