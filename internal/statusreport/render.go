package statusreport

import (
	"encoding/json"
	"fmt"
	"io"
	"math"
	"strconv"
	"text/tabwriter"
	"time"
)

// WriteJSON writes r as indented JSON (see the package doc for the field conventions).
func WriteJSON(w io.Writer, r *Report) error {
	enc := json.NewEncoder(w)
	enc.SetIndent("", "  ")
	return enc.Encode(r)
}

// WriteJSONError writes the JSON object of a report that could not be made: generated_at, ok
// (false) and error, the reason (connection strings in it are redacted by the caller's error:
// connect errors never hold a password).
func WriteJSONError(w io.Writer, err error) error {
	enc := json.NewEncoder(w)
	enc.SetIndent("", "  ")
	return enc.Encode(struct {
		GeneratedAt time.Time `json:"generated_at"`
		OK          bool      `json:"ok"`
		Error       string    `json:"error"`
	}{time.Now().UTC(), false, err.Error()})
}

// WriteText writes r as aligned tables, then the attention and warning lists. It returns the
// first write error.
func WriteText(w io.Writer, r *Report) error {
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	var werr error
	p := func(format string, args ...any) {
		if werr == nil {
			_, werr = fmt.Fprintf(tw, format+"\n", args...)
		}
	}

	p("Baton status of database %s at %s", orDash(r.Database), r.GeneratedAt.Format(time.RFC3339))

	s := r.Slot
	p("\nReplication slot")
	p("  slot\t%s", s.Name)
	switch {
	case s.Error != "":
		p("  error\t%s", s.Error)
	case !s.Exists && r.Shards != nil:
		p("  exists\tno (sharded: the shard relays' slots are below)")
	case !s.Exists:
		p("  exists\tno")
	default:
		active := "no (no relay is streaming)"
		if s.Active {
			active = "yes"
			if s.ActivePID != nil {
				active += " (pid " + strconv.Itoa(*s.ActivePID) + ")"
			}
		}
		p("  active\t%s", active)
		p("  wal_status\t%s", orDash(s.WALStatus))
		p("  retained WAL\t%s (restart_lsn %s)", fmtBytesPtr(s.RetainedWALBytes), orDash(s.RestartLSN))
		p("  confirmed LSN\t%s", orDash(s.ConfirmedLSN))
		p("  lag\t%s (current %s)", fmtBytesPtr(s.LagBytes), orDash(s.CurrentLSN))
		if s.SafeWALSizeBytes != nil {
			p("  safe WAL size\t%s (before the slot is lost)", fmtBytes(*s.SafeWALSizeBytes))
		}
	}

	writeShards(p, r.Shards)

	o := r.Outbox
	p("\nOutbox")
	if o.Error != "" {
		p("  error\t%s", o.Error)
	} else {
		pending := strconv.FormatInt(o.ByStatus.Pending, 10)
		if o.OldestPendingAgeSeconds != nil {
			pending += " (oldest " + fmtSeconds(*o.OldestPendingAgeSeconds) + ")"
		}
		processing := strconv.FormatInt(o.ByStatus.Processing, 10)
		if o.OldestProcessingAgeSeconds != nil {
			processing += " (oldest claim " + fmtSeconds(*o.OldestProcessingAgeSeconds) + ")"
		}
		if o.ExpiredLeases > 0 {
			processing += fmt.Sprintf(", %d leases expired", o.ExpiredLeases)
			if o.ExpiredLeaseAgeSeconds != nil {
				processing += " (oldest " + fmtSeconds(*o.ExpiredLeaseAgeSeconds) + " ago)"
			}
		}
		p("  pending\t%s", pending)
		p("  processing\t%s", processing)
		p("  done\t%d", o.ByStatus.Done)
		p("  error\t%d", o.ByStatus.Error)
	}

	st := r.Streams
	switch {
	case !st.Checked:
		p("\nJetStream\tnot checked: %s", st.Note)
	case st.Error != "":
		p("\nJetStream\t%s", st.URL)
		p("  error\t%s", st.Error)
	default:
		p("\nJetStream\t%s", st.URL)
		p("  STREAM\tMESSAGES\tBYTES\tFIRST SEQ\tLAST SEQ\tLAST MESSAGE")
		for _, s := range []*Stream{st.Turns, st.Outcomes} {
			switch {
			case s == nil:
			case s.Error != "":
				p("  %s\terror: %s", s.Name, s.Error)
			case !s.Exists:
				p("  %s\tdoes not exist", s.Name)
			default:
				last := "-"
				if s.LastTime != nil {
					last = fmtAge(r.GeneratedAt.Sub(*s.LastTime)) + " ago"
				}
				p("  %s\t%d\t%s\t%d\t%d\t%s", s.Name, s.Messages, fmtUBytes(s.Bytes), s.FirstSeq, s.LastSeq, last)
			}
		}
		writeStreamClusters(p, st)
		if c := st.Consumer; c != nil {
			p("")
			p("  CONSUMER\tSTREAM\tPENDING\tACK PENDING\tREDELIVERED\tWAITING")
			switch {
			case c.Error != "":
				p("  %s\t%s\terror: %s", c.Name, c.Stream, c.Error)
			case !c.Exists:
				p("  %s\t%s\tdoes not exist", c.Name, c.Stream)
			default:
				p("  %s\t%s\t%d\t%d\t%d\t%d", c.Name, c.Stream, c.NumPending, c.NumAckPending, c.NumRedelivered, c.NumWaiting)
			}
		}
	}

	sc := r.Schema
	p("\nSchema")
	if sc.Error != "" {
		p("  error\t%s", sc.Error)
	} else {
		p("  version\t%d (this binary: %d)", sc.Version, sc.BinaryVersion)
	}

	writeReplicationAccess(p, r.ReplicationAccess)

	p("")
	if len(r.Attention) > 0 {
		p("attention:")
		for _, a := range r.Attention {
			p("  - %s", a)
		}
	}
	if len(r.Warnings) > 0 {
		p("warnings:")
		for _, a := range r.Warnings {
			p("  - %s", a)
		}
	}
	if r.OK {
		p("ok: nothing needs attention")
	}
	if werr != nil {
		return werr
	}
	return tw.Flush()
}

