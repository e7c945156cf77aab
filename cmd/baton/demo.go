package main

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"os"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"golang.org/x/sync/errgroup"

	"github.com/batonhq/baton/internal/config"
	"github.com/batonhq/baton/internal/localsvc"
	"github.com/batonhq/baton/internal/opsserver"
	"github.com/batonhq/baton/migrations"
	"github.com/batonhq/baton/producer"
	"github.com/batonhq/baton/relay"
	"github.com/batonhq/baton/wire"
)

const demoSummary = "send messages through producer, relay, JetStream and two echo workers, and check each gets exactly one outcome"

const demoDescription = `Demo runs Baton end to end on this machine. It sends user messages with the producer over
many conversations, and runs in this process the relay, two echo-agent workers (demo-worker-1
and demo-worker-2, each with a connection pool of its own) and an outcome subscriber. It follows
the turns stream, to check that every accepted message reached JetStream once, and the outcomes
stream, to check that every accepted message got exactly one terminal outcome: an assistant
reply, or a visible failure (an error message in the conversation). About 5% of the messages are
sent a second time with the same id, as a client retrying after a timeout would: each retry must
come back as AlreadyAccepted with the same outbox row, and write nothing.

The workers' handler calls a read tool (lookup, recorded as an operation) and replies with an
echo of the turn's messages. --model-latency makes each turn take longer; --fail-every N makes
every turn of every Nth conversation fail, so its messages end as visible failures after 2
attempts.

Without BATON_DATABASE_URL it starts a throwaway PostgreSQL cluster (the machine's server
binaries, a temp dir, a free port); without BATON_NATS_URL an embedded NATS JetStream server.
Both are stopped and removed when the demo ends, also on Ctrl-C.

With BATON_DATABASE_URL set, the demo WRITES TO THAT DATABASE: it applies the migrations and
adds conversations, messages, outbox rows, runs and operations whose conversation and message
ids start with "demo-"; its relay uses the configured slot (BATON_SLOT) and publication,
creating the slot if it is missing; and its workers join the durable consumer "baton-workers"
and answer EVERY pending message in that database with an echo. Point it at a scratch database.
With BATON_NATS_URL set, it uses the configured streams (BATON_SUBJECT_PREFIX).

The summary ends the demo: sent, retries, relayed, replied, failed visibly, lost (accepted
messages with neither a reply nor a visible failure after the tail wait), duplicates (an event
stored twice in a stream, or a message answered twice) and commit→reply latency. Ctrl-C stops
sending, gives the workers a moment to answer what was accepted and reports the rest as
unfinished, not lost. Exit status 0 when nothing was lost or doubled, 1 otherwise. Logs go to
stderr at level warn (the workers' at error) unless BATON_LOG_LEVEL or --log-level say otherwise.`

// Demo timing.
const (
	// demoSenders is how many goroutines call Send at once, at most.
	demoSenders = 8
	// demoRetryEvery makes every demoRetryEvery-th message a retry candidate: 5%.
	demoRetryEvery = 20
	// demoStartTimeout bounds starting the throwaway servers and the relay.
	demoStartTimeout = 2 * time.Minute
	// demoInterruptGrace is how long an interrupted demo still waits for the outcomes of the
	// messages it sent before it stops the workers.
	demoInterruptGrace = 5 * time.Second
	// demoOutcomeGrace is how long the demo waits, after the workers stopped, for the outcomes
	// of turns that finished during their shutdown grace.
	demoOutcomeGrace = time.Second
)

// demoOptions are the demo's own flags.
type demoOptions struct {
	messages      int
	conversations int
	rate          float64
	tailTimeout   time.Duration
	modelLatency  time.Duration
	failEvery     int
}

func runDemo(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	fs := newFlagSet("demo", demoDescription, stderr)
	var opts demoOptions
	fs.IntVar(&opts.messages, "messages", 1000, "messages to send")
	fs.IntVar(&opts.conversations, "conversations", 50, "conversations to spread the messages over")
	fs.Float64Var(&opts.rate, "rate", 500, "messages per second; 0 sends as fast as possible")
	fs.DurationVar(&opts.tailTimeout, "tail-timeout", 60*time.Second,
		"after the last send, how long to wait for every message's outcome")
	fs.DurationVar(&opts.modelLatency, "model-latency", 0, "how long each simulated model call of the workers takes")
	fs.IntVar(&opts.failEvery, "fail-every", 0,
		"make every turn of every `N`th conversation fail, ending in visible failures (0: none)")
	cfg, log, err := configureDemo(fs, args, stderr)
	if err != nil {
		return err
	}
	switch {
	case opts.messages < 1:
		return usageError{msg: "--messages must be at least 1"}
	case opts.conversations < 1:
		return usageError{msg: "--conversations must be at least 1"}
	case opts.rate < 0:
		return usageError{msg: "--rate must not be negative (0 sends as fast as possible)"}
	case opts.tailTimeout <= 0:
		return usageError{msg: "--tail-timeout must be positive"}
	case opts.modelLatency < 0:
		return usageError{msg: "--model-latency must not be negative"}
	case opts.failEvery < 0:
		return usageError{msg: "--fail-every must not be negative (0 fails nothing)"}
	}
	log.Debug("configuration", "config", cfg)
	// The workers log every failed attempt at warn: with --fail-every that would bury the
	// progress line. They log at error unless the level was chosen.
	workerLog := log
	if os.Getenv(config.EnvLogLevel) == "" && cfg.Source(config.EnvLogLevel) == config.EnvLogLevel {
		wcfg := *cfg
		wcfg.LogLevel = "error"
		workerLog = wcfg.Logger(stderr)
	}
	d := &demo{opts: opts, cfg: cfg, log: log, workerLog: workerLog, out: stdout, tty: isTerminal(stdout)}
	return d.run(ctx)
}

