package localsvc

import (
	"errors"
	"fmt"
	"net"
	"sync"
	"time"

	"github.com/nats-io/nats-server/v2/server"
)

// NATS is a NATS server with JetStream, in this process, that can be stopped and restarted on
// the same port with the same store directory.
type NATS struct {
	StoreDir string
	Port     int
	// SyncAlways makes JetStream fsync every write (sync_interval: always) from the next Start.
	SyncAlways bool

	mu       sync.Mutex
	srv      *server.Server
	external string
}

// RunNATS starts an in-process NATS server with JetStream storing under storeDir. Port 0 picks
// a free port.
func RunNATS(storeDir string, port int) (*NATS, error) {
	n := &NATS{StoreDir: storeDir, Port: port}
	if port == 0 {
		n.Port = -1 // let the server choose; Start records the port for restarts
	}
	if err := n.Start(); err != nil {
		return nil, err
	}
	return n, nil
}

// ExternalNATS describes a server this process did not start: Stop and Start refuse to touch it.
func ExternalNATS(url string) *NATS { return &NATS{external: url} }

// URL returns the client URL.
func (n *NATS) URL() string {
	if n.external != "" {
		return n.external
	}
	return fmt.Sprintf("nats://127.0.0.1:%d", n.Port)
}

// External reports whether the server is one this process did not start.
func (n *NATS) External() bool { return n.external != "" }

// ErrExternal is returned when a test tries to restart a server it did not start.
var ErrExternal = errors.New("cannot stop or restart a NATS server this process did not start")

// Start starts the server (again) on n.Port with n.StoreDir; JetStream recovers its streams.
func (n *NATS) Start() error {
	if n.external != "" {
		return ErrExternal
	}
	n.mu.Lock()
	defer n.mu.Unlock()
	if n.srv != nil {
		return errors.New("nats already running")
	}
	opts := &server.Options{
		ServerName: "baton-test",
		Host:       "127.0.0.1",
		Port:       n.Port,
		JetStream:  true,
		StoreDir:   n.StoreDir,
		NoSigs:     true,
		NoLog:      true,
	}
	opts.SyncAlways = n.SyncAlways
	srv, err := server.NewServer(opts)
	if err != nil {
		return fmt.Errorf("nats server: %w", err)
	}
	go srv.Start()
	if !srv.ReadyForConnections(30 * time.Second) {
		srv.Shutdown()
		return errors.New("nats server not ready after 30s")
	}
	if n.Port <= 0 {
		n.Port = srv.Addr().(*net.TCPAddr).Port
	}
	n.srv = srv
	return nil
}

// Stop shuts the server down and waits until it is gone. Clients see a dropped connection.
func (n *NATS) Stop() {
	n.mu.Lock()
	defer n.mu.Unlock()
	if n.srv == nil {
		return
	}
	n.srv.Shutdown()
	n.srv.WaitForShutdown()
	n.srv = nil
}
