//go:build baton_noembeddednats

package throwaway

import (
	"errors"
	"fmt"
)

// ErrNoEmbeddedNATS is StartNATS's error in a build without the embedded NATS server (-tags
// baton_noembeddednats, as the container image is built): such a build does not link
// nats-server, whose advisories image scanners would otherwise report against it.
var ErrNoEmbeddedNATS = errors.New("this build has no embedded NATS server (built with -tags baton_noembeddednats, " +
	"as the container image is): set BATON_NATS_URL to a NATS server with JetStream")

// NATS is the embedded server's handle; this build never starts one.
type NATS struct {
	// Port is the client port the server listens on.
	Port int
}

// StartNATS returns ErrNoEmbeddedNATS.
func StartNATS(string, int) (*NATS, error) { return nil, ErrNoEmbeddedNATS }

// URL returns the client URL.
func (n *NATS) URL() string { return fmt.Sprintf("nats://127.0.0.1:%d", n.Port) }

// Stop does nothing: no server runs.
func (n *NATS) Stop() {}
