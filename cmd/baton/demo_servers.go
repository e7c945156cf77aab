package main

import (
	"context"
	"fmt"
	"io"

	"github.com/batonhq/baton/internal/config"
	"github.com/batonhq/baton/internal/throwaway"
)

// demoPostgres is localPostgres for the demo, which writes ids starting with runID.
func demoPostgres(ctx context.Context, cfg *config.Config, runID string, out io.Writer) (stop func() error, err error) {
	return localPostgres(ctx, cfg, throwaway.PostgresOptions{}, fmt.Sprintf("the demo writes ids starting with %s- there "+
		"and its workers answer every pending message", runID), noPostgresError, out)
}

// noPostgresError says how to give the demo a PostgreSQL when the server binaries are missing.
func noPostgresError(err error) error {
	return noPostgresErrorFor("the demo", "the demo writes into that database", err)
}

// demoNATS is localNATS for the demo.
func demoNATS(cfg *config.Config, out io.Writer) (stop func() error, err error) {
	stop, _, err = localNATS(cfg, "demo", out)
	return stop, err
}
