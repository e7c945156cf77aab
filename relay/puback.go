package relay

import (
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"unicode/utf8"

	"github.com/nats-io/nats.go/jetstream"
)

// pubAck is what the relay reads from JetStream's reply to a publish:
//
//	{"stream":"AGENT_TURNS","seq":42}
//	{"stream":"AGENT_TURNS","seq":42,"duplicate":true}
//	{"error":{"code":503,"err_code":10077,"description":"maximum messages exceeded"}}
//
// apiErr is set when the reply carries an error object.
//
// Replies on a fast-ingest batch (see batch.go) use the same reader: a flow acknowledgement
// {"type":"ack","seq":100,"msgs":50}, a gap {"type":"gap","last_seq":9,"seq":11}, an error
// {"type":"err","seq":7,"error":{...}}, and at the end the batch's PubAck, which adds
// "batch" and "count" to the fields above.
type pubAck struct {
	stream    string
	seq       uint64
	duplicate bool
	domain    string
	apiErr    *jetstream.APIError

	kind  string // "type": "ack", "gap" or "err" on a fast-ingest batch; "" for a PubAck
	msgs  uint64 // a flow acknowledgement's "msgs": the server acknowledges every msgs messages
	batch string // a batch's PubAck: its id
	count uint64 // a batch's PubAck: how many messages it stored
}

// errInvalidPubAck is returned for a reply that is neither a PubAck nor an API error.
var errInvalidPubAck = errors.New("invalid PubAck")

// parsePubAck decodes a PubAck by hand: encoding/json was a visible share of the relay's CPU
// per event. Keys match exactly (JetStream writes them in lower case), values follow
// encoding/json's rules (null leaves a field zero; a number out of range or of the wrong type
// is an error), unknown keys are skipped whatever their value. It never panics on any input.
func parsePubAck(b []byte) (pubAck, error) {
	var a pubAck
	s := scanner{b: b}
	err := s.object(func(key []byte) error {
		var err error
		switch string(key) {
		case "stream":
			a.stream, err = s.str()
		case "seq":
			a.seq, err = s.uint(math.MaxUint64)
		case "duplicate":
			a.duplicate, err = s.bool()
		case "domain":
			a.domain, err = s.str()
		case "error":
			a.apiErr, err = s.apiError()
		case "type":
			a.kind, err = s.str()
		case "msgs":
			a.msgs, err = s.uint(math.MaxUint16)
		case "batch":
			a.batch, err = s.str()
		case "count":
			a.count, err = s.uint(math.MaxUint64)
		default:
			err = s.skip()
		}
		return err
	})
	if err == nil {
		s.ws()
		if s.i != len(s.b) {
			err = s.fail("data after the object")
		}
	}
	if err != nil {
		return pubAck{}, fmt.Errorf("%w: %w", errInvalidPubAck, err)
	}
	return a, nil
}

// scanner reads JSON from b at i.
type scanner struct {
	b []byte
	i int
}

func (s *scanner) fail(what string) error {
	return fmt.Errorf("%s at offset %d", what, s.i)
}

func (s *scanner) ws() {
	for s.i < len(s.b) {
		switch s.b[s.i] {
		case ' ', '\t', '\n', '\r':
			s.i++
		default:
			return
		}
	}
}

// peek skips white space and returns the next byte, 0 at the end.
func (s *scanner) peek() byte {
	s.ws()
	if s.i < len(s.b) {
		return s.b[s.i]
	}
	return 0
}

// literal consumes word (true, false, null) when it comes next.
func (s *scanner) literal(word string) bool {
	if len(s.b)-s.i >= len(word) && string(s.b[s.i:s.i+len(word)]) == word {
		s.i += len(word)
		return true
	}
	return false
}

// object reads an object, calling member with each key while the scanner stands before that
// key's value; member must consume the value.
func (s *scanner) object(member func(key []byte) error) error {
	if s.peek() != '{' {
		return s.fail("want an object")
	}
	s.i++
	if s.peek() == '}' {
		s.i++
		return nil
	}
	for {
		if s.peek() != '"' {
			return s.fail("want a key")
		}
		key, err := s.key()
		if err != nil {
			return err
		}
		if s.peek() != ':' {
			return s.fail("want ':'")
		}
		s.i++
		s.ws()
		if err := member(key); err != nil {
			return err
		}
		switch s.peek() {
		case ',':
			s.i++
		case '}':
			s.i++
			return nil
		default:
			return s.fail("want ',' or '}'")
		}
	}
}

// key reads an object key, decoding escapes the way encoding/json does.
func (s *scanner) key() ([]byte, error) {
	start := s.i
	raw, escaped, err := s.rawString()
	if err != nil || !escaped {
		return raw, err
	}
	var v string
	if err := json.Unmarshal(s.b[start:s.i], &v); err != nil {
		return nil, fmt.Errorf("key at offset %d: %w", start, err)
	}
	return []byte(v), nil
}

// rawString consumes a string and returns its bytes between the quotes, and whether they hold
// an escape or bytes that are not plain ASCII (so they need decoding).
func (s *scanner) rawString() (raw []byte, escaped bool, err error) {
	s.i++ // the opening quote
	start := s.i
	for s.i < len(s.b) {
		c := s.b[s.i]
		switch {
		case c == '"':
			raw = s.b[start:s.i]
			s.i++
			return raw, escaped, nil
		case c == '\\':
			escaped = true
			s.i += 2
		case c < 0x20:
			return nil, false, s.fail("control character in string")
		case c >= utf8.RuneSelf:
			escaped = true
			s.i++
		default:
			s.i++
		}
	}
	return nil, false, s.fail("unterminated string")
}

