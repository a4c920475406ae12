# The two set-up commands of the README: `make demo` and `make test`.
# Each creates or updates .venv and installs what it needs, then runs.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test lint venv clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q "torch==2.13.0" || $(BIN)/python -m pip install -q "torch>=2.11,<=2.13.0"
	$(BIN)/python -m pip install -q -e ".[test]"
	touch $(STAMP)

venv: $(STAMP)

demo: $(STAMP)
	$(BIN)/rollout demo

test: $(STAMP)
	$(BIN)/ruff check rollout trainer_client tests scripts benchmarks deploy
	$(BIN)/python -m pytest -q tests
	$(BIN)/python scripts/ci_rollout.py $(CURDIR)/.ci-artifacts/rollout.arrow

lint: $(STAMP)
	$(BIN)/ruff check rollout trainer_client tests scripts benchmarks deploy

clean:
	rm -rf $(VENV) .ci-artifacts
