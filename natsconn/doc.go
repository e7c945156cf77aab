// Package natsconn turns the NATS settings every Baton process shares into nats.go options:
// where the servers are and how to log in to them and encrypt the connection. The relay,
// `baton status`, the demo, the benchmarks, the workers (examples/echoagent) and the outcome
// subscriber (examples/subscriber) all connect through it, so they accept the same settings
// and fail the same way.
//
// # Settings
//
// Each setting comes from a BATON_* environment variable (the programs' flags of the same name,
// lowercased without BATON_, override them):
//
//	BATON_NATS_URL       server URLs, comma-separated; user:password@ or token@ in a URL logs in with those
//	BATON_NATS_URL_FILE  a file holding BATON_NATS_URL (ValueOrFile), for a URL with secrets in it
//	BATON_NATS_CREDS     a .creds file: user JWT and nkey seed, as nsc writes them (operator/JWT auth)
//	BATON_NATS_NKEY      a file holding a user nkey seed (SU…) (nkey auth)
//	BATON_NATS_CA        PEM CA certificate(s) to verify the server with, instead of the system's
//	BATON_NATS_CERT      PEM client certificate, for servers that verify clients (verify: true)
//	BATON_NATS_KEY       PEM private key of BATON_NATS_CERT
//
// BATON_NATS_CREDS and BATON_NATS_NKEY exclude each other (a .creds file holds its own seed);
// BATON_NATS_CERT and BATON_NATS_KEY come together. Any of the TLS settings makes the client
// require TLS. BATON_DATABASE_URL_FILE is read the same way as BATON_NATS_URL_FILE, by
// ValueOrFile, so that every connection string can come from a mounted secret.
//
// # Errors
//
// Settings.Options checks every file at once, so a missing or unreadable path stops a
// process at startup with an error that names the variable and the path, never a file's
// contents. Settings.Connect says which servers it tried and which login it used; a login
// the server refuses ends in an error wrapping nats.ErrAuthorization (or another of nats.go's
// authentication errors), never in a retry loop: nats.Connect does not retry a failed first
// connection unless told to (nats.RetryOnFailedConnect), and Baton never tells it to.
//
// # Refused logins after the first connection
//
// Options leaves nats.go's default for logins refused on a reconnect: a server that refuses
// the same login twice in a row has the connection closed for good (no
// nats.IgnoreAuthErrorAbort), whatever nats.MaxReconnects says. A login refused again and
// again is a configuration problem, not an outage, and retrying it forever would hide it
// behind a process that looks alive; `baton relay` exits 1 when its connection closes, so an
// orchestrator restarts it and its log says why. A refusal that is not repeated (a server
// that had not yet loaded a new account) is retried as usual. nats.go reads the .creds file,
// the CA and the client certificate again at every connection attempt, so rotated files are
// used from the next reconnect on (an nkey seed file must keep its key: its public key is
// read once).
package natsconn
