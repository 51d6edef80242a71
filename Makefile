# gorgo: `make run` starts everything, `make test` runs every test. Each does its own setup.
SHELL := /bin/bash
.DEFAULT_GOAL := help

VENV := .venv
PY := $(VENV)/bin/python
# The first Python >= 3.11 on PATH builds the virtualenv.
PYTHON ?= $(shell for p in python3.13 python3.12 python3.11 python3; do \
	command -v $$p >/dev/null 2>&1 && $$p -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null && { echo $$p; break; }; done)
PG_TEST_URL ?= postgres://postgres@127.0.0.1:5432/test
export GORGO_DEMO_DURATION_S ?= 3600

.PHONY: help install native run test lint format bench clean

help:
	@echo "make run    set up and start the whole system (control plane, workers, gateways, emulated fleet, demo traffic)"
	@echo "make test   set up and run every test (lint, unit, end-to-end, browser)"
	@echo "make lint   ruff"
	@echo "make bench  run the benchmarks (see benchmarks/README.md)"

$(VENV)/.installed: pyproject.toml
	@test -n "$(PYTHON)" || { echo "gorgo needs Python 3.11 or newer on PATH"; exit 1; }
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test,bench,native]'
	touch $@

install: $(VENV)/.installed

# The gateway's hot modules compiled with mypyc into var/mypyc/<source hash>/ (routing/native.py):
# reused while the sources are unchanged; without a compiler the gateway runs pure Python.
native: install
	@$(PY) scripts/build_native.py

lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

format: install
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

run: install native
	@mkdir -p var
	@REDIS_URL=$$($(PY) scripts/ensure_redis.py) || exit 1; export REDIS_URL; \
	test -s var/operator-password || (umask 077; $(PY) -c "import secrets; print(secrets.token_urlsafe(12))" > var/operator-password); \
	export GORGO_OPERATOR_PASSWORD="$${GORGO_OPERATOR_PASSWORD:-$$(cat var/operator-password)}"; \
	$(PY) manage.py migrate --no-input -v 0 && \
	$(PY) manage.py seed_demo --token-file var/api-token && \
	$(PY) manage.py seed_demo_key && \
	GORGO_DEMO_KEY=$$(cat var/demo-key) bash scripts/banner.sh && \
	exec $(VENV)/bin/honcho start -f Procfile

test: lint native
	@bash scripts/ensure_chromium.sh || true
	@bash scripts/ensure_promtool.sh || true
	@# vLLM's CPU build for tests/conformance (once: ~3-4 min; then instant), in the background:
	@# the test session waits for it (a lock) only when its real-vLLM tests come, last. If it
	@# fails, every real-vLLM test FAILS with its log (tests/real_vllm.py), never skips.
	@mkdir -p var && ($(PY) scripts/ensure_vllm.py >var/ensure-vllm.log 2>&1 &)
	@REDIS_URL=$$($(PY) scripts/ensure_redis.py) || exit 1; export REDIS_URL; \
	if $(PY) -c "import psycopg, sys; psycopg.connect('$(PG_TEST_URL)', connect_timeout=3).close()" 2>/dev/null; then \
		echo "== full suite on PostgreSQL ($(PG_TEST_URL)), Redis $$REDIS_URL"; \
		DATABASE_URL=$(PG_TEST_URL) PY=$(PY) bash scripts/run_tests.sh && \
		echo "== the database's unit and API tests again on SQLite" && \
		$(PY) -m pytest -q -n $${TEST_WORKERS:-3} --dist loadgroup -m "uses_db and not e2e and not browser"; \
	else \
		echo "== PostgreSQL not reachable at $(PG_TEST_URL): full suite on SQLite, Redis $$REDIS_URL"; \
		PY=$(PY) bash scripts/run_tests.sh; \
	fi

bench: install
	$(PY) -m pip install -q -e '.[peers]' || echo "the peers (vllm-router, gorgo-lb) could not be installed: the benchmarks run without them"
	bash scripts/ensure_wrk.sh
	@REDIS_URL=$$($(PY) scripts/ensure_redis.py) || exit 1; export REDIS_URL; \
	$(PY) benchmarks/gateway_overhead.py && \
	$(PY) benchmarks/gateway_idle.py && \
	$(PY) benchmarks/front_door_cpu.py && \
	$(PY) benchmarks/hotpath.py && \
	$(PY) benchmarks/shared_limits_wan.py && \
	$(PY) benchmarks/routing_decision.py && \
	$(PY) benchmarks/shadow_cost.py && \
	$(PY) benchmarks/kv_cache_pressure.py && \
	$(PY) benchmarks/routing_quality.py

clean:
	rm -rf $(VENV) var .pytest_cache .ruff_cache
