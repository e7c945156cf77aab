package wire

import (
	"encoding/base64"
	"errors"
	"fmt"
	"strings"
)

// Kinds of subject, the second-to-last token of a subject.
const (
	// KindTurns is the kind of subjects carrying turn events (user messages
	// for a worker to answer).
	KindTurns = "turns"
	// KindOutcomes is the kind of subjects carrying outcome events (replies
	// and visible errors).
	KindOutcomes = "outcomes"
	// KindDeadLetter is the kind of the relay's dead-letter subjects,
	// <prefix>.deadletter.<what>, where <what> names the kind of change set aside
	// (answers, turn, outcome). They carry no conversation id: ParseSubject rejects them.
	KindDeadLetter = "deadletter"
	// KindFence is the second token of the relay's fence subjects (see FenceSubject), which
	// each stream holds beside its events and no consumer of events reads.
	KindFence = "fence"
)

// MaxConversationIDLen is the maximum length of a conversation id, in bytes.
const MaxConversationIDLen = 200

// encodedMark starts every encoded token. It is outside the plain alphabet.
const encodedMark = '~'

// maxTokenLen is the length of the longest token: the mark plus the unpadded
// base64url of MaxConversationIDLen bytes.
var maxTokenLen = 1 + base64.RawURLEncoding.EncodedLen(MaxConversationIDLen)

// Errors of the subject encoding. Every error returned by Token, ParseToken, ValidatePrefix,
// TurnSubject, OutcomeSubject and ParseSubject wraps one of them.
var (
	// ErrInvalidConversationID reports a conversation id that has no token:
	// it is empty or longer than MaxConversationIDLen bytes.
	ErrInvalidConversationID = errors.New("invalid conversation id")
	// ErrInvalidToken reports a string that is not a canonical token.
	ErrInvalidToken = errors.New("invalid conversation token")
	// ErrInvalidPrefix reports a subject prefix that is not one or more
	// dot-separated tokens of [A-Za-z0-9_-].
	ErrInvalidPrefix = errors.New("invalid subject prefix")
	// ErrInvalidSubject reports a subject that is not <prefix>.<kind>.<token>.
	ErrInvalidSubject = errors.New("invalid subject")
)

// isPlainByte reports whether b is in [A-Za-z0-9_-], which is both the plain
// id alphabet and the base64url alphabet.
func isPlainByte(b byte) bool {
	return 'a' <= b && b <= 'z' || 'A' <= b && b <= 'Z' || '0' <= b && b <= '9' || b == '_' || b == '-'
}

// isPlain reports whether s is non-empty and made only of [A-Za-z0-9_-].
// It does not check the length limit.
func isPlain(s string) bool {
	if s == "" {
		return false
	}
	for i := 0; i < len(s); i++ {
		if !isPlainByte(s[i]) {
			return false
		}
	}
	return true
}

// Token returns the subject token of conversationID: the id itself when it
// matches ^[A-Za-z0-9_-]{1,200}$, otherwise "~" followed by the unpadded
// base64url encoding of its bytes. The id is treated as bytes, so invalid
// UTF-8 is encoded too and round-trips through [ParseToken].
//
// It returns an error wrapping [ErrInvalidConversationID] when the id is
// empty or longer than [MaxConversationIDLen] bytes.
func Token(conversationID string) (string, error) {
	switch n := len(conversationID); {
	case n == 0:
		return "", fmt.Errorf("conversation id is empty: %w", ErrInvalidConversationID)
	case n > MaxConversationIDLen:
		return "", fmt.Errorf("conversation id is %d bytes, max %d: %w", n, MaxConversationIDLen, ErrInvalidConversationID)
	}
	if isPlain(conversationID) {
		return conversationID, nil
	}
	buf := make([]byte, 1+base64.RawURLEncoding.EncodedLen(len(conversationID)))
	buf[0] = encodedMark
	base64.RawURLEncoding.Encode(buf[1:], []byte(conversationID))
	return string(buf), nil
}

