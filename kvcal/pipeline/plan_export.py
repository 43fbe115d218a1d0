"""A per-layer KV plan in the three forms engines read, each parsed back (the tests' round trip), and refusals that
name what an engine lacks.

- ModelOpt's per-layer map in `hf_quant_config.json`, what vLLM reads with `--kv-cache-dtype auto`: quantization
  {quant_algo: MIXED_PRECISION, quantized_layers: {}, kv_cache_quant_algo: MIXED_PRECISION,
  kv_cache_quantized_layers: {"model.layers.<i>.self_attn": {"quant_algo": "FP8" | "NVFP4"}},
  kv_cache_schema_version: 1}, producer {name: "modelopt"}; or the same keys flat in config.json's
  `quantization_config` with quant_method "modelopt" (`embedded_config`). Checked against: ModelOpt's export
  tests (Model-Optimizer PR #2272, convert_hf_quant_config_format with `kv_cache_quantized_layers`); vLLM main at
  00155cdecca7 (`QUANT_ALGOS` holds MIXED_PRECISION); and the per-layer reader itself, vLLM PR #56116 (open; RFC
  #57445) on its branch meenchen/vllm at 0ad7ce3e64be and 44c0d62d10a3 (vllm/model_executor/layers/quantization/
  modelopt.py, ModelOptMixedPrecisionConfig._from_config and get_kv_cache_dtype) and 1a98fe635135 (attention.py):
  `quant_algo` required; kv_cache_schema_version must be the integer 1; a non-empty map of {"quant_algo": str},
  FP8 -> fp8_e4m3 and NVFP4 -> nvfp4 only (anything else, FP8_K_NVFP4_V included, is a ValueError); the map is
  keyed by the Hugging Face attention prefix (vLLM's `.attn` suffix stripped; `model.language_model.` and
  `language_model.model.` tried as swaps), layers left out stay `auto` (16-bit), keys matching no layer are
  ignored; the map applies only with --kv-cache-dtype auto, and --kv-cache-dtype-skip-layers still wins. vLLM's
  loader reads hf_quant_config.json only when config.json has no quantization_config, and takes it as ModelOpt's
  only when producer.name is "modelopt" (weight_utils.get_quant_config; at the fork's main 12a34a6bc794) — so the
  producer is "modelopt" (the format's name; kvcal is in its version). The map carries no K/V scales: layers run
  at scale 1.0 unless the checkpoint holds scalar k_scale / v_scale (`kvcal export`).
- vLLM's `--kv-cache-dtype X --kv-cache-dtype-skip-layers i,j`: one format plus 16-bit layers (`sliding_window`
  when the 16-bit layers are exactly the sliding ones).
- TensorRT-LLM's KvCacheConfig.dtype range string `0-3:fp8,4-35:nvfp4` ('start-end:dtype' or 'idx:dtype'
  segments; TensorRT-LLM PR #13695, open), dtypes fp8 / nvfp4 / bf16.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from kvcal.errors import UsageError
from kvcal.formats import get_format, kv_pair
from kvcal.models.geometry import SLIDING, KVSpec

MODELOPT_ALGO = {"fp8_e4m3": "FP8", "nvfp4": "NVFP4"}  # full K/V formats vLLM's per-layer reader maps
TRTLLM_DTYPE = {"fp8_e4m3": "fp8", "nvfp4": "nvfp4", "bf16": "bf16"}
SIXTEEN_BIT = "bf16"
ENGINES = ("vllm-modelopt", "vllm-skip-layers", "trtllm")


def layer_runs(layers: list[str], sep: str = ", ") -> str:
    """'0-3 nvfp4, 4 bf16, ...' — a plan as runs of equal layers."""
    parts, start = [], 0
    for i in range(1, len(layers) + 1):
        if i == len(layers) or layers[i] != layers[start]:
            parts.append(f"{start}{'' if i - 1 == start else f'-{i - 1}'} {layers[start]}")
            start = i
    return sep.join(parts)


def modelopt_layer_name(i: int) -> str:
    """The attention module's prefix in a Hugging Face causal LM (what the map is keyed by)."""
    return f"model.layers.{i}.self_attn"


def _pair_refusal(engine: str, layers: list[str]) -> None:
    mixed = [i for i, f in enumerate(layers) if "=" in f]
    if mixed:
        raise UsageError(
            f"{engine} cannot express layer {mixed[0]}'s {layers[mixed[0]]}: it takes one format per layer for "
            "K and V together (FP8-K/NVFP4-V inside a layer needs a mixed-K/V kernel it lacks); re-plan without "
            "K/V pair candidates"
        )