// configureDemo is configure with warn as the default log level, so the progress line stays
// readable; BATON_LOG_LEVEL and --log-level override it.
func configureDemo(fs *flag.FlagSet, args []string, stderr io.Writer) (*config.Config, *slog.Logger, error) {
	cfg, err := config.FromEnv()
	if err != nil {
		return nil, nil, err
	}
	if os.Getenv(config.EnvLogLevel) == "" {
		cfg.LogLevel = "warn"
	}
	cfg.BindFlags(fs, config.EnvDatabaseURL, config.EnvNATSURL, config.EnvSubjectPrefix, config.EnvSlot,
		config.EnvPublication, config.EnvMetricsAddr, config.EnvLogLevel, config.EnvLogFormat)
	if err := parseFlags(fs, args); err != nil {
		return nil, nil, err
	}
	if err := cfg.Validate(); err != nil {
		return nil, nil, fmt.Errorf("invalid configuration:\n%w", err)
	}
	return &cfg, cfg.Logger(stderr), nil
}

// isTerminal reports whether w is a character device (a terminal), where the progress line
// can update in place.
func isTerminal(w io.Writer) bool {
	f, ok := w.(*os.File)
	if !ok {
		return false
	}
	st, err := f.Stat()
	return err == nil && st.Mode()&os.ModeCharDevice != 0
}

// noPostgresError says how to give the demo a PostgreSQL when the server binaries are missing.
func noPostgresError(err error) error {
	if !errors.Is(err, localsvc.ErrNoPostgres) {
		return fmt.Errorf("start a throwaway PostgreSQL: %w", err)
	}
	return errors.New("the demo needs PostgreSQL and found no server binaries (initdb, postgres) to start a " +
		"throwaway cluster with.\n" +
		"  Install them: Debian/Ubuntu `apt-get install -y postgresql`, Fedora `dnf install -y postgresql-server`, " +
		"macOS `brew install postgresql` (pg_config must be on PATH, or initdb itself);\n" +
		"  or set BATON_DATABASE_URL (or --database-url) to a PostgreSQL 15+ server running with wal_level=logical, " +
		"as a role that may replicate: the demo writes into that database")
}

// demo is one run of `baton demo`.
type demo struct {
	opts      demoOptions
	cfg       *config.Config
	log       *slog.Logger
	workerLog *slog.Logger
	out       io.Writer
	tty       bool

	runID    string // prefix of every id this run writes
	stream   string // the turns stream
	outcomes string // the outcomes stream
	workers  []string
	stats    demoStats
}

func (d *demo) convPrefix() string  { return d.runID + "-c" }
func (d *demo) convID(i int) string { return d.convPrefix() + strconv.Itoa(i) }
func (d *demo) msgPrefix() string   { return d.runID + "-m" }
func (d *demo) msgID(i int) string  { return d.msgPrefix() + strconv.Itoa(i) }

func (d *demo) printf(format string, args ...any) { fmt.Fprintf(d.out, format, args...) }

