# Baton's tasks. `make help` lists them; `make test` is what CI runs.

GO      ?= go
GOFMT   ?= $(shell $(GO) env GOROOT)/bin/gofmt
VERSION ?= $(shell git describe --tags --always --dirty 2>/dev/null || echo dev)
BIN     ?= bin/baton

# golangci-lint is pinned: a new release brings new checks, and the lint result should change
# only when this line does. `make lint` installs it with go install when it is missing.
GOLANGCI_LINT_VERSION := v2.15.0
GOLANGCI_LINT ?= $(firstword $(subst :, ,$(shell $(GO) env GOPATH)))/bin/golangci-lint

.DEFAULT_GOAL := help
.PHONY: conflict-check help test test-long lint fmt-check vet golangci-lint golangci-lint-install bench demo build fuzz screenshots

help: ## list the targets
	@awk 'BEGIN { FS = ":.*## " } /^[a-zA-Z_-]+:.*## / { printf "  %-8s %s\n", $$1, $$2 }' $(MAKEFILE_LIST)

# go test runs the packages in the order they are named, -p (the number of cores) at a time, and
# names each package once. The slowest go first: last in order, the relay package (about five
# minutes with -race) ran alone at the end of the run while everything else had finished.
SLOWEST_PACKAGES := ./relay ./e2e ./cmd/baton

test: lint ## make lint, every test with the race detector (needs PostgreSQL server binaries), make fuzz
	@# The examples' own-module build test runs offline (GOPROXY=off) from the module cache,
	@# which then needs the go.mod file of every module in the graph, not only those a build
	@# fetches: a fresh machine has only those. Downloaded through a copy of go.mod, whose
	@# go.sum takes the new checksums: the checkout's go.sum is not touched.
	@d=$$(mktemp -d) && cp go.mod $$d/graph.mod && cp go.sum $$d/graph.sum && \
		$(GO) mod download -modfile=$$d/graph.mod all; s=$$?; rm -rf $$d; exit $$s
	$(GO) test -race -count=1 -timeout 20m $(SLOWEST_PACKAGES) ./...
	$(MAKE) --no-print-directory fuzz

# The long tier: tests at the sizes reviewers reproduced defects with (a neighbour's
# 10-million-row transaction), too heavy for CI's time budget. Files tagged `long`; run before
# resolving an issue that touches what they cover.
test-long: ## the long tier (go test -tags long -run '^TestLong', make fuzz FUZZTIME=500000x): heavy sizes CI does not run
	$(GO) test -tags long -count=1 -timeout 60m -run '^TestLong' ./...
	$(MAKE) --no-print-directory fuzz FUZZTIME=$(FUZZTIME_LONG)

# Each fuzz target runs FUZZTIME on top of its seeds and its checked-in corpus
# (testdata/fuzz/<target>/). A failure writes the failing input there: commit it with the fix.
# The targets are found in the tracked test files, so a new one runs without a change here.
# FUZZTIME counts inputs, not seconds: with a duration, Go 1.26's fuzzing coordinator can fail
# a target with "context deadline exceeded" at the deadline, without any failing input
# (golang/go#75804, fixed in Go 1.27); CI met it under load. On an idle 2-core machine
# 20000x takes 1-10s a target (50000x took 2-30s, two and a half minutes in all: CI's time
# budget); make test-long fuzzes each target on FUZZTIME_LONG inputs.
FUZZTIME ?= 20000x
FUZZTIME_LONG ?= 500000x
fuzz: ## run every fuzz target on FUZZTIME inputs (default 50000x) each
	@set -e; for dir in $$(git ls-files '*_test.go' | xargs grep -l '^func Fuzz' | xargs -n1 dirname | sort -u); do \
		for target in $$(sed -n 's/^func \(Fuzz[A-Za-z0-9_]*\)(.*/\1/p' $$dir/*_test.go); do \
			echo "$(GO) test -run '^\$$' -fuzz '^$$target\$$' -fuzztime $(FUZZTIME) ./$$dir"; \
			$(GO) test -run '^$$' -fuzz "^$$target\$$" -fuzztime $(FUZZTIME) ./$$dir; \
		done; \
	done

lint: fmt-check conflict-check vet golangci-lint ## gofmt check, leftover merge markers, go vet and golangci-lint (.golangci.yml)

# A merge that left its conflict markers in a file (README.md once had some) fails here.
conflict-check:
	@if git grep -nE '^(<{7}|>{7})( |$$)' -- . ':!*.pdf' ':!*.png'; then \
		echo "leftover merge conflict markers above"; exit 1; fi

# -s as golangci-lint's gofmt formatter checks it: composite literals without repeated types.
fmt-check:
	@echo '$(GOFMT) -s -l .'
	@files="$$($(GOFMT) -s -l .)"; if [ -n "$$files" ]; then \
		echo "these files need gofmt -s (run: gofmt -s -w .):"; echo "$$files"; exit 1; fi

vet:
	$(GO) vet ./...

golangci-lint: golangci-lint-install
	$(GOLANGCI_LINT) run ./...

# Installs the pinned golangci-lint when $(GOLANGCI_LINT) is missing or another version. Its
# authors prefer their release binaries to go install; go install needs only the Go module
# proxy, which is what CI can reach.
golangci-lint-install:
	@if ! $(GOLANGCI_LINT) version 2>/dev/null | grep -q 'version $(GOLANGCI_LINT_VERSION:v%=%) '; then \
		echo 'installing golangci-lint $(GOLANGCI_LINT_VERSION) (go install; takes a few minutes the first time)'; \
		GOBIN="$$(dirname '$(GOLANGCI_LINT)')" $(GO) install github.com/golangci/golangci-lint/v2/cmd/golangci-lint@$(GOLANGCI_LINT_VERSION); \
	fi
	@$(GOLANGCI_LINT) version

bench: ## run the benchmarks
	$(GO) test -run '^$$' -bench . -benchmem -timeout 30m ./...

demo: ## run the end-to-end demo (go run ./cmd/baton demo)
	$(GO) run ./cmd/baton demo

# The console's browser tests take the README's pictures; `make test` runs the same tests with
# the pictures going to a temp dir, so CI never modifies tracked files.
screenshots: ## run the console's browser tests (needs chromium) and write their screenshots to docs/
	BATON_SCREENSHOTS_DIR=$(CURDIR)/docs $(GO) test -count=1 -run 'TestConsole' ./e2e/console

build: ## build bin/baton with the version stamped in (VERSION=...)
	$(GO) build -ldflags "-X main.version=$(VERSION)" -o $(BIN) ./cmd/baton
