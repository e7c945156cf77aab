package testsvc

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"math/big"
	"net"
	"os"
	"path/filepath"
	"testing"
	"time"
)

// CA is a certificate authority generated for one test: it signs server certificates that
// clients verify against CertPEM (sslrootcert=<CertFile> for PostgreSQL).
type CA struct {
	// CertPEM is the CA's certificate.
	CertPEM []byte
	// CertFile is CertPEM written to a file of the test's temp dir.
	CertFile string

	cert *x509.Certificate
	key  *ecdsa.PrivateKey
}

// NewCA generates a CA valid for a day, named name.
func NewCA(t testing.TB, name string) *CA {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatalf("CA key: %v", err)
	}
	tmpl := &x509.Certificate{
		SerialNumber:          serial(t),
		Subject:               pkix.Name{CommonName: name},
		NotBefore:             time.Now().Add(-time.Hour),
		NotAfter:              time.Now().Add(24 * time.Hour),
		KeyUsage:              x509.KeyUsageCertSign | x509.KeyUsageCRLSign,
		BasicConstraintsValid: true,
		IsCA:                  true,
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		t.Fatalf("CA certificate: %v", err)
	}
	cert, err := x509.ParseCertificate(der)
	if err != nil {
		t.Fatalf("parse CA certificate: %v", err)
	}
	ca := &CA{CertPEM: pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der}), cert: cert, key: key}
	ca.CertFile = filepath.Join(t.TempDir(), "ca.pem")
	if err := os.WriteFile(ca.CertFile, ca.CertPEM, 0o600); err != nil {
		t.Fatalf("write CA certificate: %v", err)
	}
	return ca
}

// ServerCert issues a server certificate for 127.0.0.1, ::1 and localhost, and returns it
// and its private key, both PEM.
func (ca *CA) ServerCert(t testing.TB) (certPEM, keyPEM []byte) {
	t.Helper()
	return ca.issue(t, "localhost", x509.ExtKeyUsageServerAuth)
}

// ClientCert issues a client certificate named name, and returns it and its private key,
// both PEM.
func (ca *CA) ClientCert(t testing.TB, name string) (certPEM, keyPEM []byte) {
	t.Helper()
	return ca.issue(t, name, x509.ExtKeyUsageClientAuth)
}

// issue returns a certificate for name, 127.0.0.1, ::1 and localhost with usage, signed by
// ca and valid for a day, and its private key, both PEM.
func (ca *CA) issue(t testing.TB, name string, usage x509.ExtKeyUsage) (certPEM, keyPEM []byte) {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatalf("%s key: %v", name, err)
	}
	tmpl := &x509.Certificate{
		SerialNumber: serial(t),
		Subject:      pkix.Name{CommonName: name},
		NotBefore:    time.Now().Add(-time.Hour),
		NotAfter:     time.Now().Add(24 * time.Hour),
		KeyUsage:     x509.KeyUsageDigitalSignature | x509.KeyUsageKeyEncipherment,
		ExtKeyUsage:  []x509.ExtKeyUsage{usage},
		DNSNames:     []string{"localhost"},
		IPAddresses:  []net.IP{net.IPv4(127, 0, 0, 1), net.IPv6loopback},
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, ca.cert, &key.PublicKey, ca.key)
	if err != nil {
		t.Fatalf("%s certificate: %v", name, err)
	}
	keyDER, err := x509.MarshalPKCS8PrivateKey(key)
	if err != nil {
		t.Fatalf("%s key: %v", name, err)
	}
	return pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der}),
		pem.EncodeToMemory(&pem.Block{Type: "PRIVATE KEY", Bytes: keyDER})
}

func serial(t testing.TB) *big.Int {
	n, err := rand.Int(rand.Reader, new(big.Int).Lsh(big.NewInt(1), 126))
	if err != nil {
		t.Fatalf("certificate serial: %v", err)
	}
	return n
}
