# Two commands for a fresh machine:  make app   (start the app)   |   make test   (run the tests)
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
CKPT ?= checkpoints/demo
PORT ?= 8501

.PHONY: app test install

$(BIN)/python:
	$(PY) -m venv $(VENV)

# torch first, pinned to the CPU build available offline here; then the rest
$(VENV)/.installed: requirements.txt | $(BIN)/python
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -r requirements.txt
	touch $@

install: $(VENV)/.installed

app: install
	RECUR_CHECKPOINT=$(CKPT) $(BIN)/python -m streamlit run app.py --server.port $(PORT) --server.headless true \
		--browser.gatherUsageStats false

test: install
	$(BIN)/python -m pytest -q tests
