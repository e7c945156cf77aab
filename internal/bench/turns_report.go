package bench

import (
	"fmt"
	"io"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/batonhq/baton/internal/config"
)

// The turns targets the report sets the figures against. They are printed next to the
// figures, never used to decide anything.
const (
	// TurnsTargetPerSecond is the turns/s one worker should reach on the JetStream source.
	TurnsTargetPerSecond = 2800
	// TurnsTargetScaling is the least 4 workers' turns/s over 1 worker's.
	TurnsTargetScaling = 0.95
	// TurnsTargetLatencyRate is the rate at which the p50 target holds, and
	// TurnsTargetLatencyOver what p50 may exceed the debounce window by.
	TurnsTargetLatencyRate = 200
	TurnsTargetLatencyOver = 3 * time.Millisecond
	// TurnsTargetTools is the least turns/s with one read and one write tool per turn, over
	// the zero-tool rate.
	TurnsTargetTools = 0.7
)

// TurnsReport is the result of `baton bench turns`, and its --json output.
type TurnsReport struct {
	// Settings are what ran.
	Settings TurnsSettings `json:"settings"`
	// Throughput has one entry per throughput or tools phase, in the order they ran.
	Throughput []TurnsThroughput `json:"throughput"`
	// Latency has one entry per latency phase, in the order they ran.
	Latency []TurnsLatency `json:"latency"`
	// Ratios compare figures of the same round; each is the median of the per-round ratios.
	Ratios []TurnsRatio `json:"ratios"`
	// Targets set the figures against the turns targets (JetStream source).
	Targets []TurnsTarget `json:"targets"`
	// WallSeconds is how long the whole bench took, servers included.
	WallSeconds float64 `json:"wall_seconds"`
}

// TurnsSettings say what the bench ran.
type TurnsSettings struct {
	Rounds         int      `json:"rounds"`
	Turns          int      `json:"turns"`           // messages per throughput phase
	Rates          []int    `json:"rates"`           // turns/s of the latency phases
	Workers        []int    `json:"workers"`         // worker counts of the throughput phases
	LatencySeconds float64  `json:"latency_seconds"` // how long each latency phase sends
	Sources        []string `json:"sources"`
	Only           []string `json:"only"` // kinds of phase run
	// Producers send at once, in this process, each on a connection of its own.
	Producers int `json:"producers"`
	// WorkerConns is each worker's pool size; every worker runs in this process with a pool
	// and a NATS connection of its own, as a worker process would.
	WorkerConns        int     `json:"worker_conns"`
	MaxConcurrentTurns int     `json:"max_concurrent_turns"`
	DebounceMS         float64 `json:"debounce_ms"`
	PollIntervalMS     float64 `json:"poll_interval_ms"`
	Postgres           string  `json:"postgres"` // the server, password masked, or the throwaway cluster
	NATS               string  `json:"nats"`
	Relay              string  `json:"relay"`             // the relay's command line: a process of its own
	Profile            string  `json:"profile,omitempty"` // the CPU profile written, if any
}

// TurnsFigure is one figure over the rounds: the median, and each round's value in round order.
type TurnsFigure struct {
	Median float64   `json:"median"`
	Rounds []float64 `json:"rounds"`
}

// TurnsThroughput is a throughput phase (tools false) or a tools phase (tools true): Settings.Turns
// messages, each to a conversation of its own, sent as fast as the producers go.
type TurnsThroughput struct {
	Source  string `json:"source"`
	Workers int    `json:"workers"`
	Tools   bool   `json:"tools"` // the handler called one read and one write tool per turn
	// Complete is true when, in every round, every message sent got its reply.
	Complete bool        `json:"complete"`
	Sent     TurnsFigure `json:"sent"`
	Done     TurnsFigure `json:"done"`   // outbox rows done (replied)
	Failed   TurnsFigure `json:"failed"` // outbox rows that ended as visible errors
	// Seconds runs from the first producer commit to the last reply commit, both by the
	// database's clock (the outbox row's created_at, the run's finished_at).
	Seconds        TurnsFigure `json:"seconds"`
	TurnsPerSecond TurnsFigure `json:"turns_per_second"` // sent / seconds
	// ClaimBatch and CommitBatch are the mean conversations per claim and per final-commit
	// statement (baton_worker_batch_size), over the measured part.
	ClaimBatch     TurnsFigure `json:"claim_batch"`
	CommitBatch    TurnsFigure `json:"commit_batch"`
	ClaimConflicts TurnsFigure `json:"claim_conflicts"` // baton_worker_claim_conflicts_total
	EventsNacked   TurnsFigure `json:"events_nacked"`   // baton_worker_events_total{result="nacked"}
	// ProcessCPUCores is the CPU time of the bench process (workers, producers and, when
	// embedded, the NATS server; not the relay or PostgreSQL) over Seconds: the cores it kept busy.
	ProcessCPUCores TurnsFigure `json:"process_cpu_cores"`
}

