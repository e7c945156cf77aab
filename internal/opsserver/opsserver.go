// Package opsserver serves what operators and orchestrators probe: Prometheus metrics at
// /metrics, liveness at /healthz and readiness at /readyz; and, on a listener of its own, Go's
// profiles at /debug/pprof/.
package opsserver

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"net/http/pprof"
	"runtime"
	"runtime/debug"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/client_golang/prometheus/promhttp"
)

// Version is the version baton_build_info reports; empty: the module version the binary was
// built at, "(devel)" for a build from a checkout. cmd/baton sets the one given at link time.
var Version string

// NewRegistry returns a registry with the Go runtime and process collectors and
// baton_build_info.
func NewRegistry() *prometheus.Registry {
	reg := prometheus.NewRegistry()
	reg.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}), buildInfo())
	return reg
}

// buildInfo is baton_build_info: always 1, with the binary's version, VCS revision and Go
// version as labels, so that dashboards can tell which build runs where.
func buildInfo() prometheus.Collector {
	version, revision, goVersion := Version, "unknown", runtime.Version()
	if info, ok := debug.ReadBuildInfo(); ok {
		if version == "" {
			version = info.Main.Version
		}
		for _, s := range info.Settings {
			if s.Key == "vcs.revision" {
				revision = s.Value
			}
		}
	}
	if version == "" {
		version = "unknown"
	}
	g := prometheus.NewGauge(prometheus.GaugeOpts{
		Name:        "baton_build_info",
		Help:        "Always 1; the labels name the running build: version, VCS revision and Go version.",
		ConstLabels: prometheus.Labels{"version": version, "revision": revision, "goversion": goVersion},
	})
	g.Set(1)
	return g
}

// Serve listens on addr until ctx ends. /readyz answers 200 while ready returns true, else 503.
// It logs the address it bound ("metrics listening", addr): with port 0 the system picks a
// free one, and a test or a supervisor reads it there instead of choosing a port for it.
func Serve(ctx context.Context, log *slog.Logger, addr string, reg *prometheus.Registry, ready func() bool) error {
	var lc net.ListenConfig
	ln, err := lc.Listen(ctx, "tcp", addr)
	if err != nil {
		return fmt.Errorf("metrics listener: %w", err)
	}
	log.Info(MetricsListening, "addr", ln.Addr().String())
	return ServeListener(ctx, ln, reg, ready)
}

// MetricsListening and PprofListening are the messages of the log lines that give the
// addresses Serve and ServePprof bound, in their "addr" attribute (see ListeningAddr).
const (
	MetricsListening = "metrics listening"
	PprofListening   = "pprof listening"
)

// AnyPort is the address to give a process whose metrics (or profiles) a supervisor or test
// scrapes: the system picks a free port as the process binds it, and the process logs which
// (ListeningAddr reads it). A port picked by the supervisor and released before the process
// bound it could be given to another listener meanwhile, whose answers the scrape would read.
const AnyPort = "127.0.0.1:0"

// ListeningAddr returns the address in line when it is the log line, in slog's text format
// (msg="metrics listening" addr=127.0.0.1:41234) or JSON ("msg":"metrics listening",
// "addr":"127.0.0.1:41234"), in which a process says where it listens for msg.
func ListeningAddr(line, msg string) (string, bool) {
	if strings.HasPrefix(line, "{") {
		var rec struct{ Msg, Addr string }
		if json.Unmarshal([]byte(line), &rec) != nil || rec.Msg != msg {
			return "", false
		}
		return rec.Addr, rec.Addr != ""
	}
	_, attrs, ok := strings.Cut(line, " msg="+strconv.Quote(msg)+" ")
	if !ok {
		return "", false
	}
	_, addr, ok := strings.Cut(" "+attrs, " addr=")
	if !ok {
		return "", false
	}
	addr, _, _ = strings.Cut(addr, " ")
	if unquoted, err := strconv.Unquote(addr); err == nil {
		addr = unquoted
	}
	return addr, addr != ""
}