// ParseToken returns the conversation id whose token is token. It is the inverse
// of [Token] and accepts only canonical tokens, so Token(id) == token whenever
// it succeeds. It rejects, with an error wrapping [ErrInvalidToken], empty or
// over-long tokens, bytes outside the token alphabet, padding, base64 with
// non-zero trailing bits, and "~" tokens whose id would have been plain.
func ParseToken(token string) (string, error) {
	if token == "" {
		return "", fmt.Errorf("token is empty: %w", ErrInvalidToken)
	}
	if token[0] != encodedMark {
		if len(token) > MaxConversationIDLen {
			return "", fmt.Errorf("plain token is %d bytes, max %d: %w", len(token), MaxConversationIDLen, ErrInvalidToken)
		}
		if !isPlain(token) {
			return "", fmt.Errorf("plain token %q has a byte outside [A-Za-z0-9_-]: %w", token, ErrInvalidToken)
		}
		return token, nil
	}
	payload := token[1:]
	if len(token) > maxTokenLen {
		return "", fmt.Errorf("encoded token is %d bytes, max %d: %w", len(token), maxTokenLen, ErrInvalidToken)
	}
	// The alphabet check comes first: the base64 decoder skips '\r' and '\n'
	// even in strict mode, and RawURLEncoding rejects '=' on its own.
	if !isPlain(payload) {
		return "", fmt.Errorf("encoded token %q is empty or has a byte outside the base64url alphabet: %w", token, ErrInvalidToken)
	}
	// Strict rejects non-zero trailing bits, which would give one id several tokens.
	id, err := base64.RawURLEncoding.Strict().DecodeString(payload)
	if err != nil {
		return "", fmt.Errorf("encoded token %q: %w: %w", token, ErrInvalidToken, err)
	}
	if len(id) > MaxConversationIDLen {
		// Unreachable given maxTokenLen; kept so the bound does not depend on arithmetic.
		return "", fmt.Errorf("encoded token %q decodes to %d bytes, max %d: %w", token, len(id), MaxConversationIDLen, ErrInvalidToken)
	}
	if isPlain(string(id)) {
		return "", fmt.Errorf("encoded token %q names plain id %q, whose token is the id itself: %w", token, id, ErrInvalidToken)
	}
	return string(id), nil
}

// ValidatePrefix reports whether prefix is one or more dot-separated tokens of
// [A-Za-z0-9_-]: no wildcards, no empty tokens, no whitespace. The error wraps
// [ErrInvalidPrefix].
func ValidatePrefix(prefix string) error {
	if prefix == "" {
		return fmt.Errorf("subject prefix is empty: %w", ErrInvalidPrefix)
	}
	start := 0
	for i := 0; i <= len(prefix); i++ {
		if i < len(prefix) && prefix[i] != '.' {
			if !isPlainByte(prefix[i]) {
				return fmt.Errorf("subject prefix %q: byte %q at %d is outside [A-Za-z0-9_-.]: %w", prefix, prefix[i], i, ErrInvalidPrefix)
			}
			continue
		}
		if i == start {
			return fmt.Errorf("subject prefix %q: empty token at %d: %w", prefix, i, ErrInvalidPrefix)
		}
		start = i + 1
	}
	return nil
}

// TurnSubject returns the subject of turn events for conversationID:
// <prefix>.turns.<token>. It validates prefix and the id; see [ValidatePrefix]
// and [Token].
func TurnSubject(prefix, conversationID string) (string, error) {
	return build(prefix, KindTurns, conversationID)
}

// OutcomeSubject returns the subject of outcome events for conversationID:
// <prefix>.outcomes.<token>. It validates prefix and the id; see
// [ValidatePrefix] and [Token].
func OutcomeSubject(prefix, conversationID string) (string, error) {
	return build(prefix, KindOutcomes, conversationID)
}

