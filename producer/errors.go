package producer

import (
	"errors"
	"fmt"
)

// ErrInvalidInput is the class of every input error: a message or conversation id that is empty,
// longer than 200 bytes, not valid UTF-8 or holding a NUL byte, a message id that starts with
// ReservedIDPrefix ("baton:", in any letter case), and content that is empty, too large, not
// valid UTF-8 or holding a NUL byte. Input errors are detected before any I/O, so nothing was
// written. The error returned is an *InputError that names the field.
var ErrInvalidInput = errors.New("producer: invalid input")

// ErrContentTooLarge is the input error for content longer than Config.MaxContentBytes.
// errors.Is(err, ErrInvalidInput) holds for it too.
var ErrContentTooLarge = fmt.Errorf("%w: content too large", ErrInvalidInput)

// ErrConflict means the message id is already taken by a different message: one in another
// conversation, with other content, with a role other than user, or one that was not inserted by
// this package (it has no outbox row). Nothing was written. A client that reuses a request id for
// a new message gets this error; a client that retries the same message does not.
//
// The error is the same for every one of these cases and carries no reason: a caller must not
// learn that the id exists in another conversation, nor that message's role or content. Its
// text is this sentinel's, wrapped only with the caller's own message and conversation ids.
var ErrConflict = errors.New("producer: message id already used by a different message")

// ErrConversationNotFound means the conversation does not exist. Send never creates conversations
// (see CreateConversation); nothing was written.
var ErrConversationNotFound = errors.New("producer: conversation not found")

// InputError describes an invalid field. errors.Is(err, ErrInvalidInput) holds for every
// InputError, and errors.Is(err, ErrContentTooLarge) for content over the size limit.
type InputError struct {
	// Field is the Go name of the invalid field: "ConversationID", "ID" or "Content".
	Field string
	// Reason says what is wrong with it, e.g. "is empty", "contains a NUL byte" or, for ID, that
	// it starts with the prefix reserved for Baton (ReservedIDPrefix).
	Reason string

	err error // ErrInvalidInput or ErrContentTooLarge
}

func (e *InputError) Error() string {
	return fmt.Sprintf("%v: %s %s", e.Unwrap(), e.Field, e.Reason)
}

// Unwrap returns ErrContentTooLarge for content over the size limit and ErrInvalidInput
// otherwise.
func (e *InputError) Unwrap() error {
	if e.err == nil {
		return ErrInvalidInput
	}
	return e.err
}
