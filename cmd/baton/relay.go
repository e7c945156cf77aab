package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"sync"
	"time"

	"github.com/nats-io/nats.go"
	"golang.org/x/sync/errgroup"

	"github.com/batonhq/baton/internal/config"
	"github.com/batonhq/baton/internal/opsserver"
	"github.com/batonhq/baton/migrations"
	"github.com/batonhq/baton/natsconn"
	"github.com/batonhq/baton/relay"
	"github.com/batonhq/baton/tracing"
)

const relaySummary = "stream the outbox from Postgres logical replication to NATS JetStream"

// runRelay logs to stderr and writes nothing to stdout.
func runRelay(ctx context.Context, args []string, _, stderr io.Writer) error {
	fs := newFlagSet("relay", `Relay tails the publication with pgoutput and publishes every committed outbox row to
<prefix>.turns.<conv> and every reply to <prefix>.outcomes.<conv>, confirming the slot's LSN
only after JetStream acknowledged. Run two for high availability: one streams, the other
stands by and takes over when the first goes away. SIGTERM stops reading, waits for
acknowledgements (--drain-timeout), confirms and exits 0. After an error no retry can fix
(a setup problem, a lost slot) it logs the error, keeps serving metrics and health, not
ready, for --fatal-linger when --metrics-addr is set, and exits 1; SIGTERM exits at once.`, stderr)
	maxInFlight := fs.Int("max-in-flight", 8192, "events published or queued without a PubAck, at most")
	maxChangeBytes := fs.Int("max-change-bytes", relay.DefaultMaxChangeBytes,
		"replication messages larger than this are cut as they arrive and their change set aside\n"+
			"in the dead-letter stream (bounds the relay's memory: any role may emit a 1 GB logical message)")
	maxInFlightBytes := fs.Int("max-in-flight-bytes", relay.DefaultMaxInFlightBytes,
		"bytes of those events, at most (bounds the relay's memory while NATS is slow or away)")
	classic := fs.Bool("classic-publish", false, "publish event by event, never in JetStream fast-ingest batches (which the relay uses\n"+
		"while it is behind, when the server, 2.14 or later, and the streams take them)")
	drain := fs.Duration("drain-timeout", 10*time.Second, "on SIGTERM, how long to wait for PubAcks")
	ackTimeout := fs.Duration("ack-timeout", 10*time.Second, "how long a publish may wait for its PubAck before the session ends and the next one\n"+
		"publishes again from the confirmed position (a stalled or partitioned NATS)")
	recreateSlot := fs.Bool("recreate-slot", false, "drop a slot of that name that Baton did not create (an operator's or another tool's)\n"+
		"and create Baton's in its place, with a first-start backfill; without it such a slot is refused")
	_ = fs.Duration("stale-lock-after", 10*time.Second, "no longer used (kept so that scripts that set it still run): a standby takes over once\n"+
		"the slot is free, within wal_sender_timeout of the active relay going silent")
	statusInterval := fs.Duration("status-interval", time.Second, "how often the relay reports its confirmed position to Postgres (and asks for an answer)")
	minSilence := fs.Duration("min-silence", 10*time.Second, "how long a status update to Postgres may go unanswered, no byte arriving, before the relay\n"+
		"looks at its walsender from its other connection: busy decoding (a neighbour's large transaction)\n"+
		"it waits on, gone or stuck on the connection it ends the session (at least 3 status intervals)")
	shard := fs.String("shard", "", "run as shard `K/N` of N sharded relays: stream publication <publication>_K (made by\n"+
		"baton migrate --shards N) from slot <slot>_K; one active relay (plus standbys) per shard")
	cfg, log, err := configure(fs, args, stderr, config.EnvDatabaseURL, config.EnvNATSURL,
		config.EnvSubjectPrefix, config.EnvSlot, config.EnvPublication, config.EnvSchema, config.EnvMetricsAddr, config.EnvPprofAddr, config.EnvFatalLinger,
		config.EnvStreamReplicas, config.EnvStreamMaxAge, config.EnvStreamMaxBytes, config.EnvStreamMaxMsgs, config.EnvStreamDuplicate)
	if err != nil {
		return err
	}
	var shardK, shardN int
	if *shard != "" {
		if shardK, shardN, err = migrations.ParseShard(*shard); err != nil {
			return usageError{msg: "--shard: " + err.Error()}
		}
	}
	if err := cfg.Require(config.EnvDatabaseURL, config.EnvNATSURL); err != nil {
		return err
	}
	log.Info("starting relay", "config", cfg)
	// Traces from the standard OTEL_* variables, off without them. The relay makes no span of
	// its own per event (it carries the sender's traceparent on each event: see
	// wire.HeaderTraceparent); the provider serves whatever traced code runs in the process.
	shutdownTracing, err := tracing.Setup(ctx)
	if errors.Is(err, tracing.ErrConfig) {
		return usageError{msg: err.Error()}
	}
	if err != nil {
		return reportFailure(log, err, 0)
	}
	defer tracing.Stop(ctx, shutdownTracing, log)

	// nats.go closes a connection for good only when a reconnect's login was refused twice in
	// a row (or on a protocol error): reconnects are unlimited otherwise. The relay then
	// exits 1, saying why, so that an orchestrator restarts it with whatever credentials it
	// has by then, instead of standing by forever on a dead connection.
	closed := make(chan struct{})
	var closedOnce sync.Once
	nc, err := connectNATS(cfg, "baton-relay",
		nats.ClosedHandler(func(*nats.Conn) { closedOnce.Do(func() { close(closed) }) }),
		// nats.go prints asynchronous errors (a refused login on a reconnect) raw to stderr
		// otherwise, outside the configured log format.
		nats.ErrorHandler(func(_ *nats.Conn, _ *nats.Subscription, err error) { log.Warn("NATS error", "error", err) }),
		// What is published while disconnected waits in nats.go's reconnect buffer and is sent
		// on reconnect; a session that ended meanwhile is fenced (relay/fence.go).
		nats.DisconnectErrHandler(func(nc *nats.Conn, err error) {
			if !nc.IsClosed() { // closing the connection on exit says nothing
				log.Warn("NATS disconnected; reconnecting", "error", err)
			}
		}),
		nats.ReconnectHandler(func(nc *nats.Conn) { log.Info("NATS reconnected", "server", nc.ConnectedUrlRedacted()) }))
	if err != nil {
		return reportFailure(log, err, 0)
	}
	defer closeNATS(nc)

	reg := opsserver.NewRegistry()
	r, err := relay.New(relay.Config{
		DatabaseURL:      cfg.DatabaseURL,
		NATS:             nc,
		SubjectPrefix:    cfg.SubjectPrefix,
		Slot:             cfg.Slot,
		Publication:      cfg.Publication,
		Schema:           cfg.Schema,
		Shards:           shardN,
		Shard:            shardK,
		Streams:          streamSettings(cfg.Streams()),
		MaxInFlight:      *maxInFlight,
		MaxInFlightBytes: *maxInFlightBytes,
		MaxChangeBytes:   *maxChangeBytes,
		ClassicPublish:   *classic,
		DrainTimeout:     *drain,
		AckTimeout:       *ackTimeout,
		RecreateSlot:     *recreateSlot,
		MinSilence:       *minSilence,
		StatusInterval:   *statusInterval,
		Logger:           log,
		Registerer:       reg,
	})
	if err != nil {
		return reportFailure(log, err, 0)
	}
	// Run returns only errors no retry can fix. The process lingers after one so that what
	// scrapes and probes it sees why (baton_relay_slot_lost, baton_relay_fatal, /readyz not
	// ready) before it exits and an orchestrator restarts it; with nothing serving, there is
	// nothing to see.
	linger := cfg.Linger()
	if cfg.MetricsAddr == "" {
		linger = 0
	}
	g, gctx := errgroup.WithContext(ctx)
	g.Go(func() error {
		select {
		case <-closed:
			cause := nc.LastError()
			if cause == nil {
				cause = errors.New("connection closed")
			}
			return fmt.Errorf("NATS at %s closed the connection for good (%s): %w",
				natsconn.Servers(cfg.NATSURL), cfg.NATS().Login(), cause)
		case <-gctx.Done():
			return nil
		}
	})
	g.Go(func() error {
		err := r.Run(gctx)
		if err == nil {
			return errStopped // stop the metrics server too
		}
		err = reportFailure(log, fmt.Errorf("relay: %w", err), linger)
		select { // SIGTERM, or the metrics server failing, ends it early
		case <-time.After(linger):
		case <-gctx.Done():
		}
		return err
	})
	if cfg.MetricsAddr != "" {
		g.Go(func() error { return opsserver.Serve(gctx, log, cfg.MetricsAddr, reg, r.Ready) })
	}
	if cfg.PprofAddr != "" {
		g.Go(func() error { return opsserver.ServePprof(gctx, log, cfg.PprofAddr) })
	}
	if err := g.Wait(); err != nil && !errors.Is(err, errStopped) {
		var logged loggedError
		if errors.As(err, &logged) {
			return err
		}
		return reportFailure(log, err, 0)
	}
	return nil
}