// run sets up the servers, runs the relay, the workers and the demo flow, and prints the
// summary. Every resource it starts is released by a defer, on every path.
func (d *demo) run(ctx context.Context) (err error) {
	d.runID = "demo-" + strconv.FormatInt(time.Now().UnixNano(), 36)
	cfg := *d.cfg // with the URLs of what the demo starts filled in
	// Starting servers is not cut short by Ctrl-C: a half-started server would escape the
	// defers below. The checks after each step stop the demo instead.
	startCtx, cancelStart := context.WithTimeout(context.WithoutCancel(ctx), demoStartTimeout)
	defer cancelStart()

	if cfg.DatabaseURL == "" {
		d.printf("starting a throwaway PostgreSQL cluster (BATON_DATABASE_URL is not set)\n")
		var pg *localsvc.Postgres
		if pg, err = localsvc.StartPostgres(startCtx); err != nil {
			return noPostgresError(err)
		}
		defer func() {
			if cerr := pg.Close(); cerr != nil && err == nil {
				err = fmt.Errorf("remove the throwaway PostgreSQL: %w", cerr)
			}
		}()
		cfg.DatabaseURL = pg.URL("postgres")
		d.printf("  PostgreSQL on 127.0.0.1:%d, data in %s (removed on exit)\n", pg.Port, pg.Dir)
	} else {
		d.printf("using the PostgreSQL at %s (BATON_DATABASE_URL): the demo writes ids starting with %s- there "+
			"and its workers answer every pending message\n", config.Redact(cfg.DatabaseURL), d.runID)
	}
	if ctx.Err() != nil {
		d.printf("interrupted before sending anything\n")
		return nil
	}

	if cfg.NATSURL == "" {
		var dir string
		if dir, err = os.MkdirTemp("", "baton-demo-nats-"); err != nil {
			return fmt.Errorf("NATS store dir: %w", err)
		}
		defer func() {
			if rerr := os.RemoveAll(dir); rerr != nil && err == nil {
				err = fmt.Errorf("remove the NATS store: %w", rerr)
			}
		}()
		var srv *localsvc.NATS
		if srv, err = localsvc.RunNATS(dir, 0); err != nil {
			return fmt.Errorf("start an embedded NATS server: %w", err)
		}
		defer srv.Stop()
		cfg.NATSURL = srv.URL()
		d.printf("  embedded NATS JetStream on %s, store in %s (removed on exit)\n", srv.URL(), dir)
	} else {
		d.printf("using the NATS server at %s (BATON_NATS_URL)\n", config.Redact(cfg.NATSURL))
	}

	nc, err := connectNATS(&cfg, "baton-demo")
	if err != nil {
		return err
	}
	defer nc.Close()

	pcfg, err := pgxpool.ParseConfig(cfg.DatabaseURL)
	if err != nil {
		return fmt.Errorf("%s: not a usable PostgreSQL connection string: %s",
			cfg.Source(config.EnvDatabaseURL), config.Redact(cfg.DatabaseURL))
	}
	pcfg.MaxConns = demoSenders + 2
	if pcfg.ConnConfig.ConnectTimeout == 0 {
		pcfg.ConnConfig.ConnectTimeout = connectTimeout
	}
	pool, err := pgxpool.NewWithConfig(startCtx, pcfg)
	if err != nil {
		return fmt.Errorf("connect to PostgreSQL: %w", err)
	}
	defer pool.Close()
	if _, err := migrations.Up(startCtx, pool); err != nil {
		return fmt.Errorf("apply migrations: %w", err)
	}
	d.printf("  schema at version %d\n", migrations.Latest())

	reg := opsserver.NewRegistry()
	r, err := relay.New(relay.Config{
		DatabaseURL:   cfg.DatabaseURL,
		NATS:          nc,
		SubjectPrefix: cfg.SubjectPrefix,
		Slot:          cfg.Slot,
		Publication:   cfg.Publication,
		Logger:        d.log,
		Registerer:    reg,
	})
	if err != nil {
		return err
	}
	d.stream = wire.StreamName(cfg.SubjectPrefix, wire.KindTurns)
	d.outcomes = wire.StreamName(cfg.SubjectPrefix, wire.KindOutcomes)
	prod, err := producer.New(producer.Config{Logger: d.log})
	if err != nil {
		return err
	}
	agent := &demoAgent{latency: d.opts.modelLatency, failEvery: d.opts.failEvery, convPrefix: d.convPrefix()}
	ws, err := newDemoWorkers(startCtx, &cfg, pcfg, agent.handle, d.workerLog, reg)
	defer ws.close() // after the errgroup below: the workers have stopped
	if err != nil {
		return err
	}
	d.workers = ws.names

	// The relay, the workers and the flow run under runCtx, not ctx: after Ctrl-C the flow
	// stops sending but still gives the workers and the relay a moment to finish what was
	// committed, then stops the workers and ends runCtx.
	runCtx, cancelRun := context.WithCancel(context.WithoutCancel(ctx))
	defer cancelRun()
	g, gctx := errgroup.WithContext(runCtx)
	g.Go(func() error {
		if err := r.Run(gctx); err != nil {
			return fmt.Errorf("relay: %w", err)
		}
		return nil
	})
	if cfg.MetricsAddr != "" {
		g.Go(func() error { return opsserver.Serve(gctx, cfg.MetricsAddr, reg, r.Ready) })
	}
	ws.start(gctx, g)
	var res demoResult
	g.Go(func() error {
		defer cancelRun() // the flow is done: stop the relay (it drains and confirms) and the rest
		var err error
		res, err = d.flow(ctx, gctx, r, nc, pool, prod, ws, &cfg)
		return err
	})
	err = g.Wait()
	if res.started {
		d.printSummary(res)
	}
	if err != nil {
		return err
	}
	return res.verdict()
}

// demoResult is what the flow found.
type demoResult struct {
	started     bool // sending began
	interrupted bool
	tailTimeout bool // the wait for the outcomes ran out
	sendTime    time.Duration
	snap        demoSnapshot
	latency     demoLatency
	db          demoDB
}

// verdict is the error the demo exits with: nil when nothing was lost or doubled.
func (res demoResult) verdict() error {
	s := res.snap
	var problems []string
	if n := s.duplicates(); n > 0 {
		problems = append(problems, fmt.Sprintf("%d duplicates (%s)", n, s.duplicateDetail()))
	}
	if s.retryBad > 0 {
		problems = append(problems, fmt.Sprintf("%d retries were not recognised as duplicates", s.retryBad))
	}
	if res.db.outboxRows >= 0 && res.db.outboxRows != int64(s.sent) {
		problems = append(problems, fmt.Sprintf("%d outbox rows for %d accepted messages", res.db.outboxRows, s.sent))
	}
	if !res.interrupted {
		if n := s.unanswered(); n > 0 {
			p := fmt.Sprintf("%d of %d accepted messages got neither a reply nor a visible failure", n, s.sent)
			if res.tailTimeout {
				p += " within --tail-timeout"
			}
			problems = append(problems, p)
		}
		if n := s.notRelayed(); n > 0 {
			problems = append(problems, fmt.Sprintf("%d of %d accepted messages never reached the turns stream", n, s.sent))
		}
	}
	if len(problems) == 0 {
		return nil
	}
	return errors.New("FAILED: " + strings.Join(problems, "; "))
}

