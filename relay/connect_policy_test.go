package relay

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"io"
	"net"
	"testing"

	"github.com/jackc/pgx/v5/pgconn"
	"github.com/stretchr/testify/require"
)

// A failed connection is ErrSetup only when the server refused it for a reason no retry
// changes; everything else may pass and is retried. Either way the cause stays in the chain.
func TestConnectError(t *testing.T) {
	t.Parallel()
	refused := func(code string) error {
		return fmt.Errorf("failed to connect: %w", &pgconn.PgError{Severity: "FATAL", Code: code, Message: "refused"})
	}
	for _, tc := range []struct {
		name  string
		err   error
		setup bool
	}{
		{"invalid password", refused("28P01"), true},
		{"invalid authorization specification", refused("28000"), true},
		{"database does not exist", refused("3D000"), true},
		{"no CONNECT privilege", refused("42501"), true},
		{"server starting up or shutting down", refused("57P03"), false},
		{"too many connections", refused("53300"), false},
		{"admin shutdown", refused("57P01"), false},
		{"connection refused", &net.OpError{Op: "dial", Net: "tcp", Err: errors.New("connection refused")}, false},
		{"connection dropped", io.ErrUnexpectedEOF, false},
		{"timeout", context.DeadlineExceeded, false},
		{"server certificate of an unknown CA", fmt.Errorf("tls error: %w",
			&tls.CertificateVerificationError{Err: x509.UnknownAuthorityError{}}), true},
		{"server certificate for another host", fmt.Errorf("tls error: %w",
			&tls.CertificateVerificationError{Err: x509.HostnameError{Host: "db.example"}}), true},
		{"expired server certificate", fmt.Errorf("tls error: %w",
			&tls.CertificateVerificationError{Err: x509.CertificateInvalidError{Reason: x509.Expired}}), true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got := connectError(tc.err)
			require.Equal(t, tc.setup, errors.Is(got, ErrSetup), "%v", got)
			require.ErrorIs(t, got, tc.err)
			require.ErrorContains(t, got, "connect to postgres")
		})
	}
}