// ServeListener is Serve on an open listener, which it closes.
func ServeListener(ctx context.Context, ln net.Listener, reg *prometheus.Registry, ready func() bool) error {
	mux := http.NewServeMux()
	mux.Handle("GET /metrics", promhttp.HandlerFor(reg, promhttp.HandlerOpts{Registry: reg}))
	mux.HandleFunc("GET /healthz", func(w http.ResponseWriter, _ *http.Request) {
		_, _ = w.Write([]byte("ok\n"))
	})
	mux.HandleFunc("GET /readyz", func(w http.ResponseWriter, _ *http.Request) {
		if ready != nil && !ready() {
			http.Error(w, "not ready", http.StatusServiceUnavailable)
			return
		}
		_, _ = w.Write([]byte("ready\n"))
	})
	return serve(ctx, ln, mux)
}

// ServePprof serves Go's profiles (net/http/pprof) at /debug/pprof/ on addr until ctx ends.
// It is a listener apart from Serve's: profiles show code paths and memory contents, and
// metrics are often scraped across the network.
func ServePprof(ctx context.Context, log *slog.Logger, addr string) error {
	var lc net.ListenConfig
	ln, err := lc.Listen(ctx, "tcp", addr)
	if err != nil {
		return fmt.Errorf("pprof listener: %w", err)
	}
	log.Info(PprofListening, "addr", ln.Addr().String())
	return servePprof(ctx, ln)
}

// servePprof serves the profiles on ln, which it closes, until ctx ends.
func servePprof(ctx context.Context, ln net.Listener) error {
	mux := http.NewServeMux()
	mux.HandleFunc("/debug/pprof/", pprof.Index)
	// Not the command line: flags may hold secrets (--database-url with a password), which
	// the logs mask and pprof.Cmdline would print in clear.
	mux.HandleFunc("/debug/pprof/cmdline", http.NotFound)
	mux.HandleFunc("/debug/pprof/profile", pprof.Profile)
	mux.HandleFunc("/debug/pprof/symbol", pprof.Symbol)
	mux.HandleFunc("/debug/pprof/trace", pprof.Trace)
	return serve(ctx, ln, mux)
}

// serve serves h on ln, which it closes, until ctx ends.
func serve(ctx context.Context, ln net.Listener, h http.Handler) error {
	srv := &http.Server{Handler: h, ReadHeaderTimeout: 5 * time.Second}
	CloseSpareConnsOnShutdown(srv)
	errc := make(chan error, 1)
	go func() { errc <- srv.Serve(ln) }()
	select {
	case err := <-errc:
		return fmt.Errorf("metrics server: %w", err)
	case <-ctx.Done():
	}
	shutdownCtx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 5*time.Second)
	defer cancel()
	if err := srv.Shutdown(shutdownCtx); err != nil {
		return fmt.Errorf("metrics server shutdown: %w", err)
	}
	if err := <-errc; err != nil && !errors.Is(err, http.ErrServerClosed) {
		return fmt.Errorf("metrics server: %w", err)
	}
	return nil
}

// CloseSpareConnsOnShutdown makes srv's Shutdown close the connections that have not sent a
// request yet. Shutdown counts such a connection as busy for its first 5 seconds (in case a
// request is on its way), so one spare dial (Go's transport and browsers open them; a scraper
// may) made a 5-second Shutdown fail and the program exit with an error on SIGTERM. They are
// closed after Shutdown closed the listeners (RegisterOnShutdown), so no new one arrives.
// Call it before Serve; it sets srv.ConnState.
func CloseSpareConnsOnShutdown(srv *http.Server) {
	var mu sync.Mutex
	spare := map[net.Conn]struct{}{}
	srv.ConnState = func(c net.Conn, st http.ConnState) {
		mu.Lock()
		defer mu.Unlock()
		if st == http.StateNew {
			spare[c] = struct{}{}
		} else {
			delete(spare, c)
		}
	}
	srv.RegisterOnShutdown(func() {
		mu.Lock()
		defer mu.Unlock()
		for c := range spare {
			_ = c.Close()
		}
	})
}
