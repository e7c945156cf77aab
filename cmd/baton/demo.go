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

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"golang.org/x/sync/errgroup"

	"github.com/batonhq/baton/internal/config"
	"github.com/batonhq/baton/internal/opsserver"
	"github.com/batonhq/baton/internal/subject"
	"github.com/batonhq/baton/internal/testsvc"
	"github.com/batonhq/baton/migrations"
	"github.com/batonhq/baton/producer"
	"github.com/batonhq/baton/relay"
)

const demoSummary = "send messages through producer, Postgres, relay and JetStream, and check none is lost or doubled"

const demoDescription = `Demo shows Baton's durable path end to end on this machine: it sends user messages with the
producer over many conversations, runs the relay in this process, and reads the turns stream
back to check that every accepted message reached JetStream exactly once. About 5% of the
messages are sent a second time with the same id, as a client retrying after a timeout would:
each retry must come back as AlreadyAccepted with the same outbox row, and write nothing.

Without BATON_DATABASE_URL it starts a throwaway PostgreSQL cluster (the machine's server
binaries, a temp dir, a free port); without BATON_NATS_URL an embedded NATS JetStream server.
Both are stopped and removed when the demo ends, also on Ctrl-C.

With BATON_DATABASE_URL set, the demo WRITES TO THAT DATABASE: it applies the migrations and
adds conversations, messages and pending outbox rows whose ids start with "demo-", and its relay
uses the configured slot (BATON_SLOT) and publication, creating the slot if it is missing. Point
it at a scratch database, not at one whose workers would answer the demo's messages. With
BATON_NATS_URL set, it publishes to the configured turns stream (BATON_SUBJECT_PREFIX).

Workers and replies are not part of the demo yet: they come with the worker issue.

Exit status 0 when every accepted message is in the stream once (or the demo was interrupted
and nothing was doubled), 1 otherwise. Logs go to stderr at level warn unless BATON_LOG_LEVEL
or --log-level say otherwise.`

// Demo timing.
const (
	// demoSenders is how many goroutines call Send at once, at most.
	demoSenders = 8
	// demoRetryEvery makes every demoRetryEvery-th message a retry candidate: 5%.
	demoRetryEvery = 20
	// demoStartTimeout bounds starting the throwaway servers and the relay.
	demoStartTimeout = 2 * time.Minute
	// demoInterruptGrace is how long an interrupted demo still waits for the events of the
	// messages it sent before it stops the relay.
	demoInterruptGrace = 5 * time.Second
)

// demoOptions are the demo's own flags.
type demoOptions struct {
	messages      int
	conversations int
	rate          float64
	tailTimeout   time.Duration
}

func runDemo(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	fs := newFlagSet("demo", demoDescription, stderr)
	var opts demoOptions
	fs.IntVar(&opts.messages, "messages", 1000, "messages to send")
	fs.IntVar(&opts.conversations, "conversations", 50, "conversations to spread the messages over")
	fs.Float64Var(&opts.rate, "rate", 500, "messages per second; 0 sends as fast as possible")
	fs.DurationVar(&opts.tailTimeout, "tail-timeout", 60*time.Second,
		"after the last send, how long to wait for every message to reach the stream")
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
	}
	log.Debug("configuration", "config", cfg)
	d := &demo{opts: opts, cfg: cfg, log: log, out: stdout, tty: isTerminal(stdout)}
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
	if !errors.Is(err, testsvc.ErrNoPostgres) {
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
	opts demoOptions
	cfg  *config.Config
	log  *slog.Logger
	out  io.Writer
	tty  bool

	runID  string // prefix of every id this run writes
	stream string // the turns stream
	stats  demoStats
}

func (d *demo) convID(i int) string { return d.runID + "-c" + strconv.Itoa(i) }
func (d *demo) msgPrefix() string   { return d.runID + "-m" }
func (d *demo) msgID(i int) string  { return d.msgPrefix() + strconv.Itoa(i) }

func (d *demo) printf(format string, args ...any) { fmt.Fprintf(d.out, format, args...) }