// str reads a string value or null.
func (s *scanner) str() (string, error) {
	if s.literal("null") {
		return "", nil
	}
	if s.peek() != '"' {
		return "", s.fail("want a string")
	}
	start := s.i
	raw, escaped, err := s.rawString()
	if err != nil {
		return "", err
	}
	if !escaped {
		return string(raw), nil
	}
	// Escapes and non-ASCII text are rare here (a stream name, a description): let
	// encoding/json decode them exactly.
	var v string
	if err := json.Unmarshal(s.b[start:s.i], &v); err != nil {
		return "", fmt.Errorf("string at offset %d: %w", start, err)
	}
	return v, nil
}

// uint reads a non-negative integer up to limit, or null.
func (s *scanner) uint(limit uint64) (uint64, error) {
	if s.literal("null") {
		return 0, nil
	}
	start := s.i
	var v uint64
	for s.i < len(s.b) && s.b[s.i] >= '0' && s.b[s.i] <= '9' {
		d := uint64(s.b[s.i] - '0')
		if v > (limit-d)/10 {
			return 0, s.fail("number out of range")
		}
		v = v*10 + d
		s.i++
	}
	switch n := s.i - start; {
	case n == 0:
		return 0, s.fail("want a non-negative integer")
	case n > 1 && s.b[start] == '0':
		return 0, s.fail("leading zero")
	}
	if s.i < len(s.b) && (s.b[s.i] == '.' || s.b[s.i] == 'e' || s.b[s.i] == 'E') {
		return 0, s.fail("want an integer")
	}
	return v, nil
}

// int reads an integer that fits an int, or null.
func (s *scanner) int() (int, error) {
	neg := s.i < len(s.b) && s.b[s.i] == '-'
	if neg {
		s.i++
		if s.literal("null") {
			return 0, s.fail("want a number")
		}
	}
	limit := uint64(math.MaxInt)
	if neg {
		limit++
	}
	v, err := s.uint(limit)
	if neg {
		return int(-v), err //nolint:gosec // v ≤ -MinInt, checked by uint
	}
	return int(v), err //nolint:gosec // v ≤ MaxInt, checked by uint
}

func (s *scanner) bool() (bool, error) {
	switch {
	case s.literal("true"):
		return true, nil
	case s.literal("false"), s.literal("null"):
		return false, nil
	}
	return false, s.fail("want a boolean")
}

// apiError reads JetStream's error object, or null.
func (s *scanner) apiError() (*jetstream.APIError, error) {
	if s.literal("null") {
		return nil, nil
	}
	e := &jetstream.APIError{}
	err := s.object(func(key []byte) error {
		var err error
		switch string(key) {
		case "code":
			e.Code, err = s.int()
		case "err_code":
			var v uint64
			v, err = s.uint(math.MaxUint16)
			e.ErrorCode = jetstream.ErrorCode(v) //nolint:gosec // G115: s.uint refused values over MaxUint16
		case "description":
			e.Description, err = s.str()
		default:
			err = s.skip()
		}
		return err
	})
	return e, err
}

// skip consumes any value. It checks structure, strings and literals, not the form of numbers.
// It loops rather than recurses, so no nesting depth can exhaust the stack.
func (s *scanner) skip() error {
	var open []byte // the containers the value is inside: '{' or '['
	for {
		if err := s.skipScalarOrOpen(&open); err != nil {
			return err
		}
		// After a value: close containers until one continues with another member.
	closing:
		for {
			if len(open) == 0 {
				return nil
			}
			inObject := open[len(open)-1] == '{'
			switch c := s.peek(); {
			case c == ',':
				s.i++
				if inObject {
					if err := s.memberKey(); err != nil {
						return err
					}
				}
				break closing
			case c == '}' && inObject, c == ']' && !inObject:
				s.i++
				open = open[:len(open)-1]
			default:
				return s.fail("want ',' or the container's end")
			}
		}
	}
}

// skipScalarOrOpen consumes a scalar, an empty container, or the start of a container up to
// its first value (pushed on open).
func (s *scanner) skipScalarOrOpen(open *[]byte) error {
	for {
		switch c := s.peek(); {
		case c == '"':
			_, _, err := s.rawString()
			return err
		case c == '{':
			s.i++
			if s.peek() == '}' {
				s.i++
				return nil
			}
			*open = append(*open, '{')
			if s.peek() != '"' {
				return s.fail("want a key")
			}
			if err := s.memberKey(); err != nil {
				return err
			}
		case c == '[':
			s.i++
			if s.peek() == ']' {
				s.i++
				return nil
			}
			*open = append(*open, '[')
		case c == 't':
			return s.want(s.literal("true"))
		case c == 'f':
			return s.want(s.literal("false"))
		case c == 'n':
			return s.want(s.literal("null"))
		case c == '-' || (c >= '0' && c <= '9'):
			start := s.i
			for s.i < len(s.b) {
				c := s.b[s.i]
				if (c < '0' || c > '9') && c != '-' && c != '+' && c != '.' && c != 'e' && c != 'E' {
					break
				}
				s.i++
			}
			if s.i == start+1 && c == '-' {
				return s.fail("want a number")
			}
			return nil
		default:
			return s.fail("want a value")
		}
	}
}

// memberKey consumes a key of a skipped object and its ':'.
func (s *scanner) memberKey() error {
	if s.peek() != '"' {
		return s.fail("want a key")
	}
	if _, _, err := s.rawString(); err != nil {
		return err
	}
	if s.peek() != ':' {
		return s.fail("want ':'")
	}
	s.i++
	return nil
}

func (s *scanner) want(ok bool) error {
	if !ok {
		return s.fail("want a literal")
	}
	return nil
}
