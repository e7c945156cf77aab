// Command healthcheck probes an HTTP endpoint for container health checks: it exits 0 when a
// GET of the URL answers 2xx within the timeout, 1 otherwise, and 2 on a usage error.
//
// Baton's images are distroless (no shell, curl or wget), so they carry this probe for Docker
// HEALTHCHECK and docker compose, pointed at the ops listener of BATON_METRICS_ADDR:
//
//	healthcheck http://127.0.0.1:9090/healthz
//
// Kubernetes probes the same endpoints with httpGet and does not need it.
package main

import (
	"context"
	"flag"
	"fmt"
	"io"
	"net/http"
	"os"
	"time"
)

func main() {
	os.Exit(run(os.Args[1:], os.Stderr))
}

func run(args []string, stderr io.Writer) int {
	fs := flag.NewFlagSet("healthcheck", flag.ContinueOnError)
	fs.SetOutput(stderr)
	timeout := fs.Duration("timeout", 3*time.Second, "how long the request may take")
	fs.Usage = func() {
		fmt.Fprintln(fs.Output(), "usage: healthcheck [-timeout 3s] http://host:port/path")
		fs.PrintDefaults()
	}
	if err := fs.Parse(args); err != nil {
		return 2
	}
	if fs.NArg() != 1 {
		fs.Usage()
		return 2
	}
	ctx, cancel := context.WithTimeout(context.Background(), *timeout)
	defer cancel()
	if err := probe(ctx, fs.Arg(0)); err != nil {
		fmt.Fprintln(stderr, "healthcheck:", err)
		return 1
	}
	return 0
}

// probe GETs url and returns nil on a 2xx answer.
func probe(ctx context.Context, url string) error {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	if err != nil {
		return err
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return err
	}
	defer func() { _ = resp.Body.Close() }()
	_, _ = io.Copy(io.Discard, io.LimitReader(resp.Body, 4096))
	if resp.StatusCode < 200 || resp.StatusCode > 299 {
		return fmt.Errorf("GET %s: %s", url, resp.Status)
	}
	return nil
}