// flow waits for the relay, subscribes to the turns and outcomes streams, sends the messages,
// waits for their outcomes and stops the workers. ctx ends on Ctrl-C; gctx when the relay or a
// worker failed.
func (d *demo) flow(ctx, gctx context.Context, r *relay.Relay, nc *nats.Conn, pool *pgxpool.Pool,
	prod *producer.Producer, ws *demoWorkers, cfg *config.Config) (res demoResult, err error) {
	res.db = demoDB{outboxRows: -1, dbReplies: -1, lookups: -1}
	js, err := jetstream.New(nc)
	if err != nil {
		return res, fmt.Errorf("jetstream: %w", err)
	}
	res.interrupted, err = d.waitRelay(ctx, gctx, r, js)
	switch {
	case gctx.Err() != nil:
		return res, nil // the relay failed; its error is the demo's
	case err != nil:
		return res, err
	case res.interrupted:
		d.printf("interrupted before sending anything\n")
		return res, nil
	}
	turns, err := d.subscribe(gctx, js, d.stream, wire.StreamFilter(cfg.SubjectPrefix, wire.KindTurns), d.onTurn)
	if err != nil {
		return res, err
	}
	defer stopConsume(turns, d.stream, d.log)
	outcomes, err := d.subscribe(gctx, js, d.outcomes, wire.StreamFilter(cfg.SubjectPrefix, wire.KindOutcomes), d.onOutcome)
	if err != nil {
		return res, err
	}
	defer stopConsume(outcomes, d.outcomes, d.log)
	failing := ""
	if d.opts.failEvery > 0 {
		failing = fmt.Sprintf("; every turn of every %dth conversation fails on purpose", d.opts.failEvery)
	}
	d.printf("  workers %s consuming %s: echo handler with a lookup tool, model latency %s, %d attempts%s\n",
		strings.Join(d.workers, " and "), d.stream, d.opts.modelLatency, demoMaxAttempts, failing)
	d.printf("  outcome subscriber reading %s\n", d.outcomes)

	if err := d.createConversations(ctx, gctx, pool, prod); err != nil {
		if ctx.Err() != nil && gctx.Err() == nil {
			res.interrupted = true
			d.printf("interrupted before sending anything\n")
			return res, nil
		}
		return res, err
	}
	rate := "as fast as possible"
	if d.opts.rate > 0 {
		rate = strconv.FormatFloat(d.opts.rate, 'f', -1, 64) + " msg/s"
	}
	d.printf("sending %d messages to %d conversations, %s, every %dth sent twice with the same id\n",
		d.opts.messages, d.opts.conversations, rate, demoRetryEvery)
	res.started = true

	progressDone := make(chan struct{})
	stopProgress := make(chan struct{})
	start := time.Now()
	go func() {
		defer close(progressDone)
		d.progress(start, stopProgress)
	}()
	sendErr := d.send(ctx, gctx, pool, prod)
	res.sendTime = time.Since(start)
	res.interrupted = ctx.Err() != nil

	// The tail: wait until every accepted message is in the turns stream and has its outcome.
	wait := d.opts.tailTimeout
	if res.interrupted {
		wait = demoInterruptGrace
	}
	if sendErr == nil {
		res.tailTimeout = !d.waitTail(ctx, gctx, wait, res.interrupted)
		res.interrupted = ctx.Err() != nil
	}
	// Stop the workers while the relay still runs: a running turn gets demoShutdownGrace to
	// finish, then its rows are released. Outcomes committed meanwhile still reach the stream.
	ws.stop()
	if sendErr == nil && gctx.Err() == nil && !d.stats.snapshot().settled() {
		res.tailTimeout = !d.waitTail(ctx, gctx, demoOutcomeGrace, true) && res.tailTimeout
	}
	close(stopProgress)
	<-progressDone

	qctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 10*time.Second)
	defer cancel()
	res.db = d.queryDB(qctx, pool)
	res.snap, res.latency = d.stats.final()
	return res, sendErr
}

// stopConsume stops a subscription and waits for it to end, a few seconds at most.
func stopConsume(cc jetstream.ConsumeContext, stream string, log *slog.Logger) {
	cc.Stop()
	select {
	case <-cc.Closed():
	case <-time.After(5 * time.Second):
		log.Warn("subscriber did not stop within 5s", "stream", stream)
	}
}

// waitRelay waits until the relay streams, or stands by while another relay streams from the
// same slot into an existing stream. It reports whether ctx ended first, and fails when the
// relay is not ready within demoStartTimeout.
func (d *demo) waitRelay(ctx, gctx context.Context, r *relay.Relay, js jetstream.JetStream) (interrupted bool, err error) {
	deadline := time.Now().Add(demoStartTimeout)
	tick := time.NewTicker(50 * time.Millisecond)
	defer tick.Stop()
	for {
		if r.Active() {
			d.printf("  relay streaming from slot %s to streams %s and %s\n", d.cfg.Slot, d.stream, d.outcomes)
			return false, nil
		}
		if r.Ready() {
			// Standing by: another relay holds the slot and publishes the demo's events.
			sctx, cancel := context.WithTimeout(gctx, 2*time.Second)
			_, err := js.Stream(sctx, d.stream)
			if err == nil {
				_, err = js.Stream(sctx, d.outcomes)
			}
			cancel()
			if err == nil {
				d.printf("  another relay holds slot %s; this one stands by and the other publishes to %s and %s\n",
					d.cfg.Slot, d.stream, d.outcomes)
				return false, nil
			}
		}
		if time.Now().After(deadline) {
			return false, fmt.Errorf("the relay did not start streaming within %s (run with --log-level info to see why)",
				demoStartTimeout)
		}
		select {
		case <-tick.C:
		case <-ctx.Done():
			return true, nil
		case <-gctx.Done():
			return false, nil
		}
	}
}

// subscribe reads stream from its current end with an ordered consumer, which delivers each
// stored message once, in order, without acks: an id seen twice is a duplicate stored in the
// stream, not a redelivery.
func (d *demo) subscribe(ctx context.Context, js jetstream.JetStream, stream, filter string,
	handle func(jetstream.Msg)) (jetstream.ConsumeContext, error) {
	st, err := js.Stream(ctx, stream)
	if err != nil {
		return nil, fmt.Errorf("look up stream %s: %w", stream, err)
	}
	cons, err := js.OrderedConsumer(ctx, stream, jetstream.OrderedConsumerConfig{
		FilterSubjects: []string{filter},
		DeliverPolicy:  jetstream.DeliverByStartSequencePolicy,
		OptStartSeq:    st.CachedInfo().State.LastSeq + 1,
	})
	if err != nil {
		return nil, fmt.Errorf("subscribe to stream %s: %w", stream, err)
	}
	cc, err := cons.Consume(handle, jetstream.ConsumeErrHandler(func(_ jetstream.ConsumeContext, err error) {
		d.log.Debug("subscriber", "stream", stream, "error", err)
	}))
	if err != nil {
		return nil, fmt.Errorf("consume stream %s: %w", stream, err)
	}
	return cc, nil
}

