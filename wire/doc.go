// Package wire is Baton's contract on NATS: what a program that is not Baton needs to talk to it.
//
// # Subjects
//
// Subjects have the form
//
//	<prefix>.turns.<conv>
//	<prefix>.outcomes.<conv>
//
// where <conv> is the token of a conversation id (see [Token]):
//
//   - the id itself when it matches ^[A-Za-z0-9_-]{1,200}$ (a "plain" id);
//   - otherwise "~" followed by the unpadded base64url encoding
//     ([encoding/base64.RawURLEncoding]) of the id's bytes.
//
// Guarantee: no conversation id can reach another conversation's subject or a
// wildcard. Every token is one non-empty NATS subject token made only of
// [A-Za-z0-9_-] and, as its first byte only, "~", so it never contains ".",
// "*", ">" or whitespace. Plain ids never contain "~" and encoded tokens always
// start with "~", so the two spaces cannot collide. The mapping is a bijection
// between valid ids and canonical tokens: [ParseToken] accepts exactly the tokens
// [Token] produces, so every id has exactly one token and every accepted token
// names exactly one id.
//
// Ids are treated as bytes. Invalid UTF-8 and NUL bytes are encoded like any
// other non-plain byte and round-trip exactly, although Postgres text columns
// cannot hold them.
//
// Everything here is pure: no I/O, no shared state, no regular expressions.
package wire
