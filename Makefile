# koda: the two newcomer commands are `make dev` and `make test`.
SHELL := /bin/bash
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
PYTEST_ARGS ?=
# Three test processes: two streams of long tests that mostly wait beside the rest;
# tests/fixtures/streams.py says how. Empty it to run everything in one process.
PYTEST_STREAMS ?= -n 3 --dist loadgroup
# setuptools announces every editable install with an "Editable installation." notice
# (a UserWarning, nothing to fix); filtered by its message so real warnings still show.
PIP_QUIET := PYTHONWARNINGS="ignore:Editable installation"

.PHONY: dev test install system-deps lint typecheck services-up services-down clean bench-pipeline bench-handoff bench-sse bench bench-memory bench-inflight bench-install bench-replay bench-replay-follow bench-chunk-repair bench-retention bench-control bench-schedules bench-memory-search bench-w4 chaos

## dev: start Kafka + PostgreSQL, migrate, create topics, run gateway + 2 workers + a scheduler; Ctrl-C stops all
dev: install
	APP_ENV=$${APP_ENV:-dev} $(BIN)/koda dev

## test: install what is missing, start the services, run the whole suite, stop the services
test: install
	APP_ENV=dev $(BIN)/python -m pytest $(PYTEST_STREAMS) $(PYTEST_ARGS)

# Toxiproxy (the chaos stack's network faults) is built from the Go module proxy into
# build/ once (skipped when the binary is there). The pinned version is the newest the
# proxy resolves for the v2 module; tests/chaos/toxiproxy.py holds it, read here.
TOXIPROXY_VERSION := $(shell sed -n 's/^TOXIPROXY_VERSION = "\(.*\)"$$/\1/p' tests/chaos/toxiproxy.py)
TOXIPROXY := build/toxiproxy-$(TOXIPROXY_VERSION)/toxiproxy-server

# Jaeger (the trace tests' OTLP receiver, `koda services up --with-tracing`) is built
# once into build/ the same way; `go install` refuses its module (replace directives),
# so it is a tool of a scratch module there. koda/localstack/jaeger.py holds the version.
JAEGER_VERSION := $(shell sed -n 's/^JAEGER_VERSION = "\(.*\)"$$/\1/p' koda/localstack/jaeger.py)
JAEGER := build/jaeger-$(JAEGER_VERSION)/jaeger

# DuckDB 1.5.5 and its iceberg extension (PyPI has none for DuckDB 2.0), which the
# Iceberg replay test reads tables back with, in a directory of its own.
DUCKDB_ICEBERG := $(VENV)/duckdb-iceberg/.installed

install: system-deps $(STAMP) $(TOXIPROXY) $(JAEGER) $(DUCKDB_ICEBERG)

$(DUCKDB_ICEBERG): tests/fixtures/duckdb-iceberg-requirements.txt | $(STAMP)
	@rm -rf $(@D)
	$(BIN)/python -m pip install -q --target $(@D) -r $<
	@touch $@

$(TOXIPROXY):
	@command -v go >/dev/null || { echo "go is missing: the chaos tests build Toxiproxy with it (apt-get install golang-go)"; exit 1; }
	@mkdir -p $(@D)
	GOBIN=$(abspath $(@D)) GOFLAGS=-mod=mod go install github.com/Shopify/toxiproxy/v2/cmd/server@$(TOXIPROXY_VERSION)
	@mv $(@D)/server $@

$(JAEGER):
	@command -v go >/dev/null || { echo "go is missing: the trace tests build Jaeger with it (apt-get install golang-go)"; exit 1; }
	@mkdir -p $(@D)/module
	@echo "building Jaeger $(JAEGER_VERSION) into $(@D) (about 5 minutes, once)"
	cd $(@D)/module && { test -f go.mod || go mod init koda.local/jaeger-build; } \
		&& GOFLAGS=-mod=mod go get -tool github.com/jaegertracing/jaeger/cmd/jaeger@$(JAEGER_VERSION) \
		&& GOFLAGS=-mod=mod go build -o ../jaeger.new github.com/jaegertracing/jaeger/cmd/jaeger
	@mv $(@D)/jaeger.new $@