// storedAt is when JetStream stored m, or now when its metadata cannot be read.
func storedAt(m jetstream.Msg) time.Time {
	if md, err := m.Metadata(); err == nil {
		return md.Timestamp
	}
	return time.Now()
}

// onTurn counts a turn event of this run.
func (d *demo) onTurn(m jetstream.Msg) {
	var ev wire.TurnEvent
	if err := json.Unmarshal(m.Data(), &ev); err != nil {
		d.log.Warn("undecodable turn event", "subject", m.Subject(), "error", err)
		return
	}
	if !strings.HasPrefix(ev.MessageID, d.msgPrefix()) {
		return // not this run's: another demo, or real traffic on a shared stream
	}
	d.stats.relayed(ev.OutboxID, storedAt(m))
}

// onOutcome is the outcome subscriber: like examples/subscriber it dedupes by message id, and
// it maps each outcome to the sent messages it answers by the outbox ids it names.
func (d *demo) onOutcome(m jetstream.Msg) {
	var ev wire.OutcomeEvent
	if err := json.Unmarshal(m.Data(), &ev); err != nil || ev.MessageID == "" {
		d.log.Warn("undecodable outcome event", "subject", m.Subject(), "error", err)
		return
	}
	if !strings.HasPrefix(ev.ConversationID, d.convPrefix()) {
		return // not this run's conversations
	}
	if ev.Role != "assistant" && ev.Role != "error" {
		d.log.Warn("outcome with an unexpected role", "message_id", ev.MessageID, "role", ev.Role)
		return
	}
	if len(ev.OutboxIDs) == 0 {
		d.log.Warn("outcome names no outbox ids", "message_id", ev.MessageID)
	}
	d.stats.outcome(ev.MessageID, ev.Role == "error", ev.OutboxIDs, storedAt(m))
}

// createConversations creates the run's conversations; Ctrl-C (ctx) or a failed relay (gctx)
// stops it.
func (d *demo) createConversations(ctx, gctx context.Context, pool *pgxpool.Pool, prod *producer.Producer) error {
	cctx, cancel := context.WithCancel(gctx)
	defer cancel()
	defer context.AfterFunc(ctx, cancel)()
	g, gctx := errgroup.WithContext(cctx)
	g.SetLimit(demoSenders)
	for i := range d.opts.conversations {
		g.Go(func() error {
			_, err := prod.CreateConversation(gctx, pool, d.convID(i))
			return err
		})
	}
	if err := g.Wait(); err != nil {
		return fmt.Errorf("create conversations: %w", err)
	}
	return nil
}

// send sends the messages at the configured rate until all are sent or ctx ends (Ctrl-C). A
// Send in progress when ctx ends is finished, not canceled, so every message is either
// accepted (with its outbox id known) or not sent. gctx ends the sending when the relay failed.
func (d *demo) send(ctx, gctx context.Context, pool *pgxpool.Pool, prod *producer.Producer) error {
	g, sctx := errgroup.WithContext(gctx)
	jobs := make(chan int)
	g.Go(func() error {
		defer close(jobs)
		start := time.Now()
		timer := time.NewTimer(0)
		defer timer.Stop()
		for i := range d.opts.messages {
			if d.opts.rate > 0 {
				due := start.Add(time.Duration(float64(i) / d.opts.rate * float64(time.Second)))
				if wait := time.Until(due); wait > 0 {
					timer.Reset(wait)
					select {
					case <-timer.C:
					case <-ctx.Done():
						return nil
					case <-sctx.Done():
						return nil
					}
				}
			}
			select {
			case jobs <- i:
			case <-ctx.Done():
				return nil
			case <-sctx.Done():
				return nil
			}
		}
		return nil
	})
	for range min(demoSenders, d.opts.messages) {
		g.Go(func() error {
			for i := range jobs {
				if err := d.sendOne(sctx, pool, prod, i); err != nil {
					return err
				}
			}
			return nil
		})
	}
	return g.Wait()
}

// sendOne sends message i and, for every demoRetryEvery-th message, sends it again with the
// same id, as a client that timed out would.
func (d *demo) sendOne(ctx context.Context, pool *pgxpool.Pool, prod *producer.Producer, i int) error {
	msg := producer.Message{
		ConversationID: d.convID(i % d.opts.conversations),
		ID:             d.msgID(i),
		Content:        fmt.Sprintf("demo message %d: hello, agent", i),
	}
	first, err := sendWithRetry(ctx, pool, prod, msg, d.log)
	if err != nil {
		return err
	}
	d.stats.sent(first.OutboxID, time.Now())
	if i%demoRetryEvery != demoRetryEvery-1 {
		return nil
	}
	again, err := sendWithRetry(ctx, pool, prod, msg, d.log)
	if err != nil {
		return err
	}
	ok := again.AlreadyAccepted && again.OutboxID == first.OutboxID
	if !ok {
		d.log.Error("retry with the same id was not recognised as a duplicate", "message_id", msg.ID,
			"outbox_id", first.OutboxID, "retry_outbox_id", again.OutboxID, "already_accepted", again.AlreadyAccepted)
	}
	d.stats.retried(ok)
	return nil
}