// streamSettings turns the BATON_STREAM_* settings into the relay's: there, no age limit is a
// negative MaxAge (0 takes the default).
func streamSettings(l config.StreamLimits) relay.StreamSettings {
	s := relay.StreamSettings{Replicas: l.Replicas, MaxAge: l.MaxAge, MaxBytes: l.MaxBytes, MaxMsgs: l.MaxMsgs, Duplicates: l.Duplicates}
	if s.MaxAge == 0 {
		s.MaxAge = -1
	}
	return s
}

// closeNATS closes nc, waiting at most a second: a write stuck on a server that stopped
// reading holds nats.go's connection lock for up to natsWriteTimeout, and a relay that was
// told to stop has nothing left to send that matters (what was not acknowledged is replayed by
// the next relay). The process exits right after, ending the close if it is still waiting.
func closeNATS(nc *nats.Conn) {
	closed := make(chan struct{})
	go func() {
		defer close(closed)
		nc.Close()
	}()
	select {
	case <-closed:
	case <-time.After(time.Second):
	}
}

// errStopped ends an errgroup when its main task returned cleanly.
var errStopped = errors.New("stopped")

// natsWriteTimeout bounds a write to the NATS server (nats.go's FlusherTimeout, a minute by
// default). A server that stops reading otherwise holds a publish, and nats.go's connection
// lock with it, for that long; past it nats.go drops the connection and reconnects, and the
// relay replays what was not acknowledged.
const natsWriteTimeout = 10 * time.Second

