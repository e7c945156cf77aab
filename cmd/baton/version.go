package main

import (
	"context"
	"fmt"
	"io"
	"runtime/debug"
	"strings"
)

// version is set at build time: go build -ldflags "-X main.version=v1.2.3".
var version = "dev"

const versionSummary = "print the version"

func runVersion(_ context.Context, args []string, stdout, stderr io.Writer) error {
	fs := newFlagSet("version", "Version prints the version of this binary, the Go version it was built with and,\nwhen known, its commit.", stderr)
	if err := parseFlags(fs, args); err != nil {
		return err
	}
	info, _ := debug.ReadBuildInfo()
	fmt.Fprintln(stdout, "baton", versionString(version, info))
	return nil
}

// versionString returns v, or when v is "dev" the module version the binary was built at
// (go install ...@v1.2.3), followed by the Go version and VCS revision when known.
func versionString(v string, info *debug.BuildInfo) string {
	if info == nil {
		return v
	}
	if v == "dev" && info.Main.Version != "" && info.Main.Version != "(devel)" {
		v = info.Main.Version
	}
	details := []string{info.GoVersion}
	var rev, dirty string
	for _, s := range info.Settings {
		switch s.Key {
		case "vcs.revision":
			rev = s.Value
		case "vcs.modified":
			if s.Value == "true" {
				dirty = "-dirty"
			}
		}
	}
	if rev != "" {
		details = append(details, "commit "+rev[:min(12, len(rev))]+dirty)
	}
	return fmt.Sprintf("%s (%s)", v, strings.Join(details, ", "))
}
