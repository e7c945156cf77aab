package deploytest

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/stretchr/testify/require"

	"github.com/batonhq/baton/internal/testsvc"
	"github.com/batonhq/baton/producer"
	"github.com/batonhq/baton/wire"
)

// Leadership rests on what only Baton's roles can hold. These keys are what earlier versions
// locked with advisory locks, computable by any role: a neighbour holding them must stop
// neither a relay nor `baton migrate`.
const (
	oldRelayLockSQL     = `SELECT pg_advisory_lock(hashtextextended('baton.relay.' || $1, 0))`
	oldMigrationLockKey = int64(0x626174_6f6e2e6d69)
)

// leaderWorld is a migrated database with roles.sql applied, a NATS server and what `baton
// relay` processes need to run as baton_relay there.
type leaderWorld struct {
	rs     *roleSet
	nats   *testsvc.NATS
	js     jetstream.JetStream
	prefix string
	slot   string
}

func newLeaderWorld(t *testing.T) *leaderWorld {
	t.Helper()
	db, rs := setupRoles(t)
	ns := testsvc.StartNATS(t)
	nc, err := nats.Connect(ns.URL())
	require.NoError(t, err)
	t.Cleanup(nc.Close)
	js, err := jetstream.New(nc)
	require.NoError(t, err)
	return &leaderWorld{rs: rs, nats: ns, js: js, prefix: "lead_" + db.Name, slot: db.Name}
}

// relay starts bin relay as baton_relay, its log lines kept.
func (w *leaderWorld) relay(t *testing.T, name, bin string) *testsvc.Process {
	t.Helper()
	return testsvc.StartProcess(t, name, bin, []string{
		"BATON_DATABASE_URL=" + w.rs.url(t, roleRelay), "BATON_NATS_URL=" + w.nats.URL(),
		"BATON_SLOT=" + w.slot, "BATON_SUBJECT_PREFIX=" + w.prefix,
		"BATON_LOG_LEVEL=info",
	}, "relay")
}

// send commits a user message and its outbox row as baton_app.
func (w *leaderWorld) send(t *testing.T, conv, id string) {
	t.Helper()
	ctx := context.Background()
	app := w.rs.pool(t, roleApp)
	p := newProducer(t)
	_, err := p.CreateConversation(ctx, app, conv)
	require.NoError(t, err)
	_, err = p.Send(ctx, app, producer.Message{ConversationID: conv, ID: id, Content: "hello"})
	require.NoError(t, err)
}

// turns returns the message ids of the turn events the relays stored, in stream order.
func (w *leaderWorld) turns(t *testing.T, want int) []string {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	var ids []string
	require.Eventually(t, func() bool {
		ids = ids[:0]
		s, err := w.js.Stream(ctx, streamOf(t, w.js, w.prefix))
		if err != nil {
			return false
		}
		info, err := s.Info(ctx)
		if err != nil {
			return false
		}
		for seq := info.State.FirstSeq; seq <= info.State.LastSeq && seq > 0; seq++ {
			m, err := s.GetMsg(ctx, seq)
			if err != nil {
				continue // deleted (a fence written again)
			}
			if !wire.IsFenceSubject(m.Subject) {
				ids = append(ids, m.Header.Get(wire.HeaderMessageID))
			}
		}
		return len(ids) >= want
	}, time.Minute, 50*time.Millisecond, "the relays never stored %d turn events", want)
	return ids
}

// streamOf returns the name of the stream that holds prefix's turn subjects.
func streamOf(t *testing.T, js jetstream.JetStream, prefix string) string {
	t.Helper()
	name, err := js.StreamNameBySubject(context.Background(), wire.StreamFilter(prefix, wire.KindTurns))
	if err != nil {
		return ""
	}
	return name
}

// A neighbour (baton_app, or any role that can connect) takes the key earlier relays locked
// to decide which relay streams, and sits idle with it. A relay logged in as baton_relay must
// stream anyway, and relay what the application commits.
func TestNeighbourHoldingTheOldRelayLockDoesNotStopTheRelay(t *testing.T) {
	t.Parallel()
	w := newLeaderWorld(t)
	ctx := context.Background()
	squatter, err := pgx.Connect(ctx, w.rs.url(t, roleApp))
	require.NoError(t, err)
	t.Cleanup(func() { _ = squatter.Close(ctx) })
	_, err = squatter.Exec(ctx, oldRelayLockSQL, w.slot)
	require.NoError(t, err)

	p := w.relay(t, "relay", binary(t, "baton"))
	p.WaitLog(t, `msg=streaming`, time.Minute)
	w.send(t, "c1", "m1")
	require.Equal(t, []string{"m1"}, w.turns(t, 1))
}