// TurnsLatency is a latency phase: Rate messages per second for Settings.LatencySeconds,
// round robin over Conversations conversations, to Workers workers.
type TurnsLatency struct {
	Source        string      `json:"source"`
	Workers       int         `json:"workers"`
	Rate          int         `json:"rate"`
	Conversations int         `json:"conversations"`
	Complete      bool        `json:"complete"`
	Sent          TurnsFigure `json:"sent"`
	Done          TurnsFigure `json:"done"`
	Failed        TurnsFigure `json:"failed"`
	AchievedRate  TurnsFigure `json:"achieved_rate"` // producer commits per second
	// P50MS and P99MS are producer commit (Send returned) → reply commit (the run's
	// finished_at, stamped in its final transaction), in milliseconds, the database's clock
	// brought to this process's by ClockOffsetMS.
	P50MS TurnsFigure `json:"p50_ms"`
	P99MS TurnsFigure `json:"p99_ms"`
	// WaitP50MS and WaitP99MS are outbox row written → run claimed (debounce, the event's way
	// through the relay and JetStream or the poll, the claim); TurnP50MS and TurnP99MS are run
	// claimed → run finished (handler and final commit). Both by the database's clock alone.
	WaitP50MS     TurnsFigure `json:"wait_p50_ms"`
	WaitP99MS     TurnsFigure `json:"wait_p99_ms"`
	TurnP50MS     TurnsFigure `json:"turn_p50_ms"`
	TurnP99MS     TurnsFigure `json:"turn_p99_ms"`
	ClockOffsetMS TurnsFigure `json:"clock_offset_ms"` // database clock − this process's, estimated
}

// TurnsRatio is a ratio of two figures of the same round, as the median over the rounds.
type TurnsRatio struct {
	Name  string      `json:"name"`
	Value TurnsFigure `json:"value"`
}

// TurnsTarget is one of the turns targets and the figure it applies to.
type TurnsTarget struct {
	Name  string   `json:"name"`
	Want  string   `json:"want"`  // the target, as text: ">= 2800 turns/s"
	Value *float64 `json:"value"` // the figure's median, in the unit of Want; null when not measured
	Met   *bool    `json:"met"`   // null when not measured; false when not complete
	// Complete is false when a phase the figure comes from did not complete in every round
	// (see TurnsThroughput.Complete): the target is then not met.
	Complete bool `json:"complete"`
}

// Complete reports whether every message of every phase got its reply.
func (r *TurnsReport) Complete() bool {
	for _, t := range r.Throughput {
		if !t.Complete {
			return false
		}
	}
	for _, l := range r.Latency {
		if !l.Complete {
			return false
		}
	}
	return true
}

