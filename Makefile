# Two commands: `make demo` (real model, real data) and `make test` (every test, as CI).
VENV ?= .venv
BIN := $(VENV)/bin
# the demo needs the package and fairseq; the tests, lint and benchmarks also the test extras
STAMP := $(VENV)/.acl-fairseq-installed
TEST_STAMP := $(VENV)/.acl-fairseq-test-installed

.PHONY: setup setup-test demo test test-fast lint benchmark

setup: $(STAMP)

$(STAMP): setup.py scripts/install.sh
	bash scripts/install.sh $(VENV) none
	touch $(STAMP)

setup-test: $(TEST_STAMP)

$(TEST_STAMP): $(STAMP)
	bash scripts/install.sh $(VENV) test
	touch $(TEST_STAMP)

demo: setup
	$(BIN)/acl-fairseq-demo

# two pytest workers (pytest-xdist); --dist loadfile keeps a file's tests, and the models its
# fixtures train once, on one worker
PYTEST := $(BIN)/python -m pytest -q -n 2 --dist loadfile

test: setup-test
	$(PYTEST)

test-fast: setup-test
	$(PYTEST) -m "not slow"

lint: setup-test
	$(BIN)/ruff check . && $(BIN)/ruff format --check .

benchmark: setup-test
	$(BIN)/python -m benchmarks.train_cost
