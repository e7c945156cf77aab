// Package demo runs a load of user messages through a running Baton and checks that each got
// exactly one outcome: what `baton demo` shows.
//
// A run is gathered, judged and rendered, in that order. Demo.Run sends the messages with the
// producer (some twice with the same id, as a retrying client would), follows the turns and
// outcomes streams with ordered consumers, keeps what it saw in a ledger and reads the run's
// rows back from the database; it returns a Result. Result.Verdict judges it (nothing lost,
// nothing doubled) and WriteSummary prints it; both are pure functions of the Result.
//
// The package starts no servers, relay or workers: the caller runs them and hands Run what it
// needs (Services). Every id a run writes starts with its RunID, so a run counts only its own
// messages on streams and databases that carry other traffic.
package demo

import (
	"errors"
	"fmt"
	"io"
	"log/slog"
	"strconv"
	"strings"
	"time"

	"github.com/batonhq/baton/wire"
)

// Defaults of Config.
const (
	DefaultMessages      = 1000
	DefaultConversations = 50
	DefaultTailTimeout   = 60 * time.Second
	// DefaultRate is the rate `baton demo` sends at. A zero Config.Rate sends as fast as possible.
	DefaultRate = 500
)

const (
	// Senders is how many goroutines call Send at once, at most. Run's pool needs Senders
	// connections, plus two for its own queries.
	Senders = 8
	// StartTimeout bounds waiting for the relay to stream; callers use it to bound starting
	// the servers and the relay too.
	StartTimeout = 2 * time.Minute
	// retryEvery makes every retryEvery-th message a retry candidate: 5%.
	retryEvery = 20
	// interruptGrace is how long an interrupted run still waits for the outcomes of the
	// messages it sent before it stops the workers.
	interruptGrace = 5 * time.Second
	// outcomeGrace is how long a run waits, after the workers stopped, for the outcomes of
	// turns that finished during their shutdown grace.
	outcomeGrace = time.Second
)

// Config is one run.
type Config struct {
	// RunID prefixes every conversation and message id the run writes. Default "demo-"
	// followed by the current time in nanoseconds, base 36.
	RunID string
	// Messages is how many messages to send. Default DefaultMessages.
	Messages int
	// Conversations is how many conversations the messages are spread over. Default
	// DefaultConversations.
	Conversations int
	// Rate is messages per second. Default 0: as fast as possible.
	Rate float64
	// TailTimeout is how long, after the last send, Run waits for every message's outcome.
	// Default DefaultTailTimeout.
	TailTimeout time.Duration

	// SubjectPrefix names the streams Run follows. Default wire.DefaultSubjectPrefix.
	SubjectPrefix string
	// Slot is the relay's replication slot, as Run reports it. No default.
	Slot string

	// Workers names the workers that answer the turns, as Run reports them. No default.
	Workers []string
	// ModelLatency is how long each of the workers' model calls takes, as Run reports it.
	// Default 0.
	ModelLatency time.Duration
	// MaxAttempts is how many attempts the workers make before a request fails visibly, as
	// Run and the summary report it. Default 0 (not reported).
	MaxAttempts int
	// FailEvery makes every turn of every FailEvery-th conversation of the run fail
	// (TurnFailure); the summary reports it. Default 0: none.
	FailEvery int

	// Out receives what Run reports while it runs: the steps and the progress line. Default
	// io.Discard.
	Out io.Writer
	// TTY updates the progress line in place (Out is a terminal) instead of printing one line
	// a second. Default false.
	TTY bool
	// Logger receives warnings (a failed send retried, an undecodable event). Default: discard.
	Logger *slog.Logger
}

// Demo is one run. Build it with New.
type Demo struct {
	cfg      Config
	stream   string // the turns stream
	outcomes string // the outcomes stream
	ledger   ledger
}

// New fills cfg's defaults and validates it.
func New(cfg Config) (*Demo, error) {
	if cfg.RunID == "" {
		cfg.RunID = "demo-" + strconv.FormatInt(time.Now().UnixNano(), 36)
	}
	if cfg.Messages == 0 {
		cfg.Messages = DefaultMessages
	}
	if cfg.Conversations == 0 {
		cfg.Conversations = DefaultConversations
	}
	if cfg.TailTimeout == 0 {
		cfg.TailTimeout = DefaultTailTimeout
	}
	if cfg.SubjectPrefix == "" {
		cfg.SubjectPrefix = wire.DefaultSubjectPrefix
	}
	if cfg.Out == nil {
		cfg.Out = io.Discard
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.New(slog.DiscardHandler)
	}
	var problems []error
	check := func(bad bool, msg string) {
		if bad {
			problems = append(problems, errors.New(msg))
		}
	}
	check(cfg.Messages < 0, "Messages must not be negative")
	check(cfg.Conversations < 0, "Conversations must not be negative")
	check(cfg.Rate < 0, "Rate must not be negative")
	check(cfg.TailTimeout < 0, "TailTimeout must not be negative")
	check(cfg.ModelLatency < 0, "ModelLatency must not be negative")
	check(cfg.MaxAttempts < 0, "MaxAttempts must not be negative")
	check(cfg.FailEvery < 0, "FailEvery must not be negative")
	if err := errors.Join(problems...); err != nil {
		return nil, fmt.Errorf("demo config: %w", err)
	}
	return &Demo{
		cfg:      cfg,
		stream:   wire.StreamName(cfg.SubjectPrefix, wire.KindTurns),
		outcomes: wire.StreamName(cfg.SubjectPrefix, wire.KindOutcomes),
	}, nil
}

// RunID is the prefix of every id the run writes.
func (d *Demo) RunID() string { return d.cfg.RunID }

func (d *Demo) convPrefix() string  { return d.cfg.RunID + "-c" }
func (d *Demo) convID(i int) string { return d.convPrefix() + strconv.Itoa(i) }
func (d *Demo) msgPrefix() string   { return d.cfg.RunID + "-m" }
func (d *Demo) msgID(i int) string  { return d.msgPrefix() + strconv.Itoa(i) }

// printf writes a step or progress line to Config.Out. The lines are best effort: a failed
// write stops nothing, and WriteSummary reports its own write errors.
func (d *Demo) printf(format string, args ...any) { _, _ = fmt.Fprintf(d.cfg.Out, format, args...) }

// TurnFailure is the error a worker's handler returns for a turn of conversation conv when
// the run makes it fail on purpose (Config.FailEvery), and nil otherwise.
func (d *Demo) TurnFailure(conv string) error {
	if !d.fails(conv) {
		return nil
	}
	return fmt.Errorf("the demo fails every turn of every %dth conversation (--fail-every)", d.cfg.FailEvery)
}

// fails reports whether the turns of conversation conv fail on purpose: every FailEvery-th of
// the run's conversations. Conversations that are not the run's never fail.
func (d *Demo) fails(conv string) bool {
	if d.cfg.FailEvery <= 0 {
		return false
	}
	rest, ok := strings.CutPrefix(conv, d.convPrefix())
	if !ok {
		return false
	}
	i, err := strconv.Atoi(rest)
	return err == nil && i >= 0 && (i+1)%d.cfg.FailEvery == 0
}