// reportFailure logs err once, at ERROR, saying the process exits in exitIn (as text, "2m0s",
// in every log format), and returns it marked as logged, so that run exits 1 without printing
// it again.
func reportFailure(log *slog.Logger, err error, exitIn time.Duration) error {
	if exitIn > 0 {
		log.Error("relay cannot continue; serving metrics and health (not ready) until it exits", "error", err, "exit_in", exitIn.String())
	} else {
		log.Error("relay cannot continue; exiting", "error", err, "exit_in", exitIn.String())
	}
	return loggedError{err: err}
}

// connectNATS connects with unlimited reconnects: a NATS restart must be survived, not fatal.
// The login and TLS settings come from cfg through natsconn; a login the server refuses ends
// the first attempt with an error naming the servers and the settings used (never a secret),
// and a login refused twice in a row on a reconnect closes the connection (nats.go's default,
// see natsconn's package doc). opts come after Baton's.
func connectNATS(cfg *config.Config, name string, opts ...nats.Option) (*nats.Conn, error) {
	return cfg.NATS().Connect(append([]nats.Option{
		nats.Name(name),
		nats.FlusherTimeout(natsWriteTimeout),
		nats.MaxReconnects(-1),
		nats.ReconnectWait(250 * time.Millisecond),
		nats.ReconnectJitter(100*time.Millisecond, time.Second),
		nats.RetryOnFailedConnect(false),
	}, opts...)...)
}