def modelopt_config(layers: list[str], producer: str) -> dict[str, Any]:
    """hf_quant_config.json of a plan (layers: a canonical format per layer); UsageError for what vLLM lacks."""
    engine = "vLLM's ModelOpt per-layer map"
    _pair_refusal(engine, layers)
    bad = [(i, f) for i, f in enumerate(layers) if f != SIXTEEN_BIT and f not in MODELOPT_ALGO]
    if bad:
        raise UsageError(
            f"{engine} cannot express layer {bad[0][0]}'s {bad[0][1]}: it reads FP8 and NVFP4 layers only "
            f"(and 16-bit layers left out of the map); re-plan with candidates from bf16, "
            f"{', '.join(MODELOPT_ALGO)}"
        )
    layer_map = {
        modelopt_layer_name(i): {"quant_algo": MODELOPT_ALGO[f]}
        for i, f in enumerate(layers)
        if f in MODELOPT_ALGO
    }
    if not layer_map:
        raise UsageError(
            f"{engine}: the plan quantizes no layer; serve with --kv-cache-dtype auto and no map"
        )
    return {
        # vLLM takes hf_quant_config.json as ModelOpt's only when the producer is named "modelopt"
        "producer": {"name": "modelopt", "version": producer},
        "quantization": {
            "quant_algo": "MIXED_PRECISION",
            "quantized_layers": {},
            "kv_cache_quant_algo": "MIXED_PRECISION",
            "kv_cache_quantized_layers": layer_map,
            "kv_cache_schema_version": 1,
        },
    }


def embedded_config(config: dict[str, Any]) -> dict[str, Any]:
    """The same map as config.json's `quantization_config` (flat, quant_method "modelopt"): the form vLLM's loader
    reads first, before any hf_quant_config.json."""
    return {"quant_method": "modelopt", **config["quantization"]}


def modelopt_file_text(path: Path, config: dict[str, Any]) -> str:
    """What `plan-export --engine vllm-modelopt -o PATH` writes: PATH named config.json (an existing one) gets the
    map as its `quantization_config`, everything else kept; any other name gets hf_quant_config.json's text.
    UsageError where vLLM would not read it: a config.json that already has a quantization_config (vLLM reads that
    instead of hf_quant_config.json, and kvcal does not merge quantization configs)."""
    if path.name == "config.json":
        try:
            checkpoint = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            raise UsageError(f"cannot embed the map in '{path}': {exc}; pass the checkpoint's config.json") from exc
        if not isinstance(checkpoint, dict):
            raise UsageError(f"'{path}' is not a Hugging Face config.json (not a JSON object)")
        if "quantization_config" in checkpoint:
            raise UsageError(
                f"'{path}' already has a quantization_config; vLLM reads that one, so a KV map must be merged into "
                "it by the tool that wrote it (kvcal does not merge quantization configs)"
            )
        return json.dumps({**checkpoint, "quantization_config": embedded_config(config)}, indent=2) + "\n"
    sibling = path.parent / "config.json"
    if sibling.is_file():
        try:
            has = "quantization_config" in json.loads(sibling.read_text())
        except (OSError, ValueError, TypeError):
            has = False
        if has:
            raise UsageError(
                f"'{sibling}' has a quantization_config, so vLLM would ignore '{path.name}'; the KV map must be "
                "merged into that quantization_config by the tool that wrote it"
            )
    return json.dumps(config, indent=2) + "\n"


def parse_modelopt_config(config: dict[str, Any], num_layers: int) -> list[str]:
    """The plan a ModelOpt per-layer map describes (absent layers: bf16), read the way vLLM's reader maps it."""
    q = config.get("quantization", config)  # hf_quant_config.json, or config.json's flat quantization_config
    if q.get("kv_cache_quant_algo") != "MIXED_PRECISION" or q.get("kv_cache_schema_version") != 1:
        raise UsageError("not a ModelOpt MIXED_PRECISION KV map (schema version 1)")
    back = {v: k for k, v in MODELOPT_ALGO.items()}
    out = [SIXTEEN_BIT] * num_layers
    for name, entry in q["kv_cache_quantized_layers"].items():
        out[int(name.split(".")[2])] = back[entry["quant_algo"]]
    return out