// run sets up the servers, runs the relay and the demo flow, and prints the summary. Every
// resource it starts is released by a defer, on every path.
func (d *demo) run(ctx context.Context) (err error) {
	d.runID = "demo-" + strconv.FormatInt(time.Now().UnixNano(), 36)
	cfg := *d.cfg // with the URLs of what the demo starts filled in
	// Starting servers is not cut short by Ctrl-C: a half-started server would escape the
	// defers below. The checks after each step stop the demo instead.
	startCtx, cancelStart := context.WithTimeout(context.WithoutCancel(ctx), demoStartTimeout)
	defer cancelStart()

	if cfg.DatabaseURL == "" {
		d.printf("starting a throwaway PostgreSQL cluster (BATON_DATABASE_URL is not set)\n")
		var pg *testsvc.Postgres
		if pg, err = testsvc.StartPostgres(startCtx); err != nil {
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
		d.printf("using the PostgreSQL at %s (BATON_DATABASE_URL): the demo writes ids starting with %s- there\n",
			config.Redact(cfg.DatabaseURL), d.runID)
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
		var srv *testsvc.NATS
		if srv, err = testsvc.RunNATS(dir, 0); err != nil {
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
	d.stream = relay.StreamName(cfg.SubjectPrefix, subject.KindTurns)
	prod, err := producer.New(producer.Config{Logger: d.log})
	if err != nil {
		return err
	}

	// The relay and the flow run under runCtx, not ctx: after Ctrl-C the flow stops sending
	// but still gives the relay a moment to publish what was committed, then ends runCtx.
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
	var res demoResult
	g.Go(func() error {
		defer cancelRun() // the flow is done: stop the relay (it drains and confirms) and the rest
		var err error
		res, err = d.flow(ctx, gctx, r, nc, pool, prod, &cfg)
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
	tailTimeout bool // the wait for the stream's tail ran out
	sendTime    time.Duration
	outboxRows  int64 // agent_outbox rows of this run; -1 when they could not be counted
	snap        demoSnapshot
	latency     demoLatency
}

// verdict is the error the demo exits with: nil when nothing was lost or doubled.
func (res demoResult) verdict() error {
	s := res.snap
	var problems []string
	if s.streamDups > 0 {
		problems = append(problems, fmt.Sprintf("%d duplicate events in the stream", s.streamDups))
	}
	if s.retryBad > 0 {
		problems = append(problems, fmt.Sprintf("%d retries were not recognised as duplicates", s.retryBad))
	}
	if res.outboxRows >= 0 && res.outboxRows != int64(s.sent) {
		problems = append(problems, fmt.Sprintf("%d outbox rows for %d accepted messages", res.outboxRows, s.sent))
	}
	if s.lost() > 0 && !res.interrupted {
		problems = append(problems, fmt.Sprintf("%d of %d accepted messages did not reach the stream", s.lost(), s.sent))
		if res.tailTimeout {
			problems[len(problems)-1] += " within --tail-timeout"
		}
	}
	if len(problems) == 0 {
		return nil
	}
	return errors.New("FAILED: " + strings.Join(problems, "; "))
}

// flow waits for the relay, subscribes to the turns stream, sends the messages and waits for
// their events. ctx ends on Ctrl-C; gctx when the relay failed.
func (d *demo) flow(ctx, gctx context.Context, r *relay.Relay, nc *nats.Conn, pool *pgxpool.Pool,
	prod *producer.Producer, cfg *config.Config) (res demoResult, err error) {
	res.outboxRows = -1
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
	cc, err := d.subscribe(gctx, js, cfg.SubjectPrefix)
	if err != nil {
		return res, err
	}
	defer func() {
		cc.Stop()
		select {
		case <-cc.Closed():
		case <-time.After(5 * time.Second):
			d.log.Warn("turns subscriber did not stop within 5s")
		}
	}()

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

	// The tail: wait until every accepted message's event is in the stream.
	wait := d.opts.tailTimeout
	if res.interrupted {
		wait = demoInterruptGrace
	}
	if sendErr == nil {
		res.tailTimeout = !d.waitTail(ctx, gctx, wait, res.interrupted)
		res.interrupted = ctx.Err() != nil
	}
	close(stopProgress)
	<-progressDone

	countCtx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 10*time.Second)
	defer cancel()
	if err := pool.QueryRow(countCtx, `SELECT count(*) FROM agent_outbox WHERE starts_with(message_id, $1)`,
		d.msgPrefix()).Scan(&res.outboxRows); err != nil {
		d.log.Warn("count the demo's outbox rows", "error", err)
		res.outboxRows = -1
	}
	res.snap, res.latency = d.stats.final()
	return res, sendErr
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
			d.printf("  relay streaming from slot %s to stream %s\n", d.cfg.Slot, d.stream)
			return false, nil
		}
		if r.Ready() {
			// Standing by: another relay holds the slot and publishes the demo's events.
			sctx, cancel := context.WithTimeout(gctx, 2*time.Second)
			_, err := js.Stream(sctx, d.stream)
			cancel()
			if err == nil {
				d.printf("  another relay holds slot %s; this one stands by and the other publishes to %s\n",
					d.cfg.Slot, d.stream)
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

// subscribe reads the turns stream from its current end with an ordered consumer, which
// delivers each stored message once, in order, without acks: an outbox id seen twice is a
// duplicate in the stream, not a redelivery.
func (d *demo) subscribe(ctx context.Context, js jetstream.JetStream, prefix string) (jetstream.ConsumeContext, error) {
	st, err := js.Stream(ctx, d.stream)
	if err != nil {
		return nil, fmt.Errorf("look up stream %s: %w", d.stream, err)
	}
	cons, err := js.OrderedConsumer(ctx, d.stream, jetstream.OrderedConsumerConfig{
		FilterSubjects: []string{subject.StreamFilter(prefix, subject.KindTurns)},
		DeliverPolicy:  jetstream.DeliverByStartSequencePolicy,
		OptStartSeq:    st.CachedInfo().State.LastSeq + 1,
	})
	if err != nil {
		return nil, fmt.Errorf("subscribe to stream %s: %w", d.stream, err)
	}
	prefixID := d.msgPrefix()
	cc, err := cons.Consume(func(m jetstream.Msg) {
		var ev relay.TurnEvent
		if err := json.Unmarshal(m.Data(), &ev); err != nil {
			d.log.Warn("undecodable turn event", "subject", m.Subject(), "error", err)
			return
		}
		if !strings.HasPrefix(ev.MessageID, prefixID) {
			return // not this run's: another demo, or real traffic on a shared stream
		}
		stored := time.Now()
		if md, err := m.Metadata(); err == nil {
			stored = md.Timestamp
		}
		d.stats.relayed(ev.OutboxID, stored)
	}, jetstream.ConsumeErrHandler(func(_ jetstream.ConsumeContext, err error) {
		d.log.Debug("turns subscriber", "error", err)
	}))
	if err != nil {
		return nil, fmt.Errorf("consume stream %s: %w", d.stream, err)
	}
	return cc, nil
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
	started := time.Now()
	first, err := sendWithRetry(ctx, pool, prod, msg, d.log)
	if err != nil {
		return err
	}
	d.stats.sent(first.OutboxID, sendTimes{started: started, returned: time.Now()})
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

// waitTail waits until every accepted message's event arrived, at most wait. It reports
// whether they all did.
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
		if d.stats.snapshot().lost() == 0 {
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
		text := fmt.Sprintf("progress: sent %d/%d, retried %d, relayed %d, waiting %d, %.0f msg/s, %.1fs",
			s.sent, d.opts.messages, s.retries, s.relayed, s.lost(), float64(s.sent)/max(secs, 1e-3), secs)
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

func (d *demo) printSummary(res demoResult) {
	s := res.snap
	switch {
	case res.interrupted && s.sent < d.opts.messages:
		d.printf("interrupted: stopped sending after %d of %d messages\n", s.sent, d.opts.messages)
	case res.interrupted:
		d.printf("interrupted while waiting for the stream\n")
	}
	d.printf("summary:\n")
	d.printf("  sent: %d messages to %d conversations in %.1fs (%.0f msg/s)\n",
		s.sent, d.opts.conversations, res.sendTime.Seconds(), float64(s.sent)/max(res.sendTime.Seconds(), 1e-3))
	d.printf("  retries accepted as duplicates: %d of %d (same id sent again: AlreadyAccepted, same outbox id)\n",
		s.retries-s.retryBad, s.retries)
	if res.outboxRows >= 0 {
		d.printf("  outbox rows: %d for %d accepted messages (no second row for a retry)\n", res.outboxRows, s.sent)
	}
	d.printf("  relayed: %d distinct outbox ids in stream %s\n", s.relayed, d.stream)
	if s.unknown() > 0 {
		d.printf("  events for messages no sender saw accepted: %d\n", s.unknown())
	}
	d.printf("  duplicates in stream: %d\n", s.streamDups)
	if res.interrupted && s.lost() > 0 {
		d.printf("  lost: %d (interrupted: committed in Postgres, not yet in the stream when the demo stopped)\n", s.lost())
	} else {
		d.printf("  lost: %d\n", s.lost())
	}
	if l := res.latency; len(l.fromReturn) > 0 {
		d.printf("  commit→stored latency: p50 %s, p99 %s, max %s (from Send returning to the JetStream store "+
			"timestamp; %d of %d events were stored before Send returned and count as 0)\n",
			fmtLatency(percentile(l.fromReturn, 50)), fmtLatency(percentile(l.fromReturn, 99)),
			fmtLatency(l.fromReturn[len(l.fromReturn)-1]), l.early, len(l.fromReturn))
		d.printf("  upper bound, from Send starting: p50 %s, p99 %s, max %s\n",
			fmtLatency(percentile(l.fromStart, 50)), fmtLatency(percentile(l.fromStart, 99)),
			fmtLatency(l.fromStart[len(l.fromStart)-1]))
	}
	d.printf("  workers and replies: not in this demo yet; they come with the worker issue\n")
	if err := res.verdict(); err == nil {
		if res.interrupted {
			d.printf("result: OK so far (interrupted): nothing doubled\n")
		} else {
			d.printf("result: OK: every accepted message reached JetStream exactly once\n")
		}
	}
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

// demoStats is what the senders and the subscriber observed, safe for concurrent use.
type demoStats struct {
	mu         sync.Mutex
	committed  map[int64]sendTimes // outbox id → when its Send started and returned
	stored     map[int64]time.Time // outbox id → JetStream store timestamp of its first event
	retries    int
	retryBad   int
	streamDups int
	received   int // distinct outbox ids received that were also sent
}

// demoSnapshot is a consistent view of demoStats.
type demoSnapshot struct {
	sent                          int // distinct messages accepted (outbox ids known)
	relayed                       int // distinct outbox ids of this run in the stream
	received                      int // accepted messages whose event is in the stream
	retries, retryBad, streamDups int
}

// lost is the number of accepted messages whose event has not arrived.
func (s demoSnapshot) lost() int { return s.sent - s.received }

// unknown is the number of this run's events whose message the senders never saw accepted.
func (s demoSnapshot) unknown() int { return s.relayed - s.received }

// sendTimes brackets the commit of a message: it happened between started and returned.
type sendTimes struct{ started, returned time.Time }

func (s *demoStats) sent(outboxID int64, at sendTimes) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.committed == nil {
		s.committed = map[int64]sendTimes{}
	}
	if _, ok := s.committed[outboxID]; ok {
		return
	}
	s.committed[outboxID] = at
	if _, ok := s.stored[outboxID]; ok { // the event arrived before Send returned
		s.received++
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
		s.streamDups++
		return
	}
	s.stored[outboxID] = stored
	if _, ok := s.committed[outboxID]; ok {
		s.received++
	}
}

func (s *demoStats) snapshot() demoSnapshot {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.snapshotLocked()
}

func (s *demoStats) snapshotLocked() demoSnapshot {
	return demoSnapshot{sent: len(s.committed), relayed: len(s.stored), received: s.received,
		retries: s.retries, retryBad: s.retryBad, streamDups: s.streamDups}
}

// demoLatency is the commit→stored latency of the accepted messages whose event arrived. The
// commit happens inside Send, so it is measured from both ends of the call: from Send
// returning (what the application knows; an event stored before that counts as zero) and, as
// an upper bound, from Send starting.
type demoLatency struct {
	fromReturn, fromStart []time.Duration // sorted
	early                 int             // events stored before Send returned
}

// final returns the snapshot and the latencies.
func (s *demoStats) final() (demoSnapshot, demoLatency) {
	s.mu.Lock()
	defer s.mu.Unlock()
	var l demoLatency
	for id, c := range s.committed {
		st, ok := s.stored[id]
		if !ok {
			continue
		}
		d := st.Sub(c.returned)
		if d < 0 {
			l.early++
			d = 0
		}
		l.fromReturn = append(l.fromReturn, d)
		l.fromStart = append(l.fromStart, max(st.Sub(c.started), 0))
	}
	slices.Sort(l.fromReturn)
	slices.Sort(l.fromStart)
	return s.snapshotLocked(), l
}
