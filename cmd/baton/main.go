// Command baton runs Baton: it applies the schema (migrate), relays the outbox to NATS
// JetStream (relay), reports what a running Baton is doing (status) and runs Baton end to end
// on this machine (demo).
//
// Configuration comes from BATON_* environment variables (see internal/config); each
// subcommand's flags override them. Run `baton help` for the list of subcommands.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"os"
	"os/signal"
	"sort"
	"syscall"

	"github.com/batonhq/baton/internal/config"
	"github.com/batonhq/baton/internal/opsserver"
)

// command is one subcommand of baton. Adding a subcommand is one entry in commands.
type command struct {
	// summary is the one line `baton help` shows.
	summary string
	// run parses args (the arguments after the subcommand's name) with a FlagSet of its own,
	// writes results to stdout and logs to stderr, and returns nil, a usage error (exit 2),
	// flag.ErrHelp (exit 0), a loggedError (exit 1) or any other error (printed, exit 1). It
	// returns when ctx ends.
	run func(ctx context.Context, args []string, stdout, stderr io.Writer) error
}

var commands = map[string]command{
	"bench":   {summary: benchSummary, run: runBench},
	"console": {summary: consoleSummary, run: runConsole},
	"demo":    {summary: demoSummary, run: runDemo},
	"migrate": {summary: migrateSummary, run: runMigrate},
	"relay":   {summary: relaySummary, run: runRelay},
	"status":  {summary: statusSummary, run: runStatus},
	"version": {summary: versionSummary, run: runVersion},
}

func main() {
	if version != "dev" {
		opsserver.Version = version
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM, syscall.SIGHUP)
	code := run(ctx, os.Args[1:], os.Stdout, os.Stderr)
	stop()
	os.Exit(code)
}

// run runs the subcommand named by args[0] and returns the process exit code: 0 on success,
// 1 when the command failed (or, for status, something needs attention), 2 on a usage error,
// 3 when status could not check.
func run(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	if len(args) == 0 {
		printUsage(stderr)
		return 2
	}
	name, rest := args[0], args[1:]
	switch name {
	case "help", "-h", "-help", "--help":
		if len(rest) == 0 {
			printUsage(stdout)
			return 0
		}
		// `baton help migrate` is `baton migrate -h` with the flags on stdout.
		name, rest = rest[0], []string{"-h"}
		if _, ok := commands[name]; ok {
			stderr = stdout
		}
	case "-version", "--version":
		name = "version"
	}
	cmd, ok := commands[name]
	if !ok {
		fmt.Fprintf(stderr, "baton: unknown command %q\n\n", name)
		printUsage(stderr)
		return 2
	}
	err := cmd.run(ctx, rest, stdout, stderr)
	var usageErr usageError
	var logged loggedError
	var uncheckable couldNotCheck
	switch {
	case err == nil, errors.Is(err, flag.ErrHelp):
		return 0
	case errors.As(err, &logged):
		return 1
	case errors.As(err, &uncheckable):
		fmt.Fprintf(stderr, "baton %s: %v\n", name, err)
		return 3
	case errors.As(err, &usageErr):
		if usageErr.msg != "" {
			fmt.Fprintf(stderr, "baton %s: %s\n", name, usageErr.msg)
		}
		return 2
	default:
		fmt.Fprintf(stderr, "baton %s: %v\n", name, err)
		return 1
	}
}

func printUsage(w io.Writer) {
	names := make([]string, 0, len(commands))
	for name := range commands {
		names = append(names, name)
	}
	sort.Strings(names)
	fmt.Fprint(w, `Baton moves agent turns from PostgreSQL to NATS JetStream without losing or doubling them.

usage: baton <command> [flags]

commands:
`)
	fmt.Fprintf(w, "  %-9s %s\n", "help", "show this help, or a command's flags: baton help <command>")
	for _, name := range names {
		fmt.Fprintf(w, "  %-9s %s\n", name, commands[name].summary)
	}
	fmt.Fprint(w, `
baton --version is the same as baton version.
Configuration comes from BATON_* environment variables; a command's flags override them.
`)
}

// usageError is a mistake in the command line: exit code 2. An empty msg means the flag
// package already printed the problem and the usage.
type usageError struct{ msg string }

func (e usageError) Error() string {
	if e.msg == "" {
		return "usage error"
	}
	return e.msg
}

// couldNotCheck is a check that could not be made (status could not reach the database):
// exit code 3, apart from 1, "checked, and something needs attention".
type couldNotCheck struct{ err error }

func (e couldNotCheck) Error() string { return e.err.Error() }
func (e couldNotCheck) Unwrap() error { return e.err }

// loggedError is a failure the command already logged through its logger, in the configured
// format: exit code 1, and nothing printed again.
type loggedError struct{ err error }

func (e loggedError) Error() string { return e.err.Error() }
func (e loggedError) Unwrap() error { return e.err }

// newFlagSet returns the FlagSet of subcommand name. It prints errors and usage to stderr;
// description follows the usage line.
func newFlagSet(name, description string, stderr io.Writer) *flag.FlagSet {
	fs := flag.NewFlagSet("baton "+name, flag.ContinueOnError)
	fs.SetOutput(stderr)
	fs.Usage = func() {
		fmt.Fprintf(fs.Output(), "usage: baton %s [flags]\n\n%s\n", name, description)
		hasFlags := false
		fs.VisitAll(func(*flag.Flag) { hasFlags = true })
		if hasFlags {
			fmt.Fprint(fs.Output(), "\nflags:\n")
			fs.PrintDefaults()
		}
	}
	return fs
}

// parseFlags parses args, which must hold flags only. -h gives flag.ErrHelp.
func parseFlags(fs *flag.FlagSet, args []string) error {
	if err := fs.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return err
		}
		return usageError{} // fs printed the error and the usage
	}
	if fs.NArg() > 0 {
		return usageError{msg: fmt.Sprintf("unexpected argument %q (see: baton help %s)", fs.Arg(0), fs.Name()[len("baton "):])}
	}
	return nil
}

// configure reads the configuration from the environment, binds flags overriding the named
// variables plus the log level and format, parses args, reads the files the configuration
// names and validates the result (config.Resolve). It
// returns the configuration and a logger writing to stderr.
func configure(fs *flag.FlagSet, args []string, stderr io.Writer, vars ...string) (*config.Config, *slog.Logger, error) {
	cfg, err := config.FromEnv()
	if err != nil {
		return nil, nil, err
	}
	cfg.BindFlags(fs, append(vars, config.EnvLogLevel, config.EnvLogFormat)...)
	if err := parseFlags(fs, args); err != nil {
		return nil, nil, err
	}
	if err := cfg.Resolve(); err != nil {
		return nil, nil, fmt.Errorf("invalid configuration:\n%w", err)
	}
	return &cfg, cfg.Logger(stderr), nil
}