// writeShards writes the shards section: one line per shard slot. Nothing without shards.
func writeShards(p func(string, ...any), sh *Shards) {
	if sh == nil {
		return
	}
	p("\nShards\t%d (publications %s_0 … %s_%d)", sh.Count, sh.Publication, sh.Publication, sh.Count-1)
	if sh.Error != "" {
		p("  error\t%s", sh.Error)
	}
	for _, name := range sh.Missing {
		p("  missing publication\t%s", name)
	}
	p("  SHARD\tSLOT\tACTIVE\tWAL STATUS\tCONFIRMED LSN\tLAG\tRETAINED WAL")
	line := func(shard string, s Slot) {
		switch {
		case s.Error != "":
			p("  %s\t%s\terror: %s\t-\t-\t-\t-", shard, s.Name, s.Error)
		case !s.Exists:
			p("  %s\t%s\tdoes not exist\t-\t-\t-\t-", shard, s.Name)
		default:
			active := "no"
			if s.Active {
				active = "yes"
				if s.ActivePID != nil {
					active += " (pid " + strconv.Itoa(*s.ActivePID) + ")"
				}
			}
			p("  %s\t%s\t%s\t%s\t%s\t%s\t%s", shard, s.Name, active, orDash(s.WALStatus), orDash(s.ConfirmedLSN),
				fmtBytesPtr(s.LagBytes), fmtBytesPtr(s.RetainedWALBytes))
		}
	}
	for k, s := range sh.Slots {
		line(strconv.Itoa(k)+"/"+strconv.Itoa(sh.Count), s)
	}
	for _, s := range sh.Stray {
		line("stray", s)
	}
}

// writeReplicationAccess writes the relay roles' physical replication access and, when
// pg_hba.conf could not be read, the line to add and the check to run as a superuser.
// Nothing when no relay role has REPLICATION (a relay logged in as a superuser).
func writeReplicationAccess(p func(string, ...any), a ReplicationAccess) {
	if a.Error == "" && len(a.Roles) == 0 {
		return
	}
	p("\nReplication access\t(pg_basebackup as a REPLICATION role copies every database and every role's password verifier)")
	if a.Error != "" {
		p("  error\t%s", a.Error)
		return
	}
	for _, role := range a.Roles {
		switch {
		case role.PhysicalRefused == nil:
			p("  %s\tREPLICATION; pg_hba.conf not checked: %s", role.Name, a.HBANote)
		case *role.PhysicalRefused && role.HBALine != nil:
			p("  %s\tphysical replication refused (pg_hba.conf line %d)", role.Name, *role.HBALine)
		case *role.PhysicalRefused:
			p("  %s\tphysical replication refused (no pg_hba.conf line lets it in)", role.Name)
		default:
			p("  %s\tphysical replication ALLOWED by pg_hba.conf line %d: put `%s` before it, then SELECT pg_reload_conf()", role.Name, *role.HBALine, RejectLine(role.Name))
		}
	}
	if !a.HBAChecked {
		for _, role := range a.Roles {
			p("  advice\tput `%s` before pg_hba.conf's other lines, then SELECT pg_reload_conf(); the relay's logical replication connections match the database lines and keep working", RejectLine(role.Name))
		}
		p("  check as a superuser\t%s (the first line naming the role, or all, must be its reject line)", HBACheckSQL)
	}
}

func orDash(s string) string {
	if s == "" {
		return "-"
	}
	return s
}

// fmtBytes formats a size in binary units: "512 B", "1.5 KiB", "3.0 GiB".
func fmtBytes(n int64) string {
	const unit = 1024
	if n < unit && n > -unit {
		return strconv.FormatInt(n, 10) + " B"
	}
	f, i := float64(n), 0
	for ; (f >= unit || f <= -unit) && i < 5; i++ {
		f /= unit
	}
	return fmt.Sprintf("%.1f %ciB", f, "KMGTPE"[i-1])
}

// fmtUBytes is fmtBytes for JetStream's unsigned sizes. A size above math.MaxInt64 (8 EiB),
// which no stream reaches, shows as math.MaxInt64.
func fmtUBytes(n uint64) string {
	if n > math.MaxInt64 {
		n = math.MaxInt64
	}
	return fmtBytes(int64(n))
}

func fmtBytesPtr(n *int64) string {
	if n == nil {
		return "-"
	}
	return fmtBytes(*n)
}

func fmtSeconds(s float64) string { return fmtAge(secs(s)) }

// fmtAge rounds a duration for reading: milliseconds under a second, seconds under an hour,
// minutes beyond.
func fmtAge(d time.Duration) string {
	switch {
	case d < 0:
		return "0s"
	case d < time.Second:
		return d.Round(time.Millisecond).String()
	case d < time.Hour:
		return d.Round(time.Second).String()
	default:
		return d.Round(time.Minute).String()
	}
}
