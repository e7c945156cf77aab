package main

import (
	"context"
	"net/url"
	"strconv"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go"
	"github.com/stretchr/testify/require"

	"github.com/batonhq/baton/internal/testsvc"
	"github.com/batonhq/baton/internal/throwaway"
	"github.com/batonhq/baton/producer"
)

// tlsPassword is role app's password on the TLS cluster.
const tlsPassword = "tls-app-Pw"

// startTLSPostgres starts a cluster with ssl on and a server certificate signed by ca, where
// role app must use TLS (and a password): its connections without TLS are rejected. It
// returns the cluster, whose admin URL (role postgres, no TLS) stays usable, and the URL of
// database appdb, migrated and owned by app, without sslmode.
func startTLSPostgres(t *testing.T, ca *testsvc.CA) (*testsvc.Postgres, *url.URL) {
	t.Helper()
	ctx, cancel := context.WithTimeout(t.Context(), 2*time.Minute)
	defer cancel()
	certPEM, keyPEM := ca.ServerCert(t)
	pg, err := testsvc.StartPostgresWith(ctx, throwaway.PostgresOptions{
		TLS: &throwaway.PostgresTLS{CertPEM: certPEM, KeyPEM: keyPEM},
		HBA: []string{
			"hostssl all app 127.0.0.1/32 scram-sha-256",
			"hostssl replication app 127.0.0.1/32 scram-sha-256",
			"hostnossl all app 127.0.0.1/32 reject",
			"hostnossl replication app 127.0.0.1/32 reject",
		},
	})
	require.NoError(t, err)
	t.Cleanup(func() { require.NoError(t, pg.Close()) })
	admin, err := pgx.Connect(ctx, pg.URL("postgres"))
	require.NoError(t, err)
	defer func() { _ = admin.Close(context.WithoutCancel(ctx)) }()
	for _, sql := range []string{
		"CREATE ROLE app LOGIN SUPERUSER REPLICATION PASSWORD " + quoteLiteral(tlsPassword),
		"CREATE DATABASE appdb OWNER app",
	} {
		_, err := admin.Exec(ctx, sql)
		require.NoError(t, err)
	}
	u := &url.URL{Scheme: "postgres", User: url.UserPassword("app", tlsPassword),
		Host: "127.0.0.1:" + strconv.Itoa(pg.Port), Path: "/appdb"}
	return pg, u
}

// verifyFullURL returns u asking for a verified certificate: sslmode=verify-full and sslrootcert.
func verifyFullURL(u *url.URL, rootCert string) string {
	v := url.Values{"sslmode": {"verify-full"}, "sslrootcert": {rootCert}}
	c := *u
	c.RawQuery = v.Encode()
	return c.String()
}

// sslOf returns, for the connections of role app, how many there are and how many of them
// use TLS, among walsenders (replication) or client backends (the rest).
func sslOf(t *testing.T, admin *pgx.Conn, backendType string) (total, withTLS int) {
	t.Helper()
	err := admin.QueryRow(t.Context(), `SELECT count(*), count(*) FILTER (WHERE s.ssl)
		FROM pg_stat_activity a JOIN pg_stat_ssl s USING (pid)
		WHERE a.usename = 'app' AND a.backend_type = $1`, backendType).Scan(&total, &withTLS)
	require.NoError(t, err)
	return total, withTLS
}

