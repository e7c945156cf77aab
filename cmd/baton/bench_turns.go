package main

import (
	"context"
	"errors"
	"io"
)

// runBenchTurns runs `baton bench turns`. A stub until the workers' benchmark moves here.
func runBenchTurns(_ context.Context, _ []string, _, _ io.Writer) error {
	return errors.New("baton bench turns: not built yet")
}
