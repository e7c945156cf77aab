package wire

// HeaderTraceparent is the W3C Trace Context header (https://www.w3.org/TR/trace-context/) of a
// turn or outcome event, present when the event belongs to a trace: on a turn event, the span
// that sent the message (producer.Send with a span in its context); on an outcome, the worker's
// turn span. Its value always passes ValidTraceparent: the relay drops a stored value that does
// not, and publishes the event without the header. Any OpenTelemetry propagator reads it, e.g.
//
//	ctx = propagation.TraceContext{}.Extract(ctx, propagation.HeaderCarrier(msg.Headers()))
//
// The name is lowercase, as the W3C specifies; NATS header names are case-sensitive.
const HeaderTraceparent = "traceparent"

// TraceparentLen is the length of a version-00 traceparent:
// "00-<32 hex trace id>-<16 hex span id>-<2 hex flags>".
const TraceparentLen = 55

// ValidTraceparent reports whether s is a W3C traceparent of version 00, exactly as the
// specification writes it: "00-" then a 32-digit trace id, "-", a 16-digit span id, "-" and
// 2-digit flags, all lowercase hexadecimal, with trace id and span id not all zeros, and
// nothing before or after (no spaces, no line breaks, no further fields). It allocates nothing.
// Versions other than 00 are refused: Baton writes only 00, and a stored value is what some
// database role wrote, so it is taken only in the one form the specification fixes.
func ValidTraceparent(s string) bool {
	if len(s) != TraceparentLen || s[0] != '0' || s[1] != '0' || s[2] != '-' || s[35] != '-' || s[52] != '-' {
		return false
	}
	return lowerHex(s[3:35]) && lowerHex(s[36:52]) && lowerHex(s[53:55]) &&
		!allZeros(s[3:35]) && !allZeros(s[36:52])
}

func lowerHex(s string) bool {
	for i := 0; i < len(s); i++ {
		if c := s[i]; !('0' <= c && c <= '9' || 'a' <= c && c <= 'f') {
			return false
		}
	}
	return true
}

func allZeros(s string) bool {
	for i := 0; i < len(s); i++ {
		if s[i] != '0' {
			return false
		}
	}
	return true
}