// sendWithRetry calls Send until it succeeds, a few times at most. Retrying with the same
// message is always safe: Send is idempotent by message id, so a send whose reply was lost
// comes back as AlreadyAccepted.
func sendWithRetry(ctx context.Context, pool *pgxpool.Pool, prod *producer.Producer, msg producer.Message,
	log *slog.Logger) (producer.Result, error) {
	const attempts = 5
	backoff := 100 * time.Millisecond
	for attempt := 1; ; attempt++ {
		res, err := prod.Send(ctx, pool, msg)
		if err == nil {
			return res, nil
		}
		if attempt == attempts || ctx.Err() != nil || errors.Is(err, producer.ErrInvalidInput) ||
			errors.Is(err, producer.ErrConflict) || errors.Is(err, producer.ErrConversationNotFound) {
			return res, err
		}
		log.Warn("send failed; retrying with the same id", "message_id", msg.ID, "error", err, "retry_in", backoff)
		select {
		case <-time.After(backoff):
		case <-ctx.Done():
			return res, err
		}
		backoff *= 2
	}
}

// waitTail waits, at most wait, until every accepted message is in the turns stream and has
// its outcome. It reports whether that happened. Unless interrupted, Ctrl-C (ctx) shortens
// the wait to demoInterruptGrace from then.
func (d *demo) waitTail(ctx, gctx context.Context, wait time.Duration, interrupted bool) bool {
	deadline := time.NewTimer(wait)
	defer deadline.Stop()
	tick := time.NewTicker(20 * time.Millisecond)
	defer tick.Stop()
	done := ctx.Done()
	if interrupted {
		done = nil
	}
	for {
		if d.stats.snapshot().settled() {
			return true
		}
		select {
		case <-tick.C:
		case <-deadline.C:
			return false
		case <-gctx.Done():
			return false
		case <-done: // Ctrl-C while waiting for the tail: a shorter grace from now
			done = nil
			if wait > demoInterruptGrace {
				deadline.Reset(demoInterruptGrace)
			}
		}
	}
}

// progress prints the counters until stop closes: one line updated in place on a terminal,
// a plain line every second otherwise. It ends with a newline on a terminal.
func (d *demo) progress(start time.Time, stop <-chan struct{}) {
	every := time.Second
	if d.tty {
		every = 200 * time.Millisecond
	}
	tick := time.NewTicker(every)
	defer tick.Stop()
	width := 0
	line := func() {
		s := d.stats.snapshot()
		secs := time.Since(start).Seconds()
		text := fmt.Sprintf("progress: sent %d/%d, relayed %d, replied %d, failed %d, waiting %d, %.0f msg/s, %.1fs",
			s.sent, d.opts.messages, s.received, s.replied, s.failed, s.unanswered(),
			float64(s.sent)/max(secs, 1e-3), secs)
		if d.tty {
			pad := max(width-len(text), 0)
			width = len(text)
			fmt.Fprintf(d.out, "\r%s%s", text, strings.Repeat(" ", pad))
			return
		}
		fmt.Fprintln(d.out, text)
	}
	for {
		select {
		case <-tick.C:
			line()
		case <-stop:
			if d.tty {
				line()
				fmt.Fprintln(d.out)
			}
			return
		}
	}
}

// demoDB is what the database says at the end of the run. A count of -1 could not be read.
type demoDB struct {
	outboxRows int64 // agent_outbox rows of this run
	// dbReplies rows answered by a reply, and the p50 / p99 of agent_runs.finished_at −
	// agent_outbox.created_at over them.
	dbReplies    int64
	dbP50, dbP99 time.Duration
	workerTurns  []workerTurns
	lookups      int64 // lookup operations of this run's turns
}

// workerTurns is how many runs (attempts included) a worker made for this run's conversations.
type workerTurns struct {
	name string
	runs int64
}

// queryDB reads the run's rows back: outbox rows (no second row for a retry), the
// database-side commit→reply latency, the turns per worker and the recorded operations. A
// failed query leaves its figure unknown.
func (d *demo) queryDB(ctx context.Context, pool *pgxpool.Pool) demoDB {
	db := demoDB{outboxRows: -1, dbReplies: -1, lookups: -1}
	if err := pool.QueryRow(ctx, `SELECT count(*) FROM agent_outbox WHERE starts_with(message_id, $1)`,
		d.msgPrefix()).Scan(&db.outboxRows); err != nil {
		d.log.Warn("count the demo's outbox rows", "error", err)
		db.outboxRows = -1
	}
	// created_at is set in the sending transaction (its start); finished_at in the worker's
	// final commit (clock time, just before it commits).
	var p50, p99 float64
	if err := pool.QueryRow(ctx, `SELECT count(*),
			coalesce(percentile_disc(0.5) WITHIN GROUP (ORDER BY s), 0),
			coalesce(percentile_disc(0.99) WITHIN GROUP (ORDER BY s), 0)
		FROM (SELECT extract(epoch FROM r.finished_at - o.created_at)::float8 AS s
			FROM agent_outbox o JOIN agent_runs r ON r.run_id = o.run_id
			WHERE starts_with(o.message_id, $1) AND o.status = 'done' AND r.finished_at IS NOT NULL) l`,
		d.msgPrefix()).Scan(&db.dbReplies, &p50, &p99); err != nil {
		d.log.Warn("database-side latency", "error", err)
		db.dbReplies = -1
	}
	db.dbP50 = time.Duration(p50 * float64(time.Second))
	db.dbP99 = time.Duration(p99 * float64(time.Second))
	rows, err := pool.Query(ctx, `SELECT worker, count(*) FROM agent_runs WHERE starts_with(conversation_id, $1)
		GROUP BY worker ORDER BY worker`, d.convPrefix())
	if err == nil {
		db.workerTurns, err = pgx.CollectRows(rows, func(row pgx.CollectableRow) (workerTurns, error) {
			var w workerTurns
			err := row.Scan(&w.name, &w.runs)
			return w, err
		})
	}
	if err != nil {
		d.log.Warn("count the workers' turns", "error", err)
		db.workerTurns = nil
	}
	if err := pool.QueryRow(ctx, `SELECT count(*) FROM operations WHERE starts_with(conversation_id, $1) AND tool = 'lookup'`,
		d.convPrefix()).Scan(&db.lookups); err != nil {
		d.log.Warn("count the demo's operations", "error", err)
		db.lookups = -1
	}
	return db
}

