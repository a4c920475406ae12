# The two set-up commands of the README: `make demo` and `make test`.
# Each creates or updates .venv and installs what it needs, then runs.
PY ?= python3
# The CPU wheel CI machines carry. The package itself only asks for torch>=2.11 (a GPU host keeps its
# CUDA build); passing the pin again with the package keeps pip from upgrading torch there.
TORCH ?= torch==2.13.0
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test lint venv clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q "$(TORCH)"
	$(BIN)/python -m pip install -q -e ".[test]" "$(TORCH)"
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