# The install is editable in strict mode: a tree of links to each file of the package, so
# mypy and Python see koda_runtime as installed. A file added to or removed from the
# package changes the list below and installs again (editing a file needs nothing).
PKG_LIST := $(VENV)/.package-files
PKG_DIRS := koda cli gateway processors scheduler topics schemas deploy/local deploy/prometheus
EDITABLE := --config-settings editable_mode=strict

.PHONY: .package-list
$(PKG_LIST): .package-list
	@mkdir -p $(VENV)
	@find $(PKG_DIRS) -type f ! -path '*/__pycache__/*' ! -name '*.pyc' | LC_ALL=C sort > $@.new
	@if cmp -s $@.new $@; then rm $@.new; else mv $@.new $@; fi

$(STAMP): pyproject.toml constraints.txt $(PKG_LIST)
	@test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	@# the package was called koda before koda-runtime: a venv made then still has it
	@$(BIN)/python -m pip uninstall -q -y koda 2>/dev/null || true
	$(PIP_QUIET) $(BIN)/python -m pip install -q -c constraints.txt $(EDITABLE) -e '.[dev]'
	@touch $(STAMP)

## system-deps: Java, Chromium and kcat via apt-get where missing (PostgreSQL is a wheel)
system-deps:
	@bash deploy/local/system-deps.sh

lint:
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

typecheck:
	$(BIN)/mypy

services-up: install
	$(BIN)/koda services up

services-down:
	$(BIN)/koda services down

clean: services-down
	rm -rf .koda $(VENV)

## chaos: 10,000 runs x 1,000 users, 3 workers, SSE viewers, cancels and merges, 65+ process
## and network faults (Toxiproxy) on a 3-broker cluster, then the 60 s downstream-outage
## drill; prints tables, exits 1 on any violation (not in make test; about an hour).
## The smaller run: make chaos CHAOS_ARGS="--runs 300 --users 30 --brokers 1 --faults 13"
CHAOS_ARGS ?= --runs 10000 --users 1000 --brokers 3 --faults 65
chaos: install
	APP_ENV=dev $(BIN)/python -m tests.chaos.harness $(CHAOS_ARGS)
	APP_ENV=dev $(BIN)/python -m tests.chaos.drills --outage 60

## bench-pipeline: 1,000 runs x 20 chunks through the gateway to two workers (prints figures)
bench-pipeline: install
	APP_ENV=dev $(BIN)/python -m tests.bench.pipeline $(BENCH_ARGS)

## bench-schedules: 10,000 schedules due in one minute, two schedulers: fire lag, duplicates, CPU
bench-schedules: install
	APP_ENV=dev $(BIN)/python -m tests.bench.schedules $(BENCH_ARGS)

## bench-handoff: planned (SIGTERM) versus crash (kill -9) handoff times, then runs cut,
## restarted and paused by a join, a leave, a rolling restart and a kill -9 (40 s runs);
## BENCH_ARGS="--save F.json", or `python -m tests.bench.handoff --compare A.json B.json`
bench-handoff: install
	APP_ENV=dev $(BIN)/python -m tests.bench.handoff $(BENCH_ARGS)

## bench-sse: 200 runs x 5 viewers = 1,000 SSE streams on one gateway (prints figures)
bench-sse: install
	APP_ENV=dev $(BIN)/python -m tests.bench.sse $(BENCH_ARGS)

QUIX_VENV := .venv-quix
BENCH_STAMP := $(VENV)/.bench-installed

## bench-install: py-spy into .venv, Quix Streams (the W1 rival) into its own .venv-quix
bench-install: install $(BENCH_STAMP)

