package consumer

import (
	"context"
	"errors"
	"fmt"
	"io"
	"strings"
	"testing"
	"unicode/utf8"

	"github.com/jackc/pgx/v5/pgconn"
	"github.com/stretchr/testify/require"
)

func TestEndOfRun(t *testing.T) {
	const maxAttempts = 3
	for _, tc := range []struct {
		name      string
		wrote     bool
		permanent bool
		attempts  int
		stopping  bool
		want      runEnd
	}{
		{name: "first failure", attempts: 1, want: endRetry},
		{name: "second failure", attempts: 2, want: endRetry},
		{name: "attempts used up", attempts: 3, want: endFail},
		{name: "past the cap", attempts: 7, want: endFail},
		{name: "a write ran, first attempt", wrote: true, attempts: 1, want: endFail},
		{name: "shutdown", stopping: true, attempts: 1, want: endRelease},
		{name: "shutdown on the last attempt", stopping: true, attempts: 3, want: endRelease},
		{name: "shutdown after a write", wrote: true, stopping: true, attempts: 1, want: endFail},
		{name: "permanent", permanent: true, attempts: 1, want: endFail},
		{name: "permanent on shutdown", permanent: true, stopping: true, attempts: 1, want: endFail},
	} {
		t.Run(tc.name, func(t *testing.T) {
			require.Equal(t, tc.want, endOfRun(tc.wrote, tc.permanent, tc.attempts, maxAttempts, tc.stopping))
		})
	}
}

func TestFailureWrapsItsReason(t *testing.T) {
	cause := errors.New("model unavailable")
	require.ErrorIs(t, failure(true, false, 1, cause), ErrSideEffect)
	require.ErrorIs(t, failure(true, false, 1, cause), cause)
	require.ErrorIs(t, failure(false, false, 3, cause), ErrAttemptsExhausted)
	require.Equal(t, "attempts exhausted after 3 attempts: model unavailable", failure(false, false, 3, cause).Error())
	require.Equal(t, cause, failure(false, true, 1, cause))
}

func TestSanitize(t *testing.T) {
	for _, tc := range []struct{ in, want string }{
		{"plain", "plain"},
		{"nul\x00byte", "nulbyte"},
		{"b\xffu", "b\uFFFDu"},
		{strings.Repeat("é", 10), strings.Repeat("é", 3) + "…"}, // 9 bytes max: 3 runes + "…" (3 bytes)
	} {
		got := sanitize(tc.in, 9)
		require.Equal(t, tc.want, got, "%q", tc.in)
		require.True(t, utf8.ValidString(got))
		require.LessOrEqual(t, len(got), 9)
	}
}

func FuzzSanitize(f *testing.F) {
	f.Add("hello", 5)
	f.Add("a\x00\xff\xfeé", 3)
	f.Fuzz(func(t *testing.T, s string, limit int) {
		if limit < 4 || limit > 1<<16 {
			limit = 4 + (limit&0xff+0xff)%0xff
		}
		got := sanitize(s, limit)
		if !utf8.ValidString(got) || strings.ContainsRune(got, 0) || len(got) > limit {
			t.Fatalf("sanitize(%q, %d) = %q", s, limit, got)
		}
	})
}

func TestTransient(t *testing.T) {
	for _, tc := range []struct {
		err  error
		want bool
	}{
		{&pgconn.PgError{Code: "40001"}, true},
		{&pgconn.PgError{Code: "40P01"}, true},
		{&pgconn.PgError{Code: "57P01"}, true},
		{&pgconn.PgError{Code: "08006"}, true},
		{fmt.Errorf("finish: %w", io.ErrUnexpectedEOF), true},
		{&pgconn.PgError{Code: "22021"}, false}, // bad text: no retry fixes it
		{&pgconn.PgError{Code: "23505"}, false},
		{errLeaseLost, false},
		{errConversationGone, false},
		{context.DeadlineExceeded, false},
		{errors.New("something else"), false},
	} {
		require.Equal(t, tc.want, transient(tc.err), "%v", tc.err)
	}
}

// A huge error text is cut before it is redacted, so a handler returning megabytes of error
// costs little, and what is kept is still redacted.
func TestDetailOfAHugeError(t *testing.T) {
	err := fmt.Errorf("post https://u:hunter2secret@h/x: %s", strings.Repeat("unauthorized:token=abc ", 1<<18))
	d := detail(err)
	require.LessOrEqual(t, len(d), maxDetailBytes)
	require.NotContains(t, d, "hunter2secret")
	require.NotContains(t, d, "token=abc")
}