func (d *demo) printSummary(res demoResult) {
	s := res.snap
	switch {
	case res.interrupted && s.sent < d.opts.messages:
		d.printf("interrupted: stopped sending after %d of %d messages\n", s.sent, d.opts.messages)
	case res.interrupted:
		d.printf("interrupted while waiting for the outcomes\n")
	}
	d.printf("summary:\n")
	d.printf("  sent: %d messages to %d conversations in %.1fs (%.0f msg/s)\n",
		s.sent, d.opts.conversations, res.sendTime.Seconds(), float64(s.sent)/max(res.sendTime.Seconds(), 1e-3))
	d.printf("  retries accepted as duplicates: %d of %d (same id sent again: AlreadyAccepted, same outbox id)\n",
		s.retries-s.retryBad, s.retries)
	if res.db.outboxRows >= 0 {
		d.printf("  outbox rows: %d for %d accepted messages (no second row for a retry)\n", res.db.outboxRows, s.sent)
	}
	d.printf("  relayed: %d of %d accepted messages in stream %s\n", s.received, s.sent, d.stream)
	if n := s.relayed - s.received; n > 0 {
		d.printf("  turn events for messages no sender saw accepted: %d\n", n)
	}
	d.printf("  replied: %d (answered by an assistant reply in stream %s)\n", s.replied, d.outcomes)
	failed := "an error message in the conversation"
	if d.opts.failEvery > 0 {
		failed += fmt.Sprintf(", after %d attempts; --fail-every %d", demoMaxAttempts, d.opts.failEvery)
	}
	d.printf("  failed visibly: %d (%s)\n", s.failed, failed)
	if n := s.answeredUnknown(); n > 0 {
		d.printf("  outcomes for messages no sender saw accepted: %d\n", n)
	}
	switch n := s.unanswered(); {
	case res.interrupted:
		d.printf("  lost: 0\n")
		d.printf("  unfinished (interrupted): %d (accepted; no reply or failure yet when the demo stopped)\n", n)
	case n > 0:
		detail := "neither a reply nor a visible failure"
		if res.tailTimeout {
			detail += " within --tail-timeout"
		}
		if nr := s.notRelayed(); nr > 0 {
			detail += fmt.Sprintf("; %d never reached the turns stream", nr)
		}
		d.printf("  lost: %d (%s)\n", n, detail)
	default:
		d.printf("  lost: 0\n")
	}
	d.printf("  duplicates: %d (%s)\n", s.duplicates(), s.duplicateDetail())
	l := res.latency
	if len(l.reply) > 0 {
		d.printf("  commit→reply latency: p50 %s, p99 %s, max %s (from Send returning to the reply's JetStream "+
			"store timestamp, over %d replied messages%s)\n",
			fmtLatency(percentile(l.reply, 50)), fmtLatency(percentile(l.reply, 99)), fmtLatency(l.reply[len(l.reply)-1]),
			len(l.reply), earlyNote(l.replyEarly))
	}
	if res.db.dbReplies > 0 {
		d.printf("    database side: p50 %s, p99 %s (agent_runs.finished_at − agent_outbox.created_at, %d rows)\n",
			fmtLatency(res.db.dbP50), fmtLatency(res.db.dbP99), res.db.dbReplies)
	}
	if len(l.relay) > 0 {
		d.printf("  commit→relayed latency: p50 %s, p99 %s, max %s (from Send returning to the turn event's "+
			"store timestamp%s)\n",
			fmtLatency(percentile(l.relay, 50)), fmtLatency(percentile(l.relay, 99)), fmtLatency(l.relay[len(l.relay)-1]),
			earlyNote(l.relayEarly))
	}
	if len(res.db.workerTurns) > 0 {
		parts := make([]string, len(res.db.workerTurns))
		for i, w := range res.db.workerTurns {
			parts[i] = fmt.Sprintf("%s %d", w.name, w.runs)
		}
		ops := ""
		if res.db.lookups >= 0 {
			ops = fmt.Sprintf("; %d lookup operations recorded", res.db.lookups)
		}
		d.printf("  turns: %s (attempts included)%s\n", strings.Join(parts, ", "), ops)
	}
	if err := res.verdict(); err == nil {
		if res.interrupted {
			d.printf("result: OK so far (interrupted): nothing doubled\n")
		} else {
			d.printf("result: OK: every accepted message reached JetStream once and got exactly one outcome\n")
		}
	}
}

// earlyNote mentions the events stored before Send returned, which count as 0.
func earlyNote(n int) string {
	if n == 0 {
		return ""
	}
	return fmt.Sprintf("; %d stored before Send returned count as 0", n)
}

func fmtLatency(d time.Duration) string {
	switch {
	case d >= time.Second:
		return d.Round(10 * time.Millisecond).String()
	case d >= time.Millisecond:
		return d.Round(100 * time.Microsecond).String()
	default:
		return d.Round(time.Microsecond).String()
	}
}

// percentile returns the p-th percentile (nearest rank) of sorted, which must not be empty.
func percentile(sorted []time.Duration, p int) time.Duration {
	i := (len(sorted)*p + 99) / 100 // ceil(n*p/100)
	return sorted[min(max(i-1, 0), len(sorted)-1)]
}