// report builds the report from results[round][phase index].
func (b *Turns) report(env *turnsEnv, results [][]turnsResult, wall time.Duration) *TurnsReport {
	rep := &TurnsReport{
		Settings: TurnsSettings{
			Rounds:             b.cfg.Rounds,
			Turns:              b.cfg.Turns,
			Rates:              b.cfg.Rates,
			Workers:            b.cfg.Workers,
			LatencySeconds:     b.cfg.LatencyDuration.Seconds(),
			Sources:            b.cfg.Sources,
			Only:               b.cfg.Only,
			Producers:          turnsProducers,
			WorkerConns:        turnsWorkerConns,
			MaxConcurrentTurns: config.DefaultWorkerMaxConcurrentTurns,
			DebounceMS:         ms(config.DefaultWorkerDebounce),
			PollIntervalMS:     ms(config.DefaultWorkerPollInterval),
			Postgres:           env.postgres,
			NATS:               env.nats,
			Relay:              strings.Join(b.cfg.RelayCommand, " "),
		},
		WallSeconds: wall.Seconds(),
	}
	if b.cfg.ProfileDir != "" {
		rep.Settings.Profile = filepath.Join(b.cfg.ProfileDir, turnsProfileFile)
	}
	// fig collects one value of phase i over the rounds.
	fig := func(i int, v func(turnsResult) float64) TurnsFigure {
		vals := make([]float64, len(results))
		for round := range results {
			vals[round] = v(results[round][i])
		}
		return turnsFigure(vals)
	}
	complete := func(i int) bool { return turnsComplete(results, i) }
	ms := func(d func(turnsResult) time.Duration) func(turnsResult) float64 {
		return func(r turnsResult) float64 { return ms(d(r)) }
	}
	for i, ph := range b.phases {
		sent := fig(i, func(r turnsResult) float64 { return float64(r.sent) })
		done := fig(i, func(r turnsResult) float64 { return float64(r.done) })
		failed := fig(i, func(r turnsResult) float64 { return float64(r.failed) })
		if ph.kind == TurnsKindLatency {
			rep.Latency = append(rep.Latency, TurnsLatency{
				Source: ph.source, Workers: ph.workers, Rate: ph.rate, Conversations: b.conversations(ph),
				Complete: complete(i), Sent: sent, Done: done, Failed: failed,
				AchievedRate:  fig(i, func(r turnsResult) float64 { return r.achievedRate }),
				P50MS:         fig(i, ms(func(r turnsResult) time.Duration { return r.p50 })),
				P99MS:         fig(i, ms(func(r turnsResult) time.Duration { return r.p99 })),
				WaitP50MS:     fig(i, ms(func(r turnsResult) time.Duration { return r.waitP50 })),
				WaitP99MS:     fig(i, ms(func(r turnsResult) time.Duration { return r.waitP99 })),
				TurnP50MS:     fig(i, ms(func(r turnsResult) time.Duration { return r.turnP50 })),
				TurnP99MS:     fig(i, ms(func(r turnsResult) time.Duration { return r.turnP99 })),
				ClockOffsetMS: fig(i, ms(func(r turnsResult) time.Duration { return r.clockOffset })),
			})
			continue
		}
		rep.Throughput = append(rep.Throughput, TurnsThroughput{
			Source: ph.source, Workers: ph.workers, Tools: ph.kind == TurnsKindTools,
			Complete: complete(i), Sent: sent, Done: done, Failed: failed,
			Seconds:         fig(i, func(r turnsResult) float64 { return r.seconds }),
			TurnsPerSecond:  fig(i, func(r turnsResult) float64 { return r.perSecond }),
			ClaimBatch:      fig(i, func(r turnsResult) float64 { return r.claimBatch }),
			CommitBatch:     fig(i, func(r turnsResult) float64 { return r.commitBatch }),
			ClaimConflicts:  fig(i, func(r turnsResult) float64 { return r.conflicts }),
			EventsNacked:    fig(i, func(r turnsResult) float64 { return r.nacked }),
			ProcessCPUCores: fig(i, func(r turnsResult) float64 { return r.cpuCores }),
		})
	}
	b.ratiosAndTargets(rep, results)
	return rep
}