def vllm_skip_layers(layers: list[str], kv: KVSpec) -> tuple[str, str]:
    """(--kv-cache-dtype value, --kv-cache-dtype-skip-layers value) of a plan of one format plus 16-bit layers."""
    engine = "vLLM's --kv-cache-dtype-skip-layers"
    _pair_refusal(engine, layers)
    quant = sorted({f for f in layers if f != SIXTEEN_BIT})
    if len(quant) != 1:
        raise UsageError(
            f"{engine} cannot express a plan of {len(quant)} quantized formats ({', '.join(quant) or 'none'}): it "
            "takes one --kv-cache-dtype plus 16-bit layers; use the ModelOpt map (--engine vllm-modelopt)"
        )
    name = get_format(quant[0]).engine_names.get("vllm")
    if name is None:
        raise UsageError(f"{engine}: vLLM has no KV cache dtype for {quant[0]}")
    skipped = [i for i, f in enumerate(layers) if f == SIXTEEN_BIT]
    sliding = [layer.index for layer in kv.layers if layer.type == SLIDING]
    spec = "sliding_window" if skipped and skipped == sliding else ",".join(map(str, skipped))
    return name, spec


def parse_vllm_skip_layers(kv_cache_dtype: str, skip: str, kv: KVSpec) -> list[str]:
    """The plan `--kv-cache-dtype X --kv-cache-dtype-skip-layers S` serves."""
    fmt = next(
        f
        for f, g in ((n, get_format(n)) for n in ("fp8_e4m3", "nvfp4"))
        if g.engine_names["vllm"] == kv_cache_dtype
    )
    if skip == "sliding_window":
        skipped = {layer.index for layer in kv.layers if layer.type == SLIDING}
    else:
        skipped = {int(s) for s in skip.split(",") if s}
    return [SIXTEEN_BIT if i in skipped else fmt for i in range(kv.num_layers)]


def trtllm_dtype(layers: list[str]) -> str:
    """KvCacheConfig.dtype's range string of a plan: runs of equal layers as 'a-b:dtype' ('a:dtype' alone)."""
    engine = "TensorRT-LLM's per-layer KV dtype"
    _pair_refusal(engine, layers)
    bad = [(i, f) for i, f in enumerate(layers) if f not in TRTLLM_DTYPE]
    if bad:
        raise UsageError(
            f"{engine} cannot express layer {bad[0][0]}'s {bad[0][1]}: it takes {', '.join(TRTLLM_DTYPE)}; "
            "re-plan with those candidates"
        )
    segments, start = [], 0
    for i in range(1, len(layers) + 1):
        if i == len(layers) or layers[i] != layers[start]:
            rng = f"{start}" if i - 1 == start else f"{start}-{i - 1}"
            segments.append(f"{rng}:{TRTLLM_DTYPE[layers[start]]}")
            start = i
    return ",".join(segments)


def parse_trtllm_dtype(spec: str, num_layers: int) -> list[str]:
    """The plan a range string describes (every layer must be named once)."""
    back = {v: k for k, v in TRTLLM_DTYPE.items()}
    out: list[str | None] = [None] * num_layers
    for segment in spec.split(","):
        rng, _, dtype = segment.rpartition(":")
        a, _, b = rng.partition("-")
        for i in range(int(a), int(b or a) + 1):
            out[i] = back[dtype]
    if any(f is None for f in out):
        raise UsageError(f"range string '{spec}' leaves layers out")
    return [str(f) for f in out]


def canonical_layers(layers: list[str]) -> list[str]:
    """Layer formats in kvcal's canonical names (a pair of two equal sides is one format)."""
    out = []
    for f in layers:
        k, v = kv_pair(f)
        out.append(k.name if k is v else f"k={k.name},v={v.name}")
    return out


def engine_commands(model: str, layers: list[str], kv: KVSpec, plan_path: str) -> dict[str, dict[str, str]]:
    """Per engine: {"command": ...} or {"refused": why} — what `kvcal plan` prints beside each export."""
    out: dict[str, dict[str, str]] = {}
    try:
        modelopt_config(layers, "")
        out["vllm-modelopt"] = {
            "command": f"kvcal plan-export {plan_path} --engine vllm-modelopt -o CHECKPOINT/hf_quant_config.json; "
            "vllm serve CHECKPOINT --kv-cache-dtype auto",
        }
    except UsageError as exc:
        out["vllm-modelopt"] = {"refused": str(exc)}
    try:
        dtype, skip = vllm_skip_layers(layers, kv)
        extra = f" --kv-cache-dtype-skip-layers {skip}" if skip else ""
        out["vllm-skip-layers"] = {"command": f"vllm serve {model} --kv-cache-dtype {dtype}{extra}"}
    except UsageError as exc:
        out["vllm-skip-layers"] = {"refused": str(exc)}
    try:
        spec = trtllm_dtype(layers)
        out["trtllm"] = {
            "command": f"trtllm-serve {model} --extra_llm_api_options kv.yaml  # kv.yaml: "
            f'kv_cache_config: {{dtype: "{spec}"}}',
        }
    except UsageError as exc:
        out["trtllm"] = {"refused": str(exc)}
    return out