// demoStats is what the senders and the subscribers observed, safe for concurrent use.
type demoStats struct {
	mu        sync.Mutex
	committed map[int64]time.Time  // outbox id → when its Send returned (the commit happened before)
	stored    map[int64]time.Time  // outbox id → JetStream store timestamp of its turn event
	answers   map[int64]demoAnswer // outbox id → the first outcome that answered it
	outcomes  map[string]struct{}  // message ids of the outcomes seen
	retries   int
	retryBad  int
	// Duplicates: turn events stored twice, outcomes stored twice, rows answered twice.
	turnDups, outcomeDups, answeredTwice int
	received                             int // accepted messages whose turn event arrived
	replied, failed                      int // accepted messages answered by a reply, by a visible failure
}

// demoAnswer is the outcome that answered an outbox row.
type demoAnswer struct {
	failed bool      // a visible failure (role error), not a reply
	stored time.Time // JetStream store timestamp of the outcome
}

// demoSnapshot is a consistent view of demoStats.
type demoSnapshot struct {
	sent                                 int // distinct messages accepted (outbox ids known)
	relayed                              int // distinct outbox ids of this run in the turns stream
	received                             int // accepted messages whose turn event is in the stream
	answered                             int // distinct outbox ids of this run answered by an outcome
	replied, failed                      int // accepted messages answered by a reply, by a visible failure
	retries, retryBad                    int
	turnDups, outcomeDups, answeredTwice int
}

// unanswered is the number of accepted messages with neither a reply nor a visible failure.
func (s demoSnapshot) unanswered() int { return s.sent - s.replied - s.failed }

// notRelayed is the number of accepted messages whose turn event has not arrived.
func (s demoSnapshot) notRelayed() int { return s.sent - s.received }

// settled reports whether every accepted message is in the turns stream and answered.
func (s demoSnapshot) settled() bool { return s.unanswered() == 0 && s.notRelayed() == 0 }

// answeredUnknown is the number of this run's answered rows whose message the senders never
// saw accepted.
func (s demoSnapshot) answeredUnknown() int { return s.answered - s.replied - s.failed }

func (s demoSnapshot) duplicates() int { return s.turnDups + s.outcomeDups + s.answeredTwice }

func (s demoSnapshot) duplicateDetail() string {
	return fmt.Sprintf("turn events stored twice %d, outcomes stored twice %d, messages answered twice %d",
		s.turnDups, s.outcomeDups, s.answeredTwice)
}

// sent records an accepted message; returned is when its Send returned.
func (s *demoStats) sent(outboxID int64, returned time.Time) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.committed == nil {
		s.committed = map[int64]time.Time{}
	}
	if _, ok := s.committed[outboxID]; ok {
		return
	}
	s.committed[outboxID] = returned
	if _, ok := s.stored[outboxID]; ok { // the event arrived before Send returned
		s.received++
	}
	if a, ok := s.answers[outboxID]; ok {
		s.countAnswer(a)
	}
}

func (s *demoStats) countAnswer(a demoAnswer) {
	if a.failed {
		s.failed++
	} else {
		s.replied++
	}
}

func (s *demoStats) retried(ok bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.retries++
	if !ok {
		s.retryBad++
	}
}

func (s *demoStats) relayed(outboxID int64, stored time.Time) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.stored == nil {
		s.stored = map[int64]time.Time{}
	}
	if _, ok := s.stored[outboxID]; ok {
		s.turnDups++
		return
	}
	s.stored[outboxID] = stored
	if _, ok := s.committed[outboxID]; ok {
		s.received++
	}
}

// outcome records an outcome (message messageID) answering the rows outboxIDs. An outcome seen
// again is a duplicate in the stream and counts once; a row answered by a second outcome is a
// message answered twice.
func (s *demoStats) outcome(messageID string, failed bool, outboxIDs []int64, stored time.Time) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.outcomes == nil {
		s.outcomes = map[string]struct{}{}
		s.answers = map[int64]demoAnswer{}
	}
	if _, ok := s.outcomes[messageID]; ok {
		s.outcomeDups++
		return
	}
	s.outcomes[messageID] = struct{}{}
	a := demoAnswer{failed: failed, stored: stored}
	for _, id := range outboxIDs {
		if _, ok := s.answers[id]; ok {
			s.answeredTwice++
			continue
		}
		s.answers[id] = a
		if _, ok := s.committed[id]; ok {
			s.countAnswer(a)
		}
	}
}

func (s *demoStats) snapshot() demoSnapshot {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.snapshotLocked()
}

func (s *demoStats) snapshotLocked() demoSnapshot {
	return demoSnapshot{sent: len(s.committed), relayed: len(s.stored), received: s.received,
		answered: len(s.answers), replied: s.replied, failed: s.failed,
		retries: s.retries, retryBad: s.retryBad,
		turnDups: s.turnDups, outcomeDups: s.outcomeDups, answeredTwice: s.answeredTwice}
}

// demoLatency holds the latencies of the accepted messages, measured from Send returning (what
// the application knows: the commit happened inside Send) to a JetStream store timestamp. An
// event stored before Send returned counts as zero.
type demoLatency struct {
	relay, reply           []time.Duration // to the turn event, to the reply; sorted
	relayEarly, replyEarly int             // stored before Send returned
}

// final returns the snapshot and the latencies.
func (s *demoStats) final() (demoSnapshot, demoLatency) {
	s.mu.Lock()
	defer s.mu.Unlock()
	var l demoLatency
	since := func(at, returned time.Time, early *int) time.Duration {
		d := at.Sub(returned)
		if d < 0 {
			*early++
			d = 0
		}
		return d
	}
	for id, c := range s.committed {
		if st, ok := s.stored[id]; ok {
			l.relay = append(l.relay, since(st, c, &l.relayEarly))
		}
		if a, ok := s.answers[id]; ok && !a.failed {
			l.reply = append(l.reply, since(a.stored, c, &l.replyEarly))
		}
	}
	slices.Sort(l.relay)
	slices.Sort(l.reply)
	return s.snapshotLocked(), l
}
