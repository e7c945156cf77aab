// Command subscriber prints every Baton outcome once: each assistant reply and each visible
// error the relay publishes to <prefix>.outcomes.<conv> (stream AGENT_OUTCOMES for the default
// prefix). Copy it as the start of any service that reacts to replies: push notifications,
// search indexing, analytics. Replace printer.handle's Fprintf with your side effect.
//
//	export BATON_NATS_URL=nats://localhost:4222   # BATON_SUBJECT_PREFIX too, if not "agent"
//	export BATON_NATS_CREDS=/run/secrets/subscriber.creds   # if your NATS wants a login (see package natsconn)
//	go run ./examples/subscriber                                             # all, then new ones
//	go run ./examples/subscriber --conversation conv-42                      # one conversation's
//	go run ./examples/subscriber --durable replay --since 2026-11-30T00:00:00Z
//	go run ./examples/subscriber --durable from-42 --from-seq 42
//
// It prints one line per outcome:
//
//	seq=7 conversation=conv-42 role=assistant message=baton:reply:0c5e… answers=17,18 content="The Q3 numbers…"
//
// seq is the stream sequence (what --from-seq takes); answers are the outbox ids the reply
// answers ("-" when the worker did not say, as for a message inserted by hand).
//
// With --json it prints each outcome as one JSON object instead, for programs (the end-to-end
// tests read it): the event's fields (wire.OutcomeEvent: message_id, conversation_id, role,
// content in full, outbox_ids, ...) and "seq", the stream sequence.
//
// It is built on wire.OutcomeSubscriber, which holds the delivery rules; this file only wires
// configuration, the connection and the printing.
//
// With OTEL_EXPORTER_OTLP_ENDPOINT (or the other OTEL_* variables of package tracing) each
// outcome handled is a span, "outcome", in the trace of the message it answers.
//
// # Position
//
// The subscriber reads through a durable consumer of its own (--durable, default
// "outcome-printer"): JetStream remembers what it acked, so a restart continues where the last
// run stopped, and several processes with the same --durable share the work. --since (an
// RFC 3339 time) and --from-seq choose where a NEW durable starts; without them it starts at
// the beginning of the stream. An existing durable keeps its position and ignores both: to
// start over, pick a new --durable or delete the old one (nats consumer rm AGENT_OUTCOMES <name>).
// A durable keeps the filter it was created with: --conversation needs a durable of its own.
//
// # Duplicates
//
// JetStream delivers at least once: a message not acked within the ack wait (a crash between
// printing and acking, a lost ack) is delivered again. And the relay, replaying after a crash,
// may publish an outcome again; JetStream drops the repeat by Nats-Msg-Id only within the
// stream's duplicate window (default 2 minutes), so a replay later than that stores the outcome
// twice. The Baton message id is the idempotency key: the same reply always has the same id.
// The subscriber remembers the last --remember ids it printed (at most a million) and skips
// those. That covers redeliveries and replays while it runs; for effects that must happen once
// across restarts, record the message id in your own store in the same transaction as the
// effect (for example a table with the message id as primary key) and skip ids already there.
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
	"os/signal"
	"strconv"
	"strings"
	"syscall"
	"time"
	"unicode"

	"github.com/nats-io/nats.go"
	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/propagation"

	"github.com/batonhq/baton/natsconn"
	"github.com/batonhq/baton/tracing"
	"github.com/batonhq/baton/wire"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM, syscall.SIGHUP)
	err := run(ctx)
	stop()
	if err != nil {
		fmt.Fprintln(os.Stderr, "subscriber:", err)
		os.Exit(1)
	}
}