// A database URL with sslmode=verify-full and sslrootcert is honoured by every program: baton
// migrate, baton status, baton relay (its replication connection too, which streams an event
// to NATS) and a worker (examples/echoagent) connect over TLS to a server whose certificate
// the CA signed, and fail with the certificate error when the root certificate is another
// CA's.
func TestPostgresTLSVerifyFull(t *testing.T) {
	t.Parallel()
	ca := testsvc.NewCA(t, "baton test CA")
	other := testsvc.NewCA(t, "another CA")
	pg, base := startTLSPostgres(t, ca)
	ns := testsvc.StartNATS(t)
	baton := testsvc.Binary(t, "github.com/batonhq/baton/cmd/baton")
	echoagent := testsvc.Binary(t, "github.com/batonhq/baton/examples/echoagent")
	ctx := t.Context()

	good := verifyFullURL(base, ca.CertFile)
	env := []string{"BATON_DATABASE_URL=" + good, "BATON_NATS_URL=" + ns.URL()}

	// Without TLS, role app is turned away: what connects below used TLS.
	plain := *base
	plain.RawQuery = "sslmode=disable"
	_, err := pgx.Connect(ctx, plain.String())
	require.ErrorContains(t, err, "no encryption")

	out := runProgram(t, program{name: "migrate", bin: baton, args: []string{"migrate"}, env: env})
	require.Contains(t, out, "schema at version", out)
	// The same as key=value pairs, and by host name (the certificate names localhost too).
	kv := "host=127.0.0.1 port=" + base.Port() + " user=app dbname=appdb password=" + tlsPassword +
		" sslmode=verify-full sslrootcert=" + ca.CertFile
	byName := *base
	byName.Host = "localhost:" + base.Port()
	for _, dsn := range []string{kv, verifyFullURL(&byName, ca.CertFile)} {
		out := runProgram(t, program{name: "migrate", bin: baton, args: []string{"migrate"}, env: []string{"BATON_DATABASE_URL=" + dsn}})
		require.Contains(t, out, "schema at version", "%s:\n%s", dsn, out)
	}

	relayProc := startChild(t, "relay", baton, env, "relay")
	relayProc.await(t, "msg=streaming")

	nc, err := nats.Connect(ns.URL())
	require.NoError(t, err)
	t.Cleanup(nc.Close)
	turns, err := nc.SubscribeSync("agent.turns.>")
	require.NoError(t, err)
	require.NoError(t, nc.Flush())

	pool, err := pgxpool.New(ctx, good)
	require.NoError(t, err)
	t.Cleanup(pool.Close)
	prod, err := producer.New(producer.Config{})
	require.NoError(t, err)
	_, err = prod.CreateConversation(ctx, pool, "tls-conv")
	require.NoError(t, err)
	_, err = prod.Send(ctx, pool, producer.Message{ConversationID: "tls-conv", ID: "tls-msg-1", Content: "over TLS"})
	require.NoError(t, err)
	msg, err := turns.NextMsg(time.Minute)
	require.NoError(t, err, "the relay published no turn event")
	require.Equal(t, "tls-msg-1", msg.Header.Get("Baton-Message-Id"))

	admin, err := pgx.Connect(ctx, pg.URL("postgres"))
	require.NoError(t, err)
	t.Cleanup(func() { _ = admin.Close(context.WithoutCancel(ctx)) })
	total, withTLS := sslOf(t, admin, "walsender")
	require.Equal(t, 1, total, "the relay's replication connection")
	require.Equal(t, 1, withTLS, "the relay's replication connection uses TLS")
	total, withTLS = sslOf(t, admin, "client backend")
	require.Positive(t, total, "the relay's and the pool's connections")
	require.Equal(t, total, withTLS, "every normal connection of app uses TLS")

	// A worker answers the message, over TLS, fed by the relay through JetStream.
	worker := startChild(t, "echoagent", echoagent, env)
	worker.await(t, "echoagent started")
	require.Eventually(t, func() bool {
		var n int
		err := pool.QueryRow(ctx, `SELECT count(*) FROM messages WHERE conversation_id = 'tls-conv' AND role = 'assistant'`).Scan(&n)
		return err == nil && n == 1
	}, time.Minute, 20*time.Millisecond, "the worker answered\n%s", worker.stderr.String())

	out = runProgram(t, program{name: "status", bin: baton, args: []string{"status", "--json"}, env: env})
	require.Contains(t, out, `"database": "appdb"`, out)
	require.Contains(t, out, `"active": true`, "status sees the relay's slot active:\n%s", out)

	// Another CA's root certificate: every program says the certificate is not trusted.
	const untrusted = "x509: certificate signed by unknown authority"
	bad := []string{"BATON_DATABASE_URL=" + verifyFullURL(base, other.CertFile), "BATON_NATS_URL=" + ns.URL(), "BATON_SLOT=other"}
	for _, args := range [][]string{{"migrate"}, {"status"}} {
		out := runProgram(t, program{name: args[0], bin: baton, args: args, env: bad})
		require.Contains(t, out, untrusted, "baton %s:\n%s", args[0], out)
	}
	// The relay stops (exit 1, BATON_FATAL_LINGER has nothing to serve) instead of reconnecting
	// forever: only a new CA or URL can help.
	out = runProgram(t, program{name: "relay with another CA", bin: baton, args: []string{"relay"}, env: bad})
	require.Contains(t, out, untrusted, out)
	require.Contains(t, out, "sslrootcert", out)
	out = runProgram(t, program{name: "echoagent with another CA", bin: echoagent, args: []string{"--source", "polling"}, env: bad, until: untrusted})
	require.Contains(t, out, untrusted, out)
}
