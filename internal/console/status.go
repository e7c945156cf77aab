package console

import (
	"context"
	"errors"
	"net/http"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/batonhq/baton/internal/statusreport"
	"github.com/batonhq/baton/wire"
)

// The system view's chart: the last chartWindow in buckets of chartBucket.
const (
	chartWindow = 5 * time.Minute
	chartBucket = 10 * time.Second
)

// Status is what GET /api/status answers: the report of `baton status --json`, its fields at the
// top level, plus the console's own section.
type Status struct {
	*statusreport.Report
	Console Extra `json:"console"`
}

// Extra is what the system view shows beyond `baton status`: GET /api/status's "console".
type Extra struct {
	// RelayState is "active" when a relay streams from the slot, "standby" when the slot exists
	// with none streaming, "missing" without the slot.
	RelayState string `json:"relay_state"`
	// DeadLetters is the dead-letter stream's message count; nil when it could not be read
	// (DeadLetterError says why) or NATS is not configured.
	DeadLetters     *uint64 `json:"dead_letters"`
	DeadLetterError string  `json:"dead_letter_error,omitempty"`
	// Workers are the workers that started a run in the last hour.
	Workers     []Worker `json:"workers"`
	WorkerError string   `json:"worker_error,omitempty"`
	// TurnsPerSecond is the rate of turns ended (runs done or error) over the last minute.
	TurnsPerSecond float64 `json:"turns_per_second"`
	// Series is the last minutes, bucketed: turns ended per second and the median latency
	// from a message sent to the end of the run that answered it.
	Series        []SeriesPoint `json:"series"`
	SeriesError   string        `json:"series_error,omitempty"`
	BucketSeconds float64       `json:"bucket_seconds"`
}

// handleStatus answers the status; its request's context ends after RequestTimeout (bounded),
// and what could not be read by then is reported in the status's fields.
func (s *Server) handleStatus(w http.ResponseWriter, r *http.Request) {
	writeJSON(w, http.StatusOK, s.status(r.Context()))
}

func (s *Server) status(ctx context.Context) Status {
	opts := statusreport.Options{Slot: s.cfg.Slot, SubjectPrefix: s.cfg.SubjectPrefix, Durable: s.cfg.Durable,
		Schema: s.cfg.Schema, Publication: s.cfg.Publication}
	rep := statusreport.Gather(ctx, s.cfg.Pool, opts)
	st := Status{Report: rep, Console: Extra{Workers: []Worker{}, Series: []SeriesPoint{}, BucketSeconds: chartBucket.Seconds()}}
	if s.cfg.NATS == nil {
		rep.Streams = statusreport.StreamsSkipped("the console has no NATS URL")
		st.Console.DeadLetterError = "the console has no NATS URL"
	} else if js, err := jetstream.New(s.cfg.NATS); err != nil {
		rep.Streams = statusreport.StreamsUnreachable(s.cfg.NATSURL, err)
		st.Console.DeadLetterError = err.Error()
	} else {
		rep.Streams = statusreport.GatherStreams(ctx, js, s.cfg.NATSURL, opts)
		st.Console.DeadLetters, st.Console.DeadLetterError = deadLetters(ctx, js, s.cfg.SubjectPrefix)
	}
	s.hideDatabaseErrors(rep)
	rep.Evaluate()
	switch {
	case !rep.Slot.Exists:
		st.Console.RelayState = "missing"
	case rep.Slot.Active:
		st.Console.RelayState = "active"
	default:
		st.Console.RelayState = "standby"
	}
	if ws, err := readWorkers(ctx, s.cfg.Pool); err != nil {
		st.Console.WorkerError = s.hidden("workers", err.Error())
	} else if ws != nil {
		st.Console.Workers = ws
	}
	series, err := readSeries(ctx, s.cfg.Pool, chartWindow, chartBucket)
	if err != nil {
		st.Console.SeriesError = s.hidden("series", err.Error())
	} else if series != nil {
		st.Console.Series = series
	}
	st.Console.TurnsPerSecond = lastMinuteRate(series, rep.GeneratedAt, chartBucket)
	return st
}

// hideDatabaseErrors replaces what Postgres said in the report with a pointer to the
// console's log, where it goes: a refusal names tables and the console role's privileges, and
// other errors may quote values. The API answers as the message view does; `baton status`, run
// by an operator, shows the errors themselves.
func (s *Server) hideDatabaseErrors(rep *statusreport.Report) {
	rep.Slot.Error = s.hidden("slot", rep.Slot.Error)
	rep.Outbox.Error = s.hidden("outbox", rep.Outbox.Error)
	rep.Schema.Error = s.hidden("schema", rep.Schema.Error)
	rep.ReplicationAccess.Error = s.hidden("replication access", rep.ReplicationAccess.Error)
	if sh := rep.Shards; sh != nil {
		sh.Error = s.hidden("shards", sh.Error)
		for i := range sh.Slots {
			sh.Slots[i].Error = s.hidden("shard slot", sh.Slots[i].Error)
		}
		for i := range sh.Stray {
			sh.Stray[i].Error = s.hidden("stray slot", sh.Stray[i].Error)
		}
	}
}

// hidden logs a database error of the status report's part and returns what the API shows of
// it; "" stays "".
func (s *Server) hidden(part, msg string) string {
	if msg == "" {
		return ""
	}
	s.log.Error("console status: reading the database failed", "part", part, "error", msg)
	return internalError
}

// internalError is what the API shows of an error whose text stays in the console's log.
const internalError = "internal error (see the console's log)"

// lastMinuteRate is the rate over the buckets that started in the minute before now.
func lastMinuteRate(series []SeriesPoint, now time.Time, bucket time.Duration) float64 {
	var total float64
	for _, p := range series {
		if now.Sub(p.At) <= time.Minute {
			total += p.TurnsPerSecond * bucket.Seconds()
		}
	}
	return total / time.Minute.Seconds()
}

// deadLetters reads the dead-letter stream's message count. A missing stream (no relay ever
// set one aside) counts zero.
func deadLetters(ctx context.Context, js jetstream.JetStream, prefix string) (*uint64, string) {
	st, err := js.Stream(ctx, wire.StreamName(prefix, wire.KindDeadLetter))
	if errors.Is(err, jetstream.ErrStreamNotFound) {
		var zero uint64
		return &zero, ""
	}
	if err != nil {
		return nil, err.Error()
	}
	n, err := wire.StreamEvents(ctx, st, prefix, wire.KindDeadLetter) // not the relay's fences
	if err != nil {
		return nil, err.Error()
	}
	return &n, ""
}
