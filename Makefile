# Two commands: `make demo` (real model, real data) and `make test` (every test, as CI).
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.acl-fairseq-installed

.PHONY: setup demo test test-fast lint benchmark

setup: $(STAMP)

$(STAMP): setup.py scripts/install.sh
	bash scripts/install.sh $(VENV)
	touch $(STAMP)

demo: setup
	$(BIN)/acl-fairseq-demo

test: setup
	$(BIN)/python -m pytest -q

test-fast: setup
	$(BIN)/python -m pytest -q -m "not slow"

lint: setup
	$(BIN)/ruff check . && $(BIN)/ruff format --check .

benchmark: setup
	$(BIN)/python -m benchmarks.train_cost
