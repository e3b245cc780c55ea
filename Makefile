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

# two pytest workers (pytest-xdist); --dist loadfile keeps a file's tests, and the models its
# fixtures train once, on one worker
PYTEST := $(BIN)/python -m pytest -q -n 2 --dist loadfile

test: setup
	$(PYTEST)

test-fast: setup
	$(PYTEST) -m "not slow"

lint: setup
	$(BIN)/ruff check . && $(BIN)/ruff format --check .

benchmark: setup
	$(BIN)/python -m benchmarks.train_cost
