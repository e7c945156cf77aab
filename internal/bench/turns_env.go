package bench

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/batonhq/baton/internal/config"
	"github.com/batonhq/baton/internal/throwaway"
	"github.com/batonhq/baton/migrations"
	"github.com/batonhq/baton/natsconn"
	"github.com/batonhq/baton/wire"
)

const (
	// turnsStartTimeout bounds starting the servers and each phase's setup and teardown.
	turnsStartTimeout = 2 * time.Minute
	// turnsConnectTimeout bounds connecting when the connection string sets no connect_timeout.
	turnsConnectTimeout = 30 * time.Second
	// turnsRelayStopWait is how long the relay may take to stop after SIGTERM (its drain
	// timeout is 10s) before it is killed.
	turnsRelayStopWait = 15 * time.Second
	// turnsSchema and turnsPublication are Baton's schema and publication in the bench's
	// databases, which hold nothing else.
	turnsSchema      = "public"
	turnsPublication = "baton"
)

// ErrTurnsNoPostgres says how to give the bench a PostgreSQL when the server binaries are missing.
var ErrTurnsNoPostgres = errors.New("the bench needs PostgreSQL and found no server binaries (initdb, postgres) to start a " +
	"throwaway cluster with.\n" +
	"  Install them: Debian/Ubuntu `apt-get install -y postgresql`, Fedora `dnf install -y postgresql-server`, " +
	"macOS `brew install postgresql`;\n" +
	"  or set BATON_DATABASE_URL (or --database-url) to a PostgreSQL 15+ server running with wal_level=logical, " +
	"as a role that may create databases and replicate: the bench creates databases of its own there")

// turnsEnv is what every phase runs on: a PostgreSQL server on which each phase creates a
// database, and a NATS server on which each phase's relay creates streams.
type turnsEnv struct {
	cfg         *TurnsConfig
	databaseURL string // the server's, as given or of the throwaway cluster
	natsCfg     natsconn.Settings
	postgres    string // what the report says of the server: throwaway, or the redacted URL
	nats        string
	admin       *pgxpool.Pool
	nc          *nats.Conn // the bench's own: deletes each phase's streams
	js          jetstream.JetStream
	runID       string // names this run's databases, slots and streams
	seq         int
	stops       []func() error // undo what was started, in reverse order
}

// startTurnsEnv starts the servers cfg does not name and connects to both. Starting is not cut
// short by ctx (a half-started server would escape the cleanup); ctx's end is checked after.
func startTurnsEnv(ctx context.Context, cfg *TurnsConfig) (_ *turnsEnv, err error) {
	e := &turnsEnv{cfg: cfg, databaseURL: cfg.DatabaseURL, natsCfg: cfg.NATS}
	defer func() {
		if err != nil {
			err = errors.Join(err, e.close())
		}
	}()
	startCtx, cancel := context.WithTimeout(context.WithoutCancel(ctx), turnsStartTimeout)
	defer cancel()
	id := make([]byte, 4)
	if _, err := rand.Read(id); err != nil {
		return nil, fmt.Errorf("run id: %w", err)
	}
	e.runID = hex.EncodeToString(id)

	if e.databaseURL == "" {
		e.progressf("starting a throwaway PostgreSQL cluster (no BATON_DATABASE_URL)\n")
		// On TCP, as workers reach their database in production.
		pg, err := throwaway.StartPostgresWith(startCtx, throwaway.PostgresOptions{TCP: true})
		if errors.Is(err, throwaway.ErrNoPostgres) {
			return nil, ErrTurnsNoPostgres
		}
		if err != nil {
			return nil, fmt.Errorf("start a throwaway PostgreSQL: %w", err)
		}
		e.stops = append(e.stops, func() error {
			if err := pg.Close(); err != nil {
				return fmt.Errorf("remove the throwaway PostgreSQL: %w", err)
			}
			return nil
		})
		e.databaseURL = pg.TCPURL("postgres")
		e.postgres = fmt.Sprintf("throwaway cluster on 127.0.0.1:%d (fsync off)", pg.Port)
	} else {
		e.postgres = config.Redact(e.databaseURL)
	}
	if e.natsCfg.URL == "" {
		dir, err := os.MkdirTemp("", "baton-bench-nats-")
		if err != nil {
			return nil, fmt.Errorf("NATS store dir: %w", err)
		}
		e.stops = append(e.stops, func() error {
			if err := os.RemoveAll(dir); err != nil {
				return fmt.Errorf("remove the NATS store: %w", err)
			}
			return nil
		})
		srv, err := throwaway.StartNATS(dir, 0)
		if err != nil {
			return nil, fmt.Errorf("start an embedded NATS server: %w", err)
		}
		e.stops = append(e.stops, func() error { srv.Stop(); return nil })
		e.natsCfg = natsconn.Settings{URL: srv.URL()}
		e.nats = "embedded in this process, " + srv.URL()
	} else {
		e.nats = config.Redact(e.natsCfg.URL)
	}
	if ctx.Err() != nil {
		return nil, ctx.Err()
	}

	pcfg, err := e.poolConfig(e.databaseURL, 4)
	if err != nil {
		return nil, err
	}
	admin, err := pgxpool.NewWithConfig(startCtx, pcfg)
	if err != nil {
		return nil, fmt.Errorf("connect to PostgreSQL: %w", err)
	}
	e.stops = append(e.stops, func() error { admin.Close(); return nil })
	e.admin = admin
	var walLevel string
	if err := admin.QueryRow(startCtx, "SHOW wal_level").Scan(&walLevel); err != nil {
		return nil, fmt.Errorf("connect to PostgreSQL: %w", err)
	}
	if walLevel != "logical" {
		return nil, fmt.Errorf("PostgreSQL runs with wal_level=%s; the relay needs wal_level=logical", walLevel)
	}
	nc, err := e.natsCfg.Connect(nats.Name("baton-bench"))
	if err != nil {
		return nil, err
	}
	e.stops = append(e.stops, func() error { nc.Close(); return nil })
	e.nc = nc
	if e.js, err = jetstream.New(nc); err != nil {
		return nil, fmt.Errorf("jetstream: %w", err)
	}
	return e, nil
}

