# Two commands for a fresh machine:  make app   (start the app)   |   make test   (run the tests)
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
CKPT ?= checkpoints/specimen
PORT ?= 8501

.PHONY: app test test-slow lint install

$(BIN)/python:
	$(PY) -m venv $(VENV)

# torch first, pinned to the CPU build available offline here (an unpinned torch pulls a multi-GB CUDA
# build); then this package, editable, with every extra the tests need (pyproject.toml: the one list)
$(VENV)/.installed: pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[dev]'
	touch $@

install: $(VENV)/.installed

app: install
	$(BIN)/recur-app $(CKPT) --port $(PORT)

lint: install
	$(BIN)/ruff check .

test: install
	$(BIN)/python -m pytest -q --durations=15 -m "not slow" tests  # the 15 slowest, to keep it under 8 min

test-slow: install  # the checks of minutes (marker `slow`, pyproject.toml); CI runs them after `make test`
	$(BIN)/python -m pytest -q --durations=15 -m slow tests
