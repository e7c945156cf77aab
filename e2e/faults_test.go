package e2e

import (
	"context"
	"fmt"
	"math/rand/v2"
	"strings"
	"syscall"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/batonhq/baton/internal/testsvc"
)

// runFaults injects the schedule's faults, each at its offset from start (or as soon as the
// one before it healed, when that took longer), and returns how many ran of each kind and the
// defects they revealed (a graceful stop that did not exit 0).
func (s *system) runFaults(ctx context.Context, start time.Time, faults []fault) (map[string]int, []string) {
	counts := map[string]int{}
	var defects []string
	for _, f := range faults {
		if !sleep(ctx, time.Until(start.Add(f.At))) {
			break
		}
		late := time.Since(start) - f.At
		what, err := s.inject(ctx, f)
		s.t.Logf("fault %v%s (late %.1fs)", f, what, late.Seconds())
		if err != nil {
			s.t.Logf("fault %v: %v", f, err)
			if strings.HasPrefix(err.Error(), "defect: ") {
				defects = append(defects, fmt.Sprintf("%v: %v", f, err))
			}
		}
		counts[f.Kind]++
	}
	return counts, defects
}

// runBackground injects the background schedule's faults (proxy faults only, which are safe
// to run beside the main schedule's) until it ends or ctx does, and counts them into counts
// under "bg-<kind>".
func (s *system) runBackground(ctx context.Context, start time.Time, faults []fault) map[string]int {
	counts := map[string]int{}
	for _, f := range faults {
		if !sleep(ctx, time.Until(start.Add(f.At))) {
			break
		}
		what, err := s.inject(ctx, f)
		s.t.Logf("background fault %v%s", f, what)
		if err != nil {
			s.t.Logf("background fault %v: %v", f, err)
		}
		counts["bg-"+f.Kind]++
	}
	return counts
}

// inject runs one fault to its end (what it broke is healed when it returns) and describes
// what it hit.
func (s *system) inject(ctx context.Context, f fault) (string, error) {
	switch f.Kind {
	case faultKill, faultTerm, faultStop, faultStopLong:
		p := s.resolve(ctx, f.Target)
		if !p.running() {
			p.start(s.t)
		}
		what := fmt.Sprintf(" -> %s pid %d", p.name, p.pid())
		switch f.Kind {
		case faultKill:
			if err := p.kill(); err != nil {
				return what, err
			}
			sleep(ctx, f.For)
			p.start(s.t)
		case faultTerm:
			err := p.terminate()
			sleep(ctx, f.For)
			p.start(s.t)
			if err != nil {
				return what, fmt.Errorf("defect: %w", err)
			}
		case faultStop, faultStopLong:
			if _, err := p.signal(syscall.SIGSTOP, false); err != nil {
				return what, err
			}
			sleep(ctx, f.For)
			if _, err := p.signal(syscall.SIGCONT, false); err != nil {
				return what, err
			}
		}
		return what, nil
	case faultNATS:
		what := s.stopNATS(ctx, f)
		sleep(ctx, f.For)
		return what, s.startNATS()
	case faultPGFast, faultPGCrash:
		stop := s.pg.Stop
		if f.Kind == faultPGCrash {
			stop = s.pg.Crash
		}
		if err := stop(); err != nil {
			return "", fmt.Errorf("stop postgres: %w", err)
		}
		s.pgDown = true
		sleep(ctx, f.For)
		if err := s.pg.Start(ctx); err != nil {
			return "", fmt.Errorf("start postgres: %w", err)
		}
		s.pgDown = false
	case faultWalsender:
		cctx, cancel := context.WithTimeout(ctx, 5*time.Second)
		defer cancel()
		var n int
		if err := s.pool.QueryRow(cctx, `SELECT count(pg_terminate_backend(active_pid)) FROM pg_replication_slots
			WHERE slot_name = 'baton' AND active_pid IS NOT NULL`).Scan(&n); err != nil {
			return "", fmt.Errorf("terminate walsender: %w", err)
		}
		return fmt.Sprintf(" -> %d terminated", n), nil
	case faultLatency, faultReset, faultFreeze, faultFreezeLong, faultSlowLink:
		pxs, name := s.proxies(ctx, f.Target)
		what := " -> " + name
		each := func(do func(px *testsvc.Proxy)) {
			for _, px := range pxs {
				do(px)
			}
		}
		switch f.Kind {
		case faultLatency:
			each(func(px *testsvc.Proxy) { px.SetLatency(f.Latency) })
			sleep(ctx, f.For)
			each(func(px *testsvc.Proxy) { px.SetLatency(0) })
		case faultReset:
			n := 0
			each(func(px *testsvc.Proxy) { n += px.Conns(); px.ResetAll() })
			return fmt.Sprintf("%s, %d connections", what, n), nil
		case faultFreeze, faultFreezeLong:
			each((*testsvc.Proxy).Freeze)
			sleep(ctx, f.For)
			each((*testsvc.Proxy).Unfreeze)
		case faultSlowLink:
			each(func(px *testsvc.Proxy) { px.SetReplyRate(f.Rate) })
			sleep(ctx, f.For)
			each(func(px *testsvc.Proxy) { px.SetReplyRate(0) })
		}
		return what, nil
	case faultTurnsFull:
		return s.fillTurns(ctx, f)
	default:
		return "", fmt.Errorf("unknown fault kind %q", f.Kind)
	}
	return "", nil
}