func build(prefix, kind, conversationID string) (string, error) {
	if err := ValidatePrefix(prefix); err != nil {
		return "", err
	}
	tok, err := Token(conversationID)
	if err != nil {
		return "", err
	}
	return prefix + "." + kind + "." + tok, nil
}

// ParseSubject splits a subject of the form <prefix>.turns.<token> or
// <prefix>.outcomes.<token> into its kind ([KindTurns] or [KindOutcomes]) and
// the decoded conversation id. It fails with an error wrapping
// [ErrInvalidPrefix] if prefix is invalid, and with one wrapping
// [ErrInvalidSubject] if subject is not of that form (a bad token also wraps
// [ErrInvalidToken]). ParseSubject accepts exactly the subjects [TurnSubject] and
// [OutcomeSubject] build.
func ParseSubject(prefix, subject string) (kind string, conversationID string, err error) {
	if err := ValidatePrefix(prefix); err != nil {
		return "", "", err
	}
	rest, ok := strings.CutPrefix(subject, prefix+".")
	if !ok {
		return "", "", fmt.Errorf("subject %q does not start with %q: %w", subject, prefix+".", ErrInvalidSubject)
	}
	kind, tok, ok := strings.Cut(rest, ".")
	if !ok {
		return "", "", fmt.Errorf("subject %q has no token after the kind: %w", subject, ErrInvalidSubject)
	}
	if kind != KindTurns && kind != KindOutcomes {
		return "", "", fmt.Errorf("subject %q: kind %q is neither %q nor %q: %w", subject, kind, KindTurns, KindOutcomes, ErrInvalidSubject)
	}
	id, err := ParseToken(tok)
	if err != nil {
		return "", "", fmt.Errorf("subject %q: %w: %w", subject, ErrInvalidSubject, err)
	}
	return kind, id, nil
}

// FenceSubject returns the subject of the relay's fence for one slot in the stream of kind:
// <prefix>.fence.<kind>.<slot>. Each relay session writes one message there when it takes the
// slot (replacing the previous session's with a Nats-Rollup), and every event it publishes to
// that stream carries Nats-Expected-Last-Subject-Sequence naming it: once a newer session
// wrote its fence, JetStream refuses whatever an older session still sends. Fence subjects lie
// outside StreamFilter(prefix, kind), so no consumer of events receives them; the relay's NATS
// user needs publish rights on <prefix>.fence.>. slot is a replication slot name (lowercase
// letters, digits, underscores), which is a valid subject token.
func FenceSubject(prefix, kind, slot string) string {
	return prefix + "." + KindFence + "." + kind + "." + slot
}

// FenceFilter returns the filter matching every fence subject of kind under prefix:
// <prefix>.fence.<kind>.>, one of the subjects of that kind's stream.
func FenceFilter(prefix, kind string) string {
	return prefix + "." + KindFence + "." + kind + ".>"
}

// StreamFilter returns the subject filter matching every subject of kind
// under prefix: <prefix>.<kind>.>. It does not validate its arguments;
// callers pass a prefix accepted by [ValidatePrefix] and [KindTurns],
// [KindOutcomes] or [KindDeadLetter].
func StreamFilter(prefix, kind string) string {
	return prefix + "." + kind + ".>"
}

// DefaultSubjectPrefix is the subject prefix Baton uses when none is configured
// (BATON_SUBJECT_PREFIX): subjects agent.turns.<conv>, streams AGENT_TURNS.
const DefaultSubjectPrefix = "agent"

// StreamName returns the default stream name for a subject prefix and kind: "agent", "turns"
// gives "AGENT_TURNS". The prefix is upper-cased, with dots and dashes as underscores.
func StreamName(prefix, kind string) string {
	b := []byte(prefix + "_" + kind)
	for i, c := range b {
		switch {
		case c >= 'a' && c <= 'z':
			b[i] = c - 'a' + 'A'
		case c == '.' || c == '-':
			b[i] = '_'
		}
	}
	return string(b)
}