// ratiosAndTargets fills rep's ratios and targets from the per-round results.
func (b *Turns) ratiosAndTargets(rep *TurnsReport, results [][]turnsResult) {
	find := func(want turnsPhase) int {
		return slices.Index(b.phases, want)
	}
	// ratio is num/den of the same round, over the rounds; ok is false when a phase did not run.
	ratio := func(num, den turnsPhase, v func(turnsResult) float64) (TurnsFigure, bool) {
		i, j := find(num), find(den)
		if i < 0 || j < 0 {
			return TurnsFigure{}, false
		}
		vals := make([]float64, len(results))
		for round := range results {
			if d := v(results[round][j]); d != 0 {
				vals[round] = v(results[round][i]) / d
			}
		}
		return turnsFigure(vals), true
	}
	add := func(name string, num, den turnsPhase, v func(turnsResult) float64) {
		if f, ok := ratio(num, den, v); ok {
			rep.Ratios = append(rep.Ratios, TurnsRatio{Name: name, Value: f})
		}
	}
	perSecond := func(r turnsResult) float64 { return r.perSecond }
	p50 := func(r turnsResult) float64 { return ms(r.p50) }
	w0 := b.cfg.Workers[0]
	for _, src := range b.cfg.Sources {
		base := turnsPhase{kind: TurnsKindThroughput, source: src, workers: w0}
		for _, w := range b.cfg.Workers[1:] {
			add(fmt.Sprintf("%s turns/s: %d %s / %d %s", src, w, turnsPlural(w, "worker"), w0, turnsPlural(w0, "worker")),
				turnsPhase{kind: TurnsKindThroughput, source: src, workers: w}, base, perSecond)
		}
		add(fmt.Sprintf("%s turns/s: read+write tools / no tools, %d %s", src, w0, turnsPlural(w0, "worker")),
			turnsPhase{kind: TurnsKindTools, source: src, workers: w0}, base, perSecond)
	}
	for _, w := range b.cfg.Workers {
		add(fmt.Sprintf("turns/s: polling / jetstream, %d %s", w, turnsPlural(w, "worker")),
			turnsPhase{kind: TurnsKindThroughput, source: TurnsSourcePolling, workers: w},
			turnsPhase{kind: TurnsKindThroughput, source: TurnsSourceJetStream, workers: w}, perSecond)
	}
	for _, rate := range b.cfg.Rates {
		add(fmt.Sprintf("p50 latency: polling / jetstream, %d/s", rate),
			turnsPhase{kind: TurnsKindLatency, source: TurnsSourcePolling, workers: w0, rate: rate},
			turnsPhase{kind: TurnsKindLatency, source: TurnsSourceJetStream, workers: w0, rate: rate}, p50)
	}

	// target records a target over the figure f of phases; a phase that did not complete in
	// every round (a message without its reply, or failed) measured nothing the target can
	// count, so the target is then not met, whatever the figure.
	target := func(name, want string, f TurnsFigure, ok, atLeast bool, limit float64, phases ...turnsPhase) {
		t := TurnsTarget{Name: name, Want: want, Complete: true}
		for _, ph := range phases {
			if i := find(ph); i >= 0 && !turnsComplete(results, i) {
				t.Complete = false
			}
		}
		if ok {
			v := f.Median
			met := v >= limit
			if !atLeast {
				met = v <= limit
			}
			met = met && t.Complete
			t.Value, t.Met = &v, &met
		}
		rep.Targets = append(rep.Targets, t)
	}
	one := turnsPhase{kind: TurnsKindThroughput, source: TurnsSourceJetStream, workers: 1}
	if i := find(one); i >= 0 {
		target("turns/s, 1 worker", fmt.Sprintf(">= %d turns/s", TurnsTargetPerSecond),
			turnsFigure(turnsColumn(results, i, perSecond)), true, true, TurnsTargetPerSecond, one)
	} else {
		target("turns/s, 1 worker", fmt.Sprintf(">= %d turns/s", TurnsTargetPerSecond), TurnsFigure{}, false, true, 0)
	}
	four := turnsPhase{kind: TurnsKindThroughput, source: TurnsSourceJetStream, workers: 4}
	f, ok := ratio(four, one, perSecond)
	target("turns/s, 4 workers / 1 worker", fmt.Sprintf(">= %.2f", TurnsTargetScaling), f, ok, true, TurnsTargetScaling, four, one)
	limit := config.DefaultWorkerDebounce + TurnsTargetLatencyOver
	lat := turnsPhase{kind: TurnsKindLatency, source: TurnsSourceJetStream, workers: w0, rate: TurnsTargetLatencyRate}
	want := fmt.Sprintf("<= %s ms (debounce %s + %s)", turnsMS(limit), config.DefaultWorkerDebounce, TurnsTargetLatencyOver)
	if i := find(lat); i >= 0 {
		target(fmt.Sprintf("p50 producer commit → reply commit at %d/s", TurnsTargetLatencyRate), want,
			turnsFigure(turnsColumn(results, i, p50)), true, false, ms(limit), lat)
	} else {
		target(fmt.Sprintf("p50 producer commit → reply commit at %d/s", TurnsTargetLatencyRate), want, TurnsFigure{}, false, false, 0)
	}
	tools, plain := turnsPhase{kind: TurnsKindTools, source: TurnsSourceJetStream, workers: w0}, turnsPhase{kind: TurnsKindThroughput, source: TurnsSourceJetStream, workers: w0}
	f, ok = ratio(tools, plain, perSecond)
	target(fmt.Sprintf("turns/s, read+write tools / no tools (%d %s)", w0, turnsPlural(w0, "worker")),
		fmt.Sprintf(">= %.2f", TurnsTargetTools), f, ok, true, TurnsTargetTools, tools, plain)
}

