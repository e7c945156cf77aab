package pgname

import (
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
)

func TestNames(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name              string
		slot, publication bool
	}{
		{"baton", true, true},
		{"baton_0", true, true},
		{"_x", true, true},
		{"1abc", true, false},
		{"0", true, false},
		{strings.Repeat("a", 63), true, true},
		{strings.Repeat("a", 64), false, false},
		{"", false, false},
		{"Baton", false, false},
		{"a-b", false, false},
		{"a.b", false, false},
		{"a'b", false, false},
		{"é", false, false},
	} {
		require.Equal(t, tc.slot, Slot(tc.name) == nil, "slot %q", tc.name)
		require.Equal(t, tc.publication, Publication(tc.name) == nil, "publication %q", tc.name)
	}
}
