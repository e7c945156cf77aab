// Package badinput runs the whole system, `baton relay` and examples/echoagent as processes on
// a real Postgres and a real NATS JetStream, against bad input: a 10 MiB message, invalid
// UTF-8 and NUL bytes written by hand-written SQL, conversation ids made of NATS-special
// characters, a NATS server with a 64 KiB max payload, and an operator deleting the streams
// while everything runs. Each case ends in a clear error or a documented degraded behaviour;
// in every case nothing accepted is lost and the relay and the worker keep serving other
// conversations.
package badinput

import (
	"os"
	"testing"

	"github.com/batonhq/baton/internal/testsvc"
)

func TestMain(m *testing.M) { os.Exit(testsvc.MainNoLeaks(m)) }
