//go:build !baton_noembeddednats

package throwaway

import (
	"errors"
	"fmt"
	"net"
	"syscall"
	"time"

	"github.com/nats-io/nats-server/v2/server"
)

const (
	// natsReadyTimeout bounds how long one start waits for the server to listen.
	natsReadyTimeout = 30 * time.Second
	// natsReadyPoll is how long each readiness check waits: ReadyForConnections sits out its
	// whole duration once the listener failed, so it is asked in short slices, between which a
	// failure the server reported ends the start at once.
	natsReadyPoll = 100 * time.Millisecond
	// natsBindTimeout bounds how long a server started on a fixed port keeps trying while
	// another listener holds that port; natsBindRetryWait is the pause between tries.
	natsBindTimeout   = time.Minute
	natsBindRetryWait = 250 * time.Millisecond
)

// NATS is a NATS server with JetStream running in this process, listening on 127.0.0.1.
type NATS struct {
	// Port is the client port the server listens on.
	Port int

	srv *server.Server
}

// StartNATS starts a NATS server with JetStream in this process, storing its streams under
// storeDir, on port, and waits until it accepts connections. A server started on a store
// directory another one used recovers its streams.
//
// Port 0 has the server bind any free port itself (NATS.Port reports it), so that no other
// listener can be given the port between its choice and the bind. A fixed port (a server
// started again on the port it had) may have been given to another listener meanwhile: see
// StartServer.
func StartNATS(storeDir string, port int) (*NATS, error) {
	rebind := port != 0
	if port == 0 {
		port = -1 // the server's "any free port"; its 0 means the default port 4222
	}
	srv, err := StartServer(func() *server.Options {
		return &server.Options{
			ServerName: "baton-throwaway",
			Host:       "127.0.0.1",
			Port:       port,
			JetStream:  true,
			StoreDir:   storeDir,
			NoSigs:     true,
			NoLog:      true,
		}
	}, rebind)
	if err != nil {
		return nil, fmt.Errorf("nats server: %w", err)
	}
	return &NATS{Port: srv.Addr().(*net.TCPAddr).Port, srv: srv}, nil
}

// StartServer starts a NATS server in this process with the options newOpts returns (new ones
// for each try: the server rewrites those it is given) and waits until it accepts clients and
// routes. A server that failed to start (a listener, JetStream) is shut down and its error
// returned. With rebind — a server started again on the fixed ports it had, one of which
// another listener may have been given meanwhile — a port in use is tried again every 250 ms
// for up to a minute, after which the error names it.
func StartServer(newOpts func() *server.Options, rebind bool) (*server.Server, error) {
	deadline := time.Now().Add(natsBindTimeout)
	for {
		srv, err := startNATSOnce(newOpts())
		if err == nil || !rebind || !errors.Is(err, syscall.EADDRINUSE) {
			return srv, err
		}
		if time.Now().After(deadline) {
			// err names the port: "Error listening on port: ...: address already in use".
			return nil, fmt.Errorf("a port still in use after %s: %w", natsBindTimeout, err)
		}
		time.Sleep(natsBindRetryWait) // nothing tells when the other listener lets go
	}
}

// startNATSOnce starts a server with opts and waits until it accepts clients and routes. A
// server that failed to start (its listeners, JetStream) is shut down, and its error returned.
func startNATSOnce(opts *server.Options) (*server.Server, error) {
	srv, err := server.NewServer(opts)
	if err != nil {
		return nil, err
	}
	fatal := make(chan error, 1)
	srv.SetLogger(fatalLogger(fatal), false, false)
	go srv.Start()
	deadline := time.Now().Add(natsReadyTimeout)
	for !srv.ReadyForConnections(natsReadyPoll) {
		select {
		case err = <-fatal:
		default:
			if time.Now().After(deadline) {
				err = fmt.Errorf("not ready after %s", natsReadyTimeout)
			}
		}
		if err != nil {
			srv.Shutdown()
			srv.WaitForShutdown()
			return nil, err
		}
	}
	return srv, nil
}

// fatalLogger is a server's logger: it drops what the server logs but passes on the first
// error it reports through Fatalf (a listener it could not open, JetStream it could not
// start), after which a server without a logger would run on silently, never ready.
type fatalLogger chan<- error

func (l fatalLogger) Fatalf(format string, v ...any) {
	err := &fatalError{msg: fmt.Sprintf(format, v...)}
	for _, a := range v {
		if e, ok := a.(error); ok {
			err.cause = e // kept for errors.Is: the bind's EADDRINUSE
			break
		}
	}
	select {
	case l <- err:
	default: // the first one is enough
	}
}

func (fatalLogger) Noticef(string, ...any) {}
func (fatalLogger) Warnf(string, ...any)   {}
func (fatalLogger) Errorf(string, ...any)  {}
func (fatalLogger) Debugf(string, ...any)  {}
func (fatalLogger) Tracef(string, ...any)  {}

// fatalError is what a server reported through Fatalf, and the error among its arguments.
type fatalError struct {
	msg   string
	cause error
}

func (e *fatalError) Error() string { return e.msg }
func (e *fatalError) Unwrap() error { return e.cause }

// URL returns the client URL.
func (n *NATS) URL() string { return fmt.Sprintf("nats://127.0.0.1:%d", n.Port) }

// Stop shuts the server down and waits until it is gone; clients see their connection drop.
// The store directory stays. Stopping a stopped server does nothing.
func (n *NATS) Stop() {
	n.srv.Shutdown()
	n.srv.WaitForShutdown()
}
