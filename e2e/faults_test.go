package e2e

import (
	"context"
	"fmt"
	"strings"
	"syscall"
	"time"

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
	case faultKill, faultTerm, faultStop:
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
		case faultStop:
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
		s.nats.Stop()
		s.natsDown = true
		sleep(ctx, f.For)
		if err := s.nats.Start(); err != nil {
			return "", fmt.Errorf("start nats: %w", err)
		}
		s.natsDown = false
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
	case faultLatency, faultReset, faultFreeze:
		px := s.proxy(f.Target)
		switch f.Kind {
		case faultLatency:
			px.SetLatency(f.Latency)
			sleep(ctx, f.For)
			px.SetLatency(0)
		case faultReset:
			n := px.Conns()
			px.ResetAll()
			return fmt.Sprintf(" -> %d connections", n), nil
		case faultFreeze:
			px.Freeze()
			sleep(ctx, f.For)
			px.Unfreeze()
		}
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

// proxy returns the proxy a fault's target ("<process>/pg" or "<process>/nats") names.
func (s *system) proxy(target string) *testsvc.Proxy {
	name, path, _ := strings.Cut(target, "/")
	p, ok := s.named[name]
	if !ok {
		s.t.Fatalf("fault target %q: no such process", target)
	}
	if path == "pg" && p.pg != nil {
		return p.pg
	}
	return p.nats
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
