# Baton's tasks. `make help` lists them; `make test` is what CI runs.

GO      ?= go
GOFMT   ?= $(shell $(GO) env GOROOT)/bin/gofmt
VERSION ?= $(shell git describe --tags --always --dirty 2>/dev/null || echo dev)
BIN     ?= bin/baton

.DEFAULT_GOAL := help
.PHONY: help test lint fmt-check vet bench demo build

help: ## list the targets
	@awk 'BEGIN { FS = ":.*## " } /^[a-zA-Z_-]+:.*## / { printf "  %-8s %s\n", $$1, $$2 }' $(MAKEFILE_LIST)

test: lint ## gofmt check, go vet, then every test with the race detector (needs PostgreSQL server binaries)
	$(GO) test -race -count=1 -timeout 20m ./...

lint: fmt-check vet ## gofmt check and go vet

fmt-check:
	@echo '$(GOFMT) -l .'
	@files="$$($(GOFMT) -l .)"; if [ -n "$$files" ]; then \
		echo "these files need gofmt (run: gofmt -w .):"; echo "$$files"; exit 1; fi

vet:
	$(GO) vet ./...

bench: ## run the benchmarks
	$(GO) test -run '^$$' -bench . -benchmem -timeout 30m ./...

demo: ## run the end-to-end demo (go run ./cmd/baton demo)
	$(GO) run ./cmd/baton demo

build: ## build bin/baton with the version stamped in (VERSION=...)
	$(GO) build -ldflags "-X main.version=$(VERSION)" -o $(BIN) ./cmd/baton