func run(ctx context.Context) error {
	// Configuration comes from the environment; flags override it.
	// The URL may come from a file (BATON_NATS_URL_FILE), the login and TLS from files too.
	natsURL, natsURLFile := os.Getenv(natsconn.EnvURL), os.Getenv(natsconn.EnvURLFile)
	sec := natsconn.Settings{Creds: os.Getenv(natsconn.EnvCreds), NKey: os.Getenv(natsconn.EnvNKey),
		CA: os.Getenv(natsconn.EnvCA), Cert: os.Getenv(natsconn.EnvCert), Key: os.Getenv(natsconn.EnvKey)}
	prefix := envOr("BATON_SUBJECT_PREFIX", wire.DefaultSubjectPrefix)
	logLevel := envOr("BATON_LOG_LEVEL", "info")
	logFormat := envOr("BATON_LOG_FORMAT", "text")
	flag.Var(envFlag{&natsURL}, "nats-url", "NATS server `url`s, comma-separated [env BATON_NATS_URL]")
	flag.Var(envFlag{&natsURLFile}, "nats-url-file", "`file` holding the NATS url(s) [env BATON_NATS_URL_FILE]")
	flag.Var(envFlag{&sec.Creds}, "nats-creds", "NATS user credentials `file` (.creds) [env BATON_NATS_CREDS]")
	flag.Var(envFlag{&sec.NKey}, "nats-nkey", "`file` holding a NATS user nkey seed [env BATON_NATS_NKEY]")
	flag.Var(envFlag{&sec.CA}, "nats-ca", "PEM `file` of the CAs that verify the NATS server [env BATON_NATS_CA]")
	flag.Var(envFlag{&sec.Cert}, "nats-cert", "PEM client certificate `file` for NATS [env BATON_NATS_CERT]")
	flag.Var(envFlag{&sec.Key}, "nats-key", "PEM private key `file` of --nats-cert [env BATON_NATS_KEY]")
	flag.Var(envFlag{&prefix}, "subject-prefix", "subject `prefix` (default agent) [env BATON_SUBJECT_PREFIX]")
	flag.Var(envFlag{&logLevel}, "log-level", "log `level`: debug, info, warn, error (default info) [env BATON_LOG_LEVEL]")
	flag.Var(envFlag{&logFormat}, "log-format", "log `format`: text or json (default text) [env BATON_LOG_FORMAT]")
	durable := flag.String("durable", "outcome-printer", "durable consumer `name`: keeps this subscriber's position across restarts")
	conversation := flag.String("conversation", "", "print only this conversation's outcomes (`id`; needs a durable of its own)")
	since := flag.String("since", "", "a new durable starts at this RFC 3339 `time` (e.g. 2026-11-30T00:00:00Z)")
	fromSeq := flag.Uint64("from-seq", 0, "a new durable starts at this stream `sequence`")
	maxContent := flag.Int("max-content", 80, "print at most this many characters of content")
	remember := flag.Int("remember", wire.DefaultSubscriberDedupeWindow, fmt.Sprintf("how many message ids to remember for skipping duplicates (1 to %d)", wire.MaxSubscriberDedupeWindow))
	asJSON := flag.Bool("json", false, "print each outcome as one JSON object (the event's fields and seq), content in full")
	flag.Parse()
	if flag.NArg() > 0 {
		return fmt.Errorf("unexpected argument %q", flag.Arg(0))
	}
	var err error
	if sec.URL, err = natsconn.ValueOrFile(natsconn.EnvURL, natsURL, natsconn.EnvURLFile, natsURLFile); err != nil {
		return err
	}
	if sec.URL == "" {
		return errors.New("BATON_NATS_URL is not set: set it or pass --nats-url")
	}
	log, err := newLogger(logLevel, logFormat)
	if err != nil {
		return err
	}
	var start time.Time
	switch {
	case *since != "" && *fromSeq != 0:
		return errors.New("--since and --from-seq exclude each other")
	case *since != "":
		if start, err = time.Parse(time.RFC3339, *since); err != nil {
			return fmt.Errorf("--since: want an RFC 3339 time like 2026-11-30T00:00:00Z: %w", err)
		}
	}
	// The subscriber allocates the whole window when it starts: wire bounds it.
	if *remember < 1 || *remember > wire.MaxSubscriberDedupeWindow {
		return fmt.Errorf("--remember must be 1 to %d (wire.MaxSubscriberDedupeWindow), not %d", wire.MaxSubscriberDedupeWindow, *remember)
	}
	if *maxContent < 1 {
		return errors.New("--max-content must be at least 1")
	}

	// A refused login ends here, with an error naming the servers and the settings.
	nc, err := sec.Connect(nats.Name("outcome-subscriber"), nats.MaxReconnects(-1))
	if err != nil {
		return err
	}
	defer nc.Close()

	// Traces, when the OTEL_* variables ask for them; off otherwise. Flushed on the way out.
	shutdownTracing, err := tracing.Setup(ctx)
	if err != nil {
		return err
	}
	defer tracing.Stop(ctx, shutdownTracing, log)

	p := &printer{out: os.Stdout, maxContent: *maxContent, json: *asJSON}
	sub, err := wire.NewOutcomeSubscriber(wire.OutcomeSubscriberConfig{
		NATS:           nc,
		Durable:        *durable,
		Handler:        p.handle,
		ConversationID: *conversation,
		SubjectPrefix:  prefix,
		StartTime:      start,
		StartSeq:       *fromSeq,
		DedupeWindow:   *remember,
		Logger:         log,
	})
	if err != nil {
		return err
	}
	// Until SIGINT or SIGTERM. An outcome received but not yet printed is not acked:
	// JetStream delivers it again to the next run.
	return sub.Run(ctx)
}