// resolve returns the process a fault's target names: "relay:active" is the relay streaming
// now, "relay:standby" the other one (relay-0 and relay-1 when neither streams at the moment).
func (s *system) resolve(ctx context.Context, target string) *proc {
	switch target {
	case "relay:active", "relay:standby":
		active := s.activeRelay(ctx)
		if active == nil {
			if target == "relay:active" {
				return s.named["relay-0"]
			}
			return s.named["relay-1"]
		}
		if target == "relay:active" {
			return active
		}
		if active.name == "relay-0" {
			return s.named["relay-1"]
		}
		return s.named["relay-0"]
	}
	p, ok := s.named[target]
	if !ok {
		s.t.Fatalf("fault target %q: no such process", target)
	}
	return p
}

// proxies returns the proxies a fault's target ("<process>/pg" or "<process>/nats", the
// process as resolve reads it) names, and what it names ("relay-0/pg"): a process's path to
// NATS is its proxies to every server.
func (s *system) proxies(ctx context.Context, target string) ([]*testsvc.Proxy, string) {
	name, path, _ := strings.Cut(target, "/")
	p := s.resolve(ctx, name)
	if path == "pg" && p.pg != nil {
		return []*testsvc.Proxy{p.pg}, p.name + "/pg"
	}
	return p.nats, p.name + "/nats"
}

// stopNATS stops the NATS server, or on a cluster one node: the turns stream's leader half the
// time (its replicas elect another, mid catch-up when a relay just took over), the outcomes
// stream's leader or any node otherwise. It describes what it stopped.
func (s *system) stopNATS(ctx context.Context, f fault) string {
	s.natsDown = true
	if s.cluster == nil {
		s.nats.Stop()
		return ""
	}
	r := rand.New(rand.NewPCG(uint64(f.At), 0x6e6f6465))
	node := s.cluster.Nodes[r.IntN(len(s.cluster.Nodes))]
	if stream := []string{"AGENT_TURNS", "AGENT_TURNS", "AGENT_OUTCOMES", ""}[r.IntN(4)]; stream != "" {
		js, err := jetstream.New(s.nc)
		if err == nil {
			lctx, cancel := context.WithTimeout(ctx, 5*time.Second)
			if leader, err := s.cluster.StreamLeader(lctx, js, stream); err == nil {
				node = leader
			}
			cancel()
		}
	}
	node.Stop()
	s.stoppedNode = node
	return " -> " + node.Name
}

// startNATS starts what stopNATS stopped.
func (s *system) startNATS() error {
	if s.cluster == nil {
		if err := s.nats.Start(); err != nil {
			return fmt.Errorf("start nats: %w", err)
		}
	} else if s.stoppedNode != nil {
		if err := s.stoppedNode.Start(); err != nil {
			return fmt.Errorf("start %s: %w", s.stoppedNode.Name, err)
		}
		s.stoppedNode = nil
	}
	s.natsDown = false
	return nil
}

// fillTurns lowers the turns stream's MaxMsgs to what it holds now plus f.Slack, for f.For,
// so that the relay meets a full stream (discard new) until the workers' acks make room;
// then it restores the stream's configuration (heal does too, if the run ends meanwhile).
// Only the turns stream: a capped outcomes stream drops its oldest outcomes, by design.
func (s *system) fillTurns(ctx context.Context, f fault) (string, error) {
	js, err := jetstream.New(s.nc)
	if err != nil {
		return "", err
	}
	cctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	st, err := js.Stream(cctx, "AGENT_TURNS")
	if err != nil {
		return "", fmt.Errorf("turns stream: %w", err)
	}
	info := st.CachedInfo()
	capped := info.Config
	capped.MaxMsgs = int64(info.State.Msgs) + f.Slack
	s.turnsConfig = &info.Config
	if _, err := js.UpdateStream(cctx, capped); err != nil {
		return "", fmt.Errorf("cap the turns stream: %w", err)
	}
	what := fmt.Sprintf(" -> max_msgs %d (it held %d)", capped.MaxMsgs, info.State.Msgs)
	sleep(ctx, f.For)
	return what, s.restoreTurns()
}

// restoreTurns gives the turns stream back the configuration fillTurns changed, if it did.
func (s *system) restoreTurns() error {
	if s.turnsConfig == nil {
		return nil
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	js, err := jetstream.New(s.nc)
	if err != nil {
		return err
	}
	for {
		_, err = js.UpdateStream(ctx, *s.turnsConfig)
		if err == nil {
			s.turnsConfig = nil
			return nil
		}
		if ctx.Err() != nil {
			return fmt.Errorf("restore the turns stream's limits: %w", err)
		}
		time.Sleep(200 * time.Millisecond)
	}
}

// sleep waits for d or until ctx ends, and reports whether ctx is still live. A fault lasts
// this long: the wait is what the fault is, not a guess at when something happened.
func sleep(ctx context.Context, d time.Duration) bool {
	if d <= 0 {
		return ctx.Err() == nil
	}
	timer := time.NewTimer(d)
	defer timer.Stop()
	select {
	case <-timer.C:
		return true
	case <-ctx.Done():
		return false
	}
}