// turnsComplete reports whether phase i completed in every round: every message sent got its
// reply, and none failed.
func turnsComplete(results [][]turnsResult, i int) bool {
	for round := range results {
		r := results[round][i]
		if r.done != r.sent || r.failed != 0 || r.sent == 0 {
			return false
		}
	}
	return true
}

// turnsColumn is v of phase i in every round.
func turnsColumn(results [][]turnsResult, i int, v func(turnsResult) float64) []float64 {
	vals := make([]float64, len(results))
	for round := range results {
		vals[round] = v(results[round][i])
	}
	return vals
}

// turnsFigure is the median of vals and vals.
func turnsFigure(vals []float64) TurnsFigure {
	return TurnsFigure{Median: turnsMedian(vals), Rounds: vals}
}

// turnsMedian is the middle value of vals, or the mean of the two middle ones; 0 for none.
func turnsMedian(vals []float64) float64 {
	if len(vals) == 0 {
		return 0
	}
	s := slices.Clone(vals)
	slices.Sort(s)
	if len(s)%2 == 1 {
		return s[len(s)/2]
	}
	return (s[len(s)/2-1] + s[len(s)/2]) / 2
}

// turnsMS prints a duration in milliseconds with two decimals.
func turnsMS(d time.Duration) string { return strconv.FormatFloat(ms(d), 'f', 2, 64) }

