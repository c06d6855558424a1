# Set-up and checks for diffquant. `make test` on a fresh machine creates .venv, installs, lints and tests.
VENV ?= .venv
PYTHON ?= python3
BIN := $(VENV)/bin

.PHONY: setup test lint pytest format clean demo

setup: $(VENV)/.installed

# torch==2.13.0 first: it takes the local CPU wheel; anything else resolves to a multi-GB CUDA build.
$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[test]'
	touch $@

lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/lint-imports

pytest: setup
	$(BIN)/python -m pytest --durations=10

test: lint pytest

demo: setup
	$(BIN)/diffquant demo

format: setup
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .hypothesis