// The same neighbour takes the key `baton migrate` locked and sits idle with it: migrating
// (as baton_migrator) must not wait for it.
func TestNeighbourHoldingTheOldMigrationLockDoesNotStopMigrate(t *testing.T) {
	t.Parallel()
	_, rs := setupRoles(t)
	ctx := context.Background()
	squatter, err := pgx.Connect(ctx, rs.url(t, roleApp))
	require.NoError(t, err)
	t.Cleanup(func() { _ = squatter.Close(ctx) })
	_, err = squatter.Exec(ctx, `SELECT pg_advisory_lock($1)`, oldMigrationLockKey)
	require.NoError(t, err)
	// The schema is current: migrate still takes its lock for every version it checks.
	mctx, cancel := context.WithTimeout(ctx, time.Minute)
	defer cancel()
	cmd := exec.CommandContext(mctx, binary(t, "baton"), "migrate")
	cmd.Env = append(cleanEnv(), "BATON_DATABASE_URL="+rs.url(t, roleMigrator))
	out, err := cmd.CombinedOutput()
	require.NoError(t, err, "baton migrate beside a neighbour holding the old lock key: %s", out)
}

// oldRelayCommit is the last commit whose relays decided leadership with an advisory lock.
const oldRelayCommit = "5f9d016"

// oldBaton builds `baton` as it was at oldRelayCommit, from this checkout's history.
func oldBaton(t *testing.T) string {
	t.Helper()
	root, err := exec.Command("git", "rev-parse", "--show-toplevel").Output()
	require.NoError(t, err, "the rolling-upgrade test builds an earlier relay from the git history: run it in a git checkout of Baton")
	dir := t.TempDir()
	archive := exec.Command("sh", "-c", fmt.Sprintf("git -C %q archive %s | tar -x -C %q", strings.TrimSpace(string(root)), oldRelayCommit, dir))
	out, err := archive.CombinedOutput()
	require.NoError(t, err, "git archive %s (a shallow clone lacks it: fetch the history): %s", oldRelayCommit, out)
	bin := filepath.Join(dir, "baton-old")
	build := exec.Command("go", "build", "-o", bin, "./cmd/baton")
	build.Dir = dir
	build.Env = append(os.Environ(), "GOFLAGS=-mod=mod")
	out, err = build.CombinedOutput()
	require.NoError(t, err, "build the relay of %s: %s", oldRelayCommit, out)
	return bin
}

// A rolling upgrade: relays of the earlier version (an advisory lock decided which streamed)
// and of this one run side by side on one slot, each taking over from the other as they are
// stopped one by one. At every step one streams and the others stand by, and every row is
// relayed once, in order.
func TestRollingUpgradeFromAdvisoryLockRelays(t *testing.T) {
	t.Parallel()
	old := oldBaton(t)
	w := newLeaderWorld(t)
	// The earlier version's relays run the schema of their time: the migrations are the same
	// up to the new version's, which only adds columns.
	oldA := w.relay(t, "old relay A", old)
	oldA.WaitLog(t, `msg=streaming`, time.Minute)
	newB := w.relay(t, "new relay B", binary(t, "baton"))
	newB.WaitLog(t, `standing by`, time.Minute)
	w.send(t, "c1", "m1")
	w.turns(t, 1)

	require.NoError(t, oldA.Stop(30*time.Second))
	newB.WaitLog(t, `msg=streaming`, time.Minute)
	oldC := w.relay(t, "old relay C", old)
	oldC.WaitLog(t, `standing by`, time.Minute)
	w.send(t, "c1", "m2")
	w.send(t, "c2", "m3")
	w.turns(t, 3)

	require.NoError(t, newB.Stop(30*time.Second))
	oldC.WaitLog(t, `msg=streaming`, time.Minute)
	newD := w.relay(t, "new relay D", binary(t, "baton"))
	newD.WaitLog(t, `standing by`, time.Minute)
	w.send(t, "c1", "m4")
	require.Equal(t, []string{"m1", "m2", "m3", "m4"}, w.turns(t, 4), "each row once, in commit order")
}