// WriteTable writes the report as text: settings, a table per kind of phase, ratios and
// targets. With several rounds, each main figure is the median followed by the rounds' values
// in brackets.
func (r *TurnsReport) WriteTable(w io.Writer) error {
	// One tabwriter for everything: a line without tabs ends the column blocks above it, so
	// each table aligns on its own.
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	var werr error
	p := func(format string, args ...any) {
		if werr == nil {
			_, werr = fmt.Fprintf(tw, format, args...)
		}
	}
	s := r.Settings
	p("baton bench turns: %d %s in %s\n", s.Rounds, turnsPlural(s.Rounds, "round"),
		(time.Duration(r.WallSeconds * float64(time.Second))).Round(time.Second))
	p("  relay: a process of its own (%s)\n", s.Relay)
	p("  workers: in this process, each with a pool (%d connections) and a NATS connection of its own; "+
		"debounce %gms, poll interval %gms, up to %d turns at once\n", s.WorkerConns, s.DebounceMS, s.PollIntervalMS, s.MaxConcurrentTurns)
	p("  handler: echo reply at once (no tools), or one read and one write tool per turn (tools)\n")
	p("  producers: %d in this process; PostgreSQL: %s; NATS: %s\n", s.Producers, s.Postgres, s.NATS)
	if s.Profile != "" {
		p("  CPU profile of this process during the first throughput or tools phase: %s\n", s.Profile)
	}
	multi := s.Rounds > 1
	num := func(f TurnsFigure, prec int) string { return turnsFmtFigure(f, prec, multi) }
	median := func(f TurnsFigure, prec int) string { return strconv.FormatFloat(f.Median, 'f', prec, 64) }
	// replied shows the worst round.
	replied := func(done, sent TurnsFigure, complete bool) string {
		out := strconv.FormatFloat(slices.Min(append([]float64{done.Median}, done.Rounds...)), 'f', 0, 64) + "/" + median(sent, 0)
		if !complete {
			out += " INCOMPLETE"
		}
		return out
	}

	if len(r.Throughput) > 0 {
		p("\nthroughput: %d messages, one conversation each, from %d producers as fast as they go; "+
			"first producer commit → last reply commit; bench cpu = cores this process kept busy "+
			"(workers, producers, embedded NATS; not the relay or PostgreSQL)\n", s.Turns, s.Producers)
		p("source\tworkers\thandler\treplied\tseconds\tturns/s\tclaim batch\tcommit batch\tconflicts\tnacked\tbench cpu\n")
		for _, t := range r.Throughput {
			handler := "no tools"
			if t.Tools {
				handler = "tools"
			}
			p("%s\t%d\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\n", t.Source, t.Workers, handler,
				replied(t.Done, t.Sent, t.Complete), median(t.Seconds, 2), num(t.TurnsPerSecond, 0),
				median(t.ClaimBatch, 1), median(t.CommitBatch, 1), median(t.ClaimConflicts, 0), median(t.EventsNacked, 0),
				median(t.ProcessCPUCores, 2))
		}
	}
	if len(r.Latency) > 0 {
		p("\nlatency: producer commit → reply commit, %gs per rate (ms; wait = row written → claimed, "+
			"turn = claimed → committed, by the database's clock)\n", s.LatencySeconds)
		p("source\tworkers\trate/s\tachieved/s\tconversations\treplied\tp50\tp99\twait p50\twait p99\tturn p50\tturn p99\n")
		for _, l := range r.Latency {
			p("%s\t%d\t%d\t%s\t%d\t%s\t%s\t%s\t%s\t%s\t%s\t%s\n", l.Source, l.Workers, l.Rate,
				median(l.AchievedRate, 0), l.Conversations, replied(l.Done, l.Sent, l.Complete),
				num(l.P50MS, 2), num(l.P99MS, 2), median(l.WaitP50MS, 2), median(l.WaitP99MS, 2),
				median(l.TurnP50MS, 2), median(l.TurnP99MS, 2))
		}
	}
	if len(r.Ratios) > 0 {
		p("\nratios (of the same round; median over the rounds)\n")
		for _, x := range r.Ratios {
			p("  %s\t%s\n", x.Name, num(x.Value, 2))
		}
	}
	p("\ntargets (jetstream source)\n")
	p("  target\twant\tmeasured\tresult\n")
	for _, t := range r.Targets {
		switch {
		case t.Value == nil:
			p("  %s\t%s\t-\tnot measured\n", t.Name, t.Want)
		case !t.Complete:
			p("  %s\t%s\t%s\tINCOMPLETE (not met)\n", t.Name, t.Want, turnsFmtValue(*t.Value))
		case *t.Met:
			p("  %s\t%s\t%s\tmet\n", t.Name, t.Want, turnsFmtValue(*t.Value))
		default:
			p("  %s\t%s\t%s\tMISSED\n", t.Name, t.Want, turnsFmtValue(*t.Value))
		}
	}
	if !r.Complete() {
		p("\nINCOMPLETE: some messages got no reply or failed (see the replied column)\n")
	}
	if werr == nil {
		werr = tw.Flush()
	}
	if werr != nil {
		return fmt.Errorf("write the report: %w", werr)
	}
	return nil
}

// turnsFmtFigure is f's median with prec decimals, followed by the rounds' values in
// brackets when raw is set.
func turnsFmtFigure(f TurnsFigure, prec int, raw bool) string {
	out := strconv.FormatFloat(f.Median, 'f', prec, 64)
	if !raw {
		return out
	}
	vals := make([]string, len(f.Rounds))
	for i, v := range f.Rounds {
		vals[i] = strconv.FormatFloat(v, 'f', prec, 64)
	}
	return out + " [" + strings.Join(vals, " ") + "]"
}

// turnsFmtValue prints a target's figure: whole numbers above 100, two decimals below.
func turnsFmtValue(v float64) string {
	if v >= 100 {
		return strconv.FormatFloat(v, 'f', 0, 64)
	}
	return strconv.FormatFloat(v, 'f', 2, 64)
}
