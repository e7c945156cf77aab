package bench

import (
	"context"
	"errors"
	"fmt"
	"math"
	"net"
	"net/url"
	"os"
	"strconv"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/batonhq/baton/internal/opsserver"
	"github.com/batonhq/baton/migrations"
	"github.com/batonhq/baton/wire"
)

// publication is the publication of the bench's database: migrations' default.
const publication = "baton"

// conversations is how many conversations the bench database holds: c0000 … c0999.
const conversations = 1000

// env is one run's database and NATS connection, and the names it hands out.
type env struct {
	cfg      *Config
	runID    string
	dbName   string
	dbURL    string
	pool     *pgxpool.Pool
	nc       *nats.Conn
	js       jetstream.JetStream
	localPG  bool // the server's processes are on this machine: walsender CPU is measurable
	pgServer string
	maxSlots int
	seq      int
}

// openEnv creates the run's database on cfg.DatabaseURL's server, migrates it and connects to
// NATS. close undoes it all; call it on every path once openEnv returned nil.
func openEnv(ctx context.Context, cfg *Config) (*env, error) {
	e := &env{cfg: cfg, runID: strconv.FormatInt(time.Now().UnixNano()%(1<<40), 36)}
	e.dbName = "baton_bench_" + e.runID
	pcfg, err := pgconn.ParseConfig(cfg.DatabaseURL)
	if err != nil {
		return nil, fmt.Errorf("database URL: %w", err)
	}
	e.localPG = isLocalHost(pcfg.Host)
	admin, err := pgx.Connect(ctx, cfg.DatabaseURL)
	if err != nil {
		return nil, fmt.Errorf("connect to PostgreSQL: %w", err)
	}
	defer func() { _ = admin.Close(context.WithoutCancel(ctx)) }()
	if e.pgServer, e.maxSlots, err = serverFacts(ctx, admin); err != nil {
		return nil, err
	}
	used, err := usedSlots(ctx, admin)
	if err != nil {
		return nil, err
	}
	if free, need := e.maxSlots-used, cfg.slotsNeeded(); free < need {
		return nil, fmt.Errorf("this run needs %d replication slots at once and the server has %d free "+
			"(max_replication_slots = %d): lower --rounds or raise max_replication_slots", need, free, e.maxSlots)
	}
	if err := createDatabase(ctx, admin, e.dbName); err != nil {
		return nil, err
	}
	if e.dbURL, err = withDatabase(cfg.DatabaseURL, e.dbName); err != nil {
		return nil, errors.Join(err, dropDatabase(context.WithoutCancel(ctx), admin, e.dbName))
	}
	if err := e.open(ctx); err != nil {
		e.close(ctx)
		return nil, err
	}
	return e, nil
}

// open connects to the run's database, migrates it, creates its conversations and connects
// to NATS.
func (e *env) open(ctx context.Context) error {
	pcfg, err := pgxpool.ParseConfig(e.dbURL)
	if err != nil {
		return fmt.Errorf("database URL: %w", err)
	}
	pcfg.MaxConns = producers + 4
	if e.pool, err = pgxpool.NewWithConfig(ctx, pcfg); err != nil {
		return fmt.Errorf("connect to %s: %w", e.dbName, err)
	}
	if err := checkDatabase(ctx, e.pool, e.dbName); err != nil {
		return err
	}
	if _, err := migrations.Up(ctx, e.pool); err != nil {
		return fmt.Errorf("migrate %s: %w", e.dbName, err)
	}
	if err := createConversations(ctx, e.pool, conversations); err != nil {
		return err
	}
	if e.cfg.Shards > 1 {
		// Publications baton_0 …, shared by every shard contender: each uses slots of its own.
		if _, err := migrations.EnsureShards(ctx, e.pool, migrations.ShardOptions{Options: migrations.Options{Publication: publication}}, e.cfg.Shards); err != nil {
			return fmt.Errorf("shard publications of %s: %w", e.dbName, err)
		}
	}
	if e.nc, err = e.cfg.NATS.Connect(nats.Name("baton-bench"), nats.MaxReconnects(-1)); err != nil {
		return err
	}
	if e.js, err = jetstream.New(e.nc); err != nil {
		return fmt.Errorf("jetstream: %w", err)
	}
	return nil
}

