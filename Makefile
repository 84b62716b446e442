# koda: the two newcomer commands are `make dev` and `make test`.
SHELL := /bin/bash
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
PYTEST_ARGS ?=

.PHONY: dev test install system-deps lint typecheck services-up services-down clean bench-pipeline bench-handoff bench-sse

## dev: start Kafka + PostgreSQL, migrate, create topics, run gateway + 2 workers; Ctrl-C stops all
dev: install
	APP_ENV=$${APP_ENV:-dev} $(BIN)/koda dev

## test: install what is missing, start the services, run the whole suite, stop the services
test: install
	APP_ENV=dev $(BIN)/python -m pytest $(PYTEST_ARGS)

install: system-deps $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	@test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -c constraints.txt -e '.[dev]'
	@touch $(STAMP)

## system-deps: PostgreSQL server binaries, Java and Chromium, via apt-get where missing
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

## bench-pipeline: 1,000 runs x 20 chunks through the gateway to two workers (prints figures)
bench-pipeline: install
	APP_ENV=dev $(BIN)/python -m tests.bench.pipeline $(BENCH_ARGS)

## bench-handoff: planned (SIGTERM) versus crash (kill -9) handoff times
bench-handoff: install
	APP_ENV=dev $(BIN)/python -m tests.bench.handoff $(BENCH_ARGS)

## bench-sse: 200 runs x 5 viewers = 1,000 SSE streams on one gateway (prints figures)
bench-sse: install
	APP_ENV=dev $(BIN)/python -m tests.bench.sse $(BENCH_ARGS)