// close stops and removes what startTurnsEnv started.
func (e *turnsEnv) close() error {
	var errs []error
	for i := len(e.stops) - 1; i >= 0; i-- {
		errs = append(errs, e.stops[i]())
	}
	e.stops = nil
	return errors.Join(errs...)
}

func (e *turnsEnv) progressf(format string, args ...any) {
	_, _ = fmt.Fprintf(e.cfg.Progress, format, args...) // progress only: nothing to do when it fails
}

// poolConfig is a pool of at most maxConns on url, with Baton's schema on the search_path.
func (e *turnsEnv) poolConfig(url string, maxConns int32) (*pgxpool.Config, error) {
	pcfg, err := pgxpool.ParseConfig(url)
	if err != nil {
		return nil, fmt.Errorf("not a usable PostgreSQL connection string: %s", config.Redact(url))
	}
	pcfg.MaxConns = maxConns
	if pcfg.ConnConfig.ConnectTimeout == 0 {
		pcfg.ConnConfig.ConnectTimeout = turnsConnectTimeout
	}
	pcfg.ConnConfig.RuntimeParams["search_path"] = pgx.Identifier{turnsSchema}.Sanitize()
	return pcfg, nil
}

// turnsDB is one phase's database, with the names of its slot and streams.
type turnsDB struct {
	name   string // the database's, also the relay's slot
	url    string
	prefix string        // subject prefix: the phase's streams
	pool   *pgxpool.Pool // the bench's own: producers and queries
}

// newDatabase creates and migrates a database for one phase. dropDatabase removes it.
func (e *turnsEnv) newDatabase(ctx context.Context) (_ *turnsDB, err error) {
	e.seq++
	name := fmt.Sprintf("baton_bench_%s_%d", e.runID, e.seq)
	db := &turnsDB{name: name, prefix: fmt.Sprintf("bench_%s_%d", e.runID, e.seq)}
	if db.url, err = withDatabase(e.databaseURL, name); err != nil {
		return nil, err
	}
	if _, err := e.admin.Exec(ctx, "CREATE DATABASE "+pgx.Identifier{name}.Sanitize()); err != nil {
		return nil, fmt.Errorf("create database %s: %w", name, err)
	}
	defer func() {
		if err != nil {
			err = errors.Join(err, e.dropDatabase(context.WithoutCancel(ctx), db))
		}
	}()
	pcfg, err := e.poolConfig(db.url, turnsProducers+2)
	if err != nil {
		return nil, err
	}
	if db.pool, err = pgxpool.NewWithConfig(ctx, pcfg); err != nil {
		return nil, fmt.Errorf("connect to database %s: %w", name, err)
	}
	if err := checkDatabase(ctx, db.pool, name); err != nil {
		return nil, err
	}
	if _, err := migrations.UpWith(ctx, db.pool, migrations.Options{Schema: turnsSchema, Publication: turnsPublication}); err != nil {
		return nil, fmt.Errorf("apply migrations to %s: %w", name, err)
	}
	return db, nil
}