// close deletes the run's streams, drops its database with its slots and closes the
// connections, whether ctx ended or not. Errors go to the logger: there is nothing else to do
// about them.
func (e *env) close(ctx context.Context) {
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), time.Minute)
	defer cancel()
	if e.js != nil {
		if err := e.deleteStreams(ctx, ""); err != nil {
			e.cfg.Logger.Warn("delete the bench's streams", "error", err)
		}
	}
	if e.nc != nil {
		e.nc.Close()
	}
	if e.pool != nil {
		e.pool.Close()
	}
	admin, err := pgx.Connect(ctx, e.cfg.DatabaseURL)
	if err != nil {
		e.cfg.Logger.Warn("drop the bench database", "database", e.dbName, "error", err)
		return
	}
	defer func() { _ = admin.Close(ctx) }()
	if err := dropDatabase(ctx, admin, e.dbName); err != nil {
		e.cfg.Logger.Warn("drop the bench database", "database", e.dbName, "error", err)
	}
}

// withDatabase returns the connection string raw with its database replaced by db.
// A URL's query may name the database too (dbname or database), and wins over its path: both
// go, so that the path names it alone.
func withDatabase(raw, db string) (string, error) {
	if u, err := url.Parse(raw); err == nil && (u.Scheme == "postgres" || u.Scheme == "postgresql") {
		u.Path, u.RawPath = "/"+db, ""
		q := u.Query()
		if q.Has("dbname") || q.Has("database") {
			q.Del("dbname")
			q.Del("database")
			u.RawQuery = q.Encode()
		}
		return u.String(), nil
	}
	if strings.Contains(raw, "://") {
		return "", errors.New("database URL: not a postgres:// URL")
	}
	// key=value form: a later dbname wins.
	return raw + " dbname=" + db, nil
}

// checkDatabase fails unless pool is connected to database want, the bench's own: the last
// guard against working (migrating, truncating) in a database the bench did not create.
func checkDatabase(ctx context.Context, pool *pgxpool.Pool, want string) error {
	var got string
	if err := pool.QueryRow(ctx, `SELECT current_database()`).Scan(&got); err != nil {
		return fmt.Errorf("connect to %s: %w", want, err)
	}
	if got != want {
		return fmt.Errorf("the connection string leads to database %q, not to the bench's own %q: refusing to work there", got, want)
	}
	return nil
}

// isLocalHost reports whether a libpq host is this machine: a Unix socket or a loopback name.
func isLocalHost(host string) bool {
	if host == "" || strings.HasPrefix(host, "/") || host == "localhost" {
		return true
	}
	ip := net.ParseIP(host)
	return ip != nil && ip.IsLoopback()
}

// names returns a new slot name and subject prefix, unique to the run: the slot names of a
// server are shared by its databases.
func (e *env) names() (slot, prefix string) {
	e.seq++
	return fmt.Sprintf("baton_bench_%s_%d", e.runID, e.seq), fmt.Sprintf("bench_%s_%d", e.runID, e.seq)
}

// walsender returns the pid of slot's walsender when it is measurable (0 otherwise, whose CPU
// reads as NaN).
func (e *env) walsender(ctx context.Context, slot string) (int, error) {
	if !e.localPG {
		return 0, nil
	}
	return walsenderPID(ctx, e.pool, slot)
}

// streamMsgs returns how many events the turns stream name holds: its messages less the
// relay's fence messages (wire.FenceSubject). The run's prefixes are one token
// (e.names), so its fence subjects are *.fence.turns.<slot>.
func (e *env) streamMsgs(ctx context.Context, name string) (int, error) {
	s, err := e.js.Stream(ctx, name)
	if err != nil {
		return 0, fmt.Errorf("stream %s: %w", name, err)
	}
	n, err := wire.StreamEvents(ctx, s, "*", wire.KindTurns)
	if err != nil {
		return 0, fmt.Errorf("stream %s: %w", name, err)
	}
	return int(min(n, math.MaxInt)), nil
}

