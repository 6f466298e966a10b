# The two commands a newcomer needs: `make test` and `make demo`.
# Both build .venv on first use, so a fresh clone needs nothing but python3.

PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: test lint typecheck pytest demo bench-hashring bench-decision bench-proxy figures clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[dev]'
	touch $(STAMP)

test: $(STAMP) lint typecheck pytest

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

typecheck: $(STAMP)
	$(BIN)/mypy

# Two processes: the suite is mostly waiting on sockets and subprocesses, and
# 2 cores is the smallest machine it must fit in 5 minutes on.  Tests that hold a
# request rate (marked serial) run after, alone: beside another test on 2 cores
# they can be starved of CPU (only their files are collected for that part).
# Work stealing: a worker that runs out takes the other's queued tests, so a few
# long ones near the end do not leave one core idle (4:29-4:34 -> 4:15 here).
#
# Bytecode is written while testing, whatever the environment says
# (PYTHONDONTWRITEBYTECODE=1 on the CI image): pytest rewrites the asserts of
# ~440 modules (ours and its plugins') on every start otherwise, ~8 s of CPU each
# time it collects, three times a run; and every router process the tests
# start compiles the router anew.
pytest: export PYTHONDONTWRITEBYTECODE :=
pytest: $(STAMP)
	$(BIN)/pytest -n 2 --dist worksteal -m "not serial"
	$(BIN)/pytest -m serial $$(grep -l 'mark\.serial' tests/test_*.py)

demo: $(STAMP)
	$(BIN)/prefix-router demo

bench-hashring: $(STAMP)
	$(BIN)/python -m loadtests.bench_hashring

bench-decision: $(STAMP)
	$(BIN)/python -m loadtests.bench_decision

# The proxy ladder: installs HAProxy, nginx, wrk (apt-get) and the Rust peers
# (their own venv) when missing; about 15 minutes.
bench-proxy: $(STAMP)
	$(BIN)/python -m loadtests.proxybench --install

# The figures in README.md and loadtests/RESULTS.md (loadtests/figures/*.png):
# deterministic offline runs and the saved proxy ladder; about 3 minutes.
figures: $(STAMP)
	$(BIN)/python -m loadtests.make_figures

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache .hypothesis results