// printer prints outcomes, one line each.
type printer struct {
	out        io.Writer
	maxContent int
	json       bool // one JSON object per outcome instead of the text line
}

// jsonLine is what --json prints for an outcome: its event's fields and its stream sequence.
type jsonLine struct {
	Seq uint64 `json:"seq"`
	wire.OutcomeEvent
}

// handle prints one outcome, in a span of the outcome's trace. An error (the output is gone)
// has it delivered again; returning nil has it acked.
func (p *printer) handle(ctx context.Context, o wire.Outcome) error {
	ctx = propagation.TraceContext{}.Extract(ctx, propagation.MapCarrier{wire.HeaderTraceparent: o.Traceparent})
	_, span := otel.Tracer("github.com/batonhq/baton/examples/subscriber").Start(ctx, "outcome")
	defer span.End()
	span.SetAttributes(attribute.String("baton.message_id", o.Event.MessageID),
		attribute.String("baton.conversation_id", o.Event.ConversationID))
	ev := o.Event
	if p.json {
		line, err := json.Marshal(jsonLine{Seq: o.StreamSeq, OutcomeEvent: ev})
		if err != nil {
			return fmt.Errorf("encode outcome: %w", err)
		}
		if _, err := p.out.Write(append(line, '\n')); err != nil {
			return fmt.Errorf("print outcome: %w", err)
		}
		return nil
	}
	content := strconv.Quote(truncate(ev.Content, p.maxContent))
	if ev.ContentOmitted { // too large for NATS: read it from the messages table by id
		content = fmt.Sprintf("(omitted: %d bytes)", ev.ContentBytes)
	}
	_, err := fmt.Fprintf(p.out, "seq=%d conversation=%s role=%s message=%s answers=%s content=%s\n",
		o.StreamSeq, word(ev.ConversationID), word(ev.Role), word(ev.MessageID), joinIDs(ev.OutboxIDs), content)
	if err != nil {
		return fmt.Errorf("print outcome: %w", err)
	}
	return nil
}

// envOr returns the environment variable name, or def when it is unset or empty.
func envOr(name, def string) string {
	if v := os.Getenv(name); v != "" {
		return v
	}
	return def
}

// envFlag is a flag that overrides a value read from the environment. Its String is empty, so
// -h never prints the value, which may hold a password.
type envFlag struct{ p *string }

func (f envFlag) String() string     { return "" }
func (f envFlag) Set(s string) error { *f.p = s; return nil }

// newLogger returns a logger writing to stderr at level ("debug", "info", "warn", "error")
// in format ("text" or "json").
func newLogger(level, format string) (*slog.Logger, error) {
	var l slog.Level
	if err := l.UnmarshalText([]byte(level)); err != nil {
		return nil, fmt.Errorf("log level must be debug, info, warn or error (got %q)", level)
	}
	opts := &slog.HandlerOptions{Level: l}
	switch format {
	case "text":
		return slog.New(slog.NewTextHandler(os.Stderr, opts)), nil
	case "json":
		return slog.New(slog.NewJSONHandler(os.Stderr, opts)), nil
	}
	return nil, fmt.Errorf("log format must be text or json (got %q)", format)
}

// truncate shortens s to n characters, marking the cut with "…".
func truncate(s string, n int) string {
	if len(s) <= n { // fewer bytes than n means fewer characters too
		return s
	}
	runes := []rune(s)
	if len(runes) <= n {
		return s
	}
	return string(runes[:n]) + "…"
}

// word prints an id as it is when it is one printable word, quoted otherwise, so that every
// outcome stays one line whatever its ids hold.
func word(s string) string {
	if s != "" && strings.IndexFunc(s, func(r rune) bool { return r == '"' || unicode.IsSpace(r) || !unicode.IsPrint(r) }) < 0 {
		return s
	}
	return strconv.Quote(s)
}

func joinIDs(ids []int64) string {
	if len(ids) == 0 {
		return "-"
	}
	parts := make([]string, len(ids))
	for i, id := range ids {
		parts[i] = strconv.FormatInt(id, 10)
	}
	return strings.Join(parts, ",")
}