$(BENCH_STAMP): pyproject.toml constraints.txt tests/bench/quix-requirements.txt $(PKG_LIST)
	$(PIP_QUIET) $(BIN)/python -m pip install -q -c constraints.txt $(EDITABLE) -e '.[dev,bench]'
	@test -x $(QUIX_VENV)/bin/python || $(PY) -m venv $(QUIX_VENV)
	$(QUIX_VENV)/bin/python -m pip install -q -r tests/bench/quix-requirements.txt
	@touch $(BENCH_STAMP)

## bench: W1 throughput (koda vs ceiling, naive Faust, Quix Streams), W2 SSE latency,
## W3 gateway vs bare ASGI, replay, W4 assistant load (koda vs a direct FastAPI app),
## tracing's cost (W1 and W2 with tracing off vs on, side by side);
## median [min-max] of 3 repetitions (not part of make test)
bench: bench-install
	APP_ENV=dev $(BIN)/python -m tests.bench $(BENCH_ARGS)

## bench-w4: W4 alone: Poisson users streaming answers from a model-timed server, koda vs
## a direct FastAPI app, each at its highest sustained rate (BENCH_ARGS="--quick" for a check)
bench-w4: install
	APP_ENV=dev $(BIN)/python -m tests.bench --only w4 $(BENCH_ARGS)

## bench-memory: worker RSS over 100,000 runs and its slope (BENCH_ARGS="--runs 20000")
bench-memory: install
	APP_ENV=dev $(BIN)/python -m tests.bench.memory $(BENCH_ARGS)

## bench-inflight: runs in flight one worker serves (N = 64..1024 long streamed runs):
## RSS per run, CPU, loop-lag p99, chunk delay, queue waits; prints the largest N served
bench-inflight: install
	APP_ENV=dev $(BIN)/python -m tests.bench.inflight $(BENCH_ARGS)

## bench-replay: `koda replay` into DuckDB vs a raw confluent-kafka consumer on the same
## topic (200,000 chunk records; records/s median [min-max] of 3, and the ratio), then
## bench-replay-follow at its default size
bench-replay: install
	APP_ENV=dev $(BIN)/python -m tests.bench.replay $(BENCH_ARGS)
	APP_ENV=dev $(BIN)/python -m tests.bench.replay_follow

## bench-replay-follow: `koda replay --follow` into DuckDB and Iceberg beside W1: lag of
## each run's output row behind its finished_at (p50/p95/max vs 10 s), W1 with/without
bench-replay-follow: install
	APP_ENV=dev $(BIN)/python -m tests.bench.replay_follow $(BENCH_ARGS)

## bench-chunk-repair: the completeness pass's scan against reading the whole chunk topic,
## the pass filling gapped runs, and what the workers' published marks add to a group commit
bench-chunk-repair: install
	APP_ENV=dev $(BIN)/python -m tests.bench.chunk_repair $(BENCH_ARGS)

## bench-retention: W1 throughput and chunk latency with and without the retention sweep
## deleting a pre-filled backlog, side by side as ratios (BENCH_ARGS="--cost": deleting
## 1,000,000 message rows in batches against dropping them as a partition)
bench-retention: install
	APP_ENV=dev $(BIN)/python -m tests.bench.retention $(BENCH_ARGS)

## bench-control: cancel and merge latency with 200 runs streaming on 2 workers
## (POST -> handler stopped, -> `cancelled` at a viewer, -> `reset` at a viewer;
## p50/p99, median [min-max] of 3; not part of make test)
bench-control: install
	APP_ENV=dev $(BIN)/python -m tests.bench.control $(BENCH_ARGS)

## bench-memory-search: memory_search over 100,000 memories x 1,000 users; p50/p99 and
## recall@5 of each plan (exact per-user, pgvector iterative scan, HNSW then filter)
bench-memory-search: install
	APP_ENV=dev $(BIN)/python -m tests.bench.memory_search $(BENCH_ARGS)
