# outbox-notify developer commands. `make help` lists them.
# Every target creates .venv (with the PYTHON you give, default python3) when it is missing.

PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.DEFAULT_GOAL := help
.PHONY: help venv test pytest lint unit demo bench bench-quick bench-versus chaos chaos-quick trigger-bench clean

help:  ## list the targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  %-14s %s\n", $$1, $$2}'

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[test,lint,redis,sentry,datadog,otel,prometheus]'
	touch $(STAMP)

venv: $(STAMP)  ## create .venv and install the package with its test and lint tools

lint: $(STAMP)  ## ruff and mypy --strict
	$(BIN)/ruff check outbox_notify tests devtools bench chaos example noxfile.py
	$(BIN)/ruff format --check outbox_notify tests devtools bench chaos example noxfile.py
	$(BIN)/mypy

test: $(STAMP)  ## lint, then the whole suite on the oldest and the newest supported releases (nox; 25-35 min)
	$(MAKE) --no-print-directory lint
	$(BIN)/nox $(NOX_ARGS) -- $(PYTEST_ARGS)

pytest: $(STAMP)  ## the whole suite once, in .venv (newest releases, Python of .venv; 10-15 min)
	$(BIN)/pytest $(PYTEST_ARGS)

unit: $(STAMP)  ## only the tests that need no services
	$(BIN)/pytest tests/unit $(PYTEST_ARGS)

demo: $(STAMP)  ## end-to-end demo: migrate, relay + Celery worker, orders committed and rolled back
	$(BIN)/python -m example.demo $(DEMO_ARGS)

bench: $(STAMP)  ## side-by-side benchmarks with django-celery-outbox on Redis and RabbitMQ; then once, held, long_writer, the old-snapshot and soak runs; writes docs/benchmarks.md (about 2 h 15 min; --scenarios to choose)
	$(BIN)/python -m bench.run $(BENCH_ARGS)

bench-quick: $(STAMP)  ## the benchmarks in their short smoke mode, both brokers, with once and held (3-5 min)
	$(BIN)/python -m bench.run --quick $(BENCH_ARGS)

VERSUS ?= 79badb9
bench-versus: $(STAMP)  ## this checkout against commit VERSUS (default 79badb9): Redis drain and latency, alternating (about 6 min)
	$(BIN)/python -m bench.run --no-peer --brokers redis --scenarios versus --versus $(VERSUS) --no-docs --out bench/results/versus.json $(BENCH_ARGS)

chaos: $(STAMP)  ## fault injection under load on Redis and RabbitMQ; every message and effect counted (about 12 min)
	$(BIN)/python -m chaos.run $(CHAOS_ARGS)

chaos-quick: $(STAMP)  ## the chaos suite's short mode, both brokers (what CI runs; 3-5 min)
	$(BIN)/python -m chaos.run --quick $(CHAOS_ARGS)

trigger-bench: $(STAMP)  ## writer throughput with and without the NOTIFY trigger (1, 8, 32 writers)
	$(BIN)/python -m bench.trigger $(BENCH_ARGS)

clean:  ## remove the virtualenvs (.venv and nox's) and build output
	rm -rf $(VENV) .nox build dist *.egg-info