// deleteStreams deletes the streams of subject prefix prefix, or every stream of the run when
// prefix is empty, to give back their disk space.
func (e *env) deleteStreams(ctx context.Context, prefix string) error {
	var doomed []string
	if prefix != "" {
		for _, kind := range []string{wire.KindTurns, wire.KindOutcomes, wire.KindDeadLetter} {
			doomed = append(doomed, wire.StreamName(prefix, kind))
		}
	} else {
		mine := wire.StreamName("bench_"+e.runID, "") // BENCH_<RUNID>_
		names := e.js.StreamNames(ctx)
		for name := range names.Name() {
			if strings.HasPrefix(name, mine) {
				doomed = append(doomed, name)
			}
		}
		if err := names.Err(); err != nil && !errors.Is(err, jetstream.ErrEndOfData) {
			return fmt.Errorf("list streams: %w", err)
		}
	}
	for _, name := range doomed {
		if err := e.js.DeleteStream(ctx, name); err != nil && !errors.Is(err, jetstream.ErrStreamNotFound) {
			return fmt.Errorf("delete stream %s: %w", name, err)
		}
	}
	return nil
}

// childEnvFor returns the environment of a relay child on slot and prefix: the run's
// database and NATS server (with its login and TLS settings), logs in text at info (the
// bench reads "streaming").
func (e *env) childEnvFor(slot, prefix string, extra ...string) []string {
	if e.cfg.StreamReplicas > 1 {
		extra = append(extra, "BATON_STREAM_REPLICAS="+strconv.Itoa(e.cfg.StreamReplicas))
	}
	return append(append(e.cfg.NATS.Environ(),
		"BATON_DATABASE_URL="+e.dbURL,
		"BATON_SLOT="+slot,
		"BATON_SUBJECT_PREFIX="+prefix,
		"BATON_PUBLICATION="+publication,
		"BATON_LOG_LEVEL=info",
		"BATON_LOG_FORMAT=text",
	), extra...)
}

// startRelay starts `baton relay` on slot and prefix.
func (e *env) startRelay(ctx context.Context, slot, prefix string, extra ...string) (*process, error) {
	return startProcess(ctx, "baton relay", e.cfg.RelayCommand, e.childEnvFor(slot, prefix, extra...))
}

// startPlain starts the plain relay on slot (which must exist) and prefix.
func (e *env) startPlain(ctx context.Context, slot, prefix string) (*process, error) {
	return startProcess(ctx, "plain relay", e.cfg.PlainRelayCommand, e.childEnvFor(slot, prefix))
}

// prepareRelaySlot runs `baton relay` on slot and prefix until it streams, then stops it: the
// slot exists, its (empty) first-start backfill is recorded, its streams exist. What commits
// afterwards reaches the next relay on slot through the slot, not the backfill.
func (e *env) prepareRelaySlot(ctx context.Context, slot, prefix string) error {
	p, err := e.startRelay(ctx, slot, prefix)
	if err != nil {
		return err
	}
	defer p.stop(stopGrace)
	if err := p.waitStreaming(ctx, startTimeout); err != nil {
		return err
	}
	p.stop(stopGrace)
	return waitSlotsIdle(ctx, e.pool)
}

// listenAddr waits until p logged where it listens for msg (opsserver.MetricsListening or
// opsserver.PprofListening), for at most within, and returns that address. The relay logs the
// line as it starts, among its first: call this right after starting it, while the line is
// still among the last ones p keeps (process.tail).
func (p *process) listenAddr(ctx context.Context, msg string, within time.Duration) (string, error) {
	deadline := time.NewTimer(within)
	defer deadline.Stop()
	tick := time.NewTicker(10 * time.Millisecond)
	defer tick.Stop()
	for {
		if addr, ok := p.loggedAddr(msg); ok {
			return addr, nil
		}
		select {
		case <-p.exited:
			if addr, ok := p.loggedAddr(msg); ok {
				return addr, nil
			}
			return "", fmt.Errorf("%s exited before logging %q: %s", p.name, msg, p.logTail())
		case <-deadline.C:
			return "", fmt.Errorf("%s did not log %q within %v: %s", p.name, msg, within, p.logTail())
		case <-ctx.Done():
			return "", ctx.Err()
		case <-tick.C:
		}
	}
}

// loggedAddr returns the address of the line among the last ones p logged that says where it
// listens for msg, in the text format childEnvFor sets: msg="metrics listening"
// addr=127.0.0.1:41234.
func (p *process) loggedAddr(msg string) (string, bool) {
	p.mu.Lock()
	defer p.mu.Unlock()
	for _, line := range p.tail {
		if addr, ok := opsserver.ListeningAddr(line, msg); ok {
			return addr, true
		}
	}
	return "", false
}

// selfCPU returns the CPU seconds this process used so far.
func selfCPU() float64 { return cpuSeconds(os.Getpid()) }