// dropDatabase removes a phase's database, its replication slot and its streams. The relay
// and the workers must have stopped.
func (e *turnsEnv) dropDatabase(ctx context.Context, db *turnsDB) error {
	ctx, cancel := context.WithTimeout(ctx, turnsStartTimeout)
	defer cancel()
	if db.pool != nil {
		db.pool.Close()
	}
	var errs []error
	for _, kind := range []string{wire.KindTurns, wire.KindOutcomes, wire.KindDeadLetter} {
		name := wire.StreamName(db.prefix, kind)
		if err := e.js.DeleteStream(ctx, name); err != nil && !errors.Is(err, jetstream.ErrStreamNotFound) {
			errs = append(errs, fmt.Errorf("delete stream %s: %w", name, err))
		}
	}
	if err := e.dropSlots(ctx, db.name); err != nil {
		errs = append(errs, err)
	}
	if _, err := e.admin.Exec(ctx, "DROP DATABASE IF EXISTS "+pgx.Identifier{db.name}.Sanitize()+" WITH (FORCE)"); err != nil {
		errs = append(errs, fmt.Errorf("drop database %s: %w", db.name, err))
	}
	return errors.Join(errs...)
}

// dropSlots drops the replication slots of database db (a slot holds WAL, and keeps the
// database from being dropped). A walsender that has not exited yet is terminated: it
// releases its slot asynchronously, so dropping is retried until ctx ends.
func (e *turnsEnv) dropSlots(ctx context.Context, db string) error {
	tick := time.NewTicker(20 * time.Millisecond)
	defer tick.Stop()
	for {
		if _, err := e.admin.Exec(ctx, `SELECT pg_terminate_backend(active_pid) FROM pg_replication_slots
			WHERE database = $1 AND active_pid IS NOT NULL`, db); err != nil {
			return fmt.Errorf("stop the walsenders of %s: %w", db, err)
		}
		// Fails with 55006 (object in use) when a terminated walsender still holds the slot.
		_, dropErr := e.admin.Exec(ctx, `SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots
			WHERE database = $1 AND active_pid IS NULL`, db)
		var left int
		if err := e.admin.QueryRow(ctx, `SELECT count(*) FROM pg_replication_slots WHERE database = $1`, db).Scan(&left); err != nil {
			return fmt.Errorf("count the replication slots of %s: %w", db, err)
		}
		if left == 0 {
			return nil
		}
		select {
		case <-tick.C:
		case <-ctx.Done():
			return fmt.Errorf("drop the replication slots of %s: %d left: %w", db, left, errors.Join(ctx.Err(), dropErr))
		}
	}
}

// startRelay starts the relay process for db; ctx's end stops it with SIGTERM (and kills it
// turnsRelayStopWait later). The caller waits for it with Wait.
func (e *turnsEnv) startRelay(ctx context.Context, db *turnsDB) (*exec.Cmd, error) {
	name, args := e.cfg.RelayCommand[0], e.cfg.RelayCommand[1:]
	cmd := exec.CommandContext(ctx, name, args...) //nolint:gosec // G204: the baton binary the caller chose to run the relay with
	cmd.Env = e.relayEnv(db)
	cmd.Stderr = e.cfg.Progress // its logs, at BATON_LOG_LEVEL (warn unless chosen)
	cmd.Cancel = func() error { return cmd.Process.Signal(syscall.SIGTERM) }
	cmd.WaitDelay = turnsRelayStopWait
	// The relay dies with the bench, even when the bench is killed: its slot would hold WAL.
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	if err := cmd.Start(); err != nil {
		return nil, fmt.Errorf("start the relay (%s): %w", strings.Join(e.cfg.RelayCommand, " "), err)
	}
	return cmd, nil
}

// relayEnv is this process's environment without its BATON_* variables, plus the relay's
// configuration for db: a slot and streams of its own.
func (e *turnsEnv) relayEnv(db *turnsDB) []string {
	var env []string
	for _, kv := range os.Environ() {
		if !strings.HasPrefix(kv, "BATON_") {
			env = append(env, kv)
		}
	}
	env = append(env, e.natsCfg.Environ()...)
	return append(env,
		config.EnvDatabaseURL+"="+db.url,
		config.EnvSubjectPrefix+"="+db.prefix,
		config.EnvSlot+"="+db.name,
		config.EnvPublication+"="+turnsPublication,
		config.EnvSchema+"="+turnsSchema,
		config.EnvLogLevel+"="+e.cfg.LogLevel,
		config.EnvLogFormat+"="+e.cfg.LogFormat,
	)
}

// turnsSyncWriter serialises writes to w: the bench's progress lines and the relay's logs
// (copied by os/exec from a goroutine of its own) share it.
type turnsSyncWriter struct {
	mu sync.Mutex
	w  io.Writer
}

func (s *turnsSyncWriter) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	n, err := s.w.Write(p)
	if err != nil {
		return n, fmt.Errorf("progress: %w", err)
	}
	return n, nil
}
