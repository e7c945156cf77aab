package wire

import (
	"context"
	"fmt"
	"strings"

	"github.com/nats-io/nats.go/jetstream"
)

// IsFenceSubject reports whether subject is one of the relay's fence subjects,
// <prefix>.fence.<kind>.<slot> (FenceSubject): a stream's message on such a subject is the
// relay's fence, not an event.
func IsFenceSubject(subject string) bool {
	parts := strings.Split(subject, ".")
	return len(parts) >= 4 && parts[len(parts)-3] == KindFence
}

// StreamEvents returns how many events st holds: its messages less the relay's fence messages
// (one per relay slot, on FenceFilter(prefix, kind)), which a stream of kind holds beside its
// events. A relay session writes its fence, then deletes the previous one: the fences are
// counted before and after the messages, and the higher count is taken, so that a fence written
// meanwhile never passes for an event (the count may be one low for a moment instead). It asks
// the server three times.
func StreamEvents(ctx context.Context, st jetstream.Stream, prefix, kind string) (uint64, error) {
	before, err := fenceCount(ctx, st, prefix, kind)
	if err != nil {
		return 0, err
	}
	info, err := st.Info(ctx)
	if err != nil {
		return 0, fmt.Errorf("stream info: %w", err)
	}
	after, err := fenceCount(ctx, st, prefix, kind)
	if err != nil {
		return 0, err
	}
	return info.State.Msgs - min(max(before, after), info.State.Msgs), nil
}

// fenceCount returns how many fence messages st holds on FenceFilter(prefix, kind).
func fenceCount(ctx context.Context, st jetstream.Stream, prefix, kind string) (uint64, error) {
	fences, err := st.Info(ctx, jetstream.WithSubjectFilter(FenceFilter(prefix, kind)))
	if err != nil {
		return 0, fmt.Errorf("stream info of the fence subjects: %w", err)
	}
	var n uint64
	for _, c := range fences.State.Subjects {
		n += c
	}
	return n, nil
}
