//go:build !baton_noembeddednats

package throwaway

import (
	"errors"
	"fmt"
	"net"
	"time"

	"github.com/nats-io/nats-server/v2/server"
)

// NATS is a NATS server with JetStream running in this process, listening on 127.0.0.1.
type NATS struct {
	// Port is the client port the server listens on.
	Port int

	srv *server.Server
}

// StartNATS starts a NATS server with JetStream in this process, storing its streams under
// storeDir, on port (0 picks a free one), and waits until it accepts connections. A server
// started on a store directory another one used recovers its streams.
func StartNATS(storeDir string, port int) (*NATS, error) {
	if port == 0 {
		port = -1 // the server's "any free port"; its 0 means the default port 4222
	}
	srv, err := server.NewServer(&server.Options{
		ServerName: "baton-throwaway",
		Host:       "127.0.0.1",
		Port:       port,
		JetStream:  true,
		StoreDir:   storeDir,
		NoSigs:     true,
		NoLog:      true,
	})
	if err != nil {
		return nil, fmt.Errorf("nats server: %w", err)
	}
	go srv.Start()
	if !srv.ReadyForConnections(30 * time.Second) {
		srv.Shutdown()
		return nil, errors.New("nats server not ready after 30s")
	}
	return &NATS{Port: srv.Addr().(*net.TCPAddr).Port, srv: srv}, nil
}

// URL returns the client URL.
func (n *NATS) URL() string { return fmt.Sprintf("nats://127.0.0.1:%d", n.Port) }

// Stop shuts the server down and waits until it is gone; clients see their connection drop.
// The store directory stays. Stopping a stopped server does nothing.
func (n *NATS) Stop() {
	n.srv.Shutdown()
	n.srv.WaitForShutdown()
}
