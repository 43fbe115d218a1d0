"""KV-cache capacity: bytes per token per format and how many tokens fit, from a model config alone.

bytes/token = sum over layers of 2 (K and V) x kv_heads x head_dim x bits/8, with `bits` from
`kvcal.formats` (codes + block scales: fp8 8, int8 8 + 32/head_dim, fp8 / int4 per token-head 8 or 4 + 32/head_dim,
nvfp4 / fp4_e2m1 4.5, mxfp4 4.25),
skipped layers (--skip-layers) at 16 bits, and — when a context length N is given — each sliding-window layer
weighted by min(N, window) / N (it holds at most `window` tokens of a sequence of N). A K/V format pair
(`k=fp8_e4m3,v=nvfp4`) counts K's elements at K's bits (codes + block scales) and V's at V's: bytes/token = sum
over layers of kv_heads x head_dim x (bits_K + bits_V) / 8. Per-tensor / per-head
scales are a few bytes per layer, not per token, and are not counted. `auto` is the model's serving dtype, 16
bits (see kv_bytes_per_token). `kvcal capacity` and every run's metrics.json (`run_capacity`) count the same way.

tokens that fit = (GPU memory - weights) / bytes per token; weights from the checkpoint's files (.safetensors,
else .bin/.pt/.pth, or the .gguf file) unless given. Nothing here loads weights.

LMCache's storage tier (`--prefix-serde NAME`, kvcal.serde) is a second figure beside the live cache's, never mixed
into it: the bytes per token its serde writes to disk / a remote store (`storage_bytes_per_token`), every layer of
a stored prefix counted whole (LMCache stores all of a chunk's tokens, sliding layers included) at the serving
dtype's 16 bits where the serde keeps K/V raw; per-object overheads (a frame, a scale, a header) left out.
"""

from __future__ import annotations

import math
import os
from dataclasses import replace
from pathlib import Path
from typing import Any

from kvcal.errors import UsageError
from kvcal.formats import (
    FORMATS,
    TQ_BOUNDARY_LAYERS,
    TQ_PRESETS,
    KVFormat,
    is_tq_preset,
    kv_pair,
    parse_kv_format,
    tq_slot_bytes,
)
from kvcal.formats.geometry import boundary_layers, check_rotation_head_dims, check_sliding
from kvcal.models.config import load_config
from kvcal.models.geometry import SLIDING, KVSpec, kv_spec, parse_skip_layers
from kvcal.models.gguf import is_gguf
from kvcal.models.real import resolve_real_name
from kvcal.serde import NOT_EMULATED, SERDES, layer_storage_bytes, serde_key

GIB = 2**30
_WEIGHT_PATTERNS = (("*.safetensors",), ("*.bin", "*.pt", "*.pth"), ("*.gguf",))


def kv_bytes_per_token(
    kv: KVSpec,
    fmt: str | KVFormat,
    skip_layers: frozenset[int] = frozenset(),
    context: int | None = None,
    auto_bits: int = 16,
    tq_boundary: int = TQ_BOUNDARY_LAYERS,
) -> float:
    """Cache bytes per token over all layers (see the module docstring).

    `auto` (the engine keeps K/V in the dtype it serves the model in) is counted at `auto_bits` = 16: engines
    serve in 16 bits whatever the checkpoint stores (vLLM's `--dtype auto` serves float32 and float16
    checkpoints in float16, bfloat16 ones in bfloat16), so a float32 checkpoint such as a converted GGUF, evaluated
    in float32 by `kvcal eval`, is still counted as the 16-bit cache it gets in serving."""
    fk, fv = kv_pair(fmt)
    if context is not None and context < 1:
        raise UsageError(f"--context must be a positive number of tokens, got {context}")
    name = _format_name(fmt)
    preset = name if is_tq_preset(name) else None
    # vLLM adds a TurboQuant preset's boundary layers to kv_cache_dtype_skip_layers; the families' geometry rules
    # on the layers the format holds (sliding windows, a rotation's power-of-two head_dim)
    skip_layers = skip_layers | boundary_layers(name, kv.num_layers, tq_boundary)
    check_sliding(name, [x.index for x in kv.layers if x.type == SLIDING and x.index not in skip_layers])
    check_rotation_head_dims(name, [x.head_dim for x in kv.layers if x.index not in skip_layers])
    total = 0.0
    for layer in kv.layers:
        if layer.index in skip_layers:
            bits = 2 * 16.0  # K and V
        elif preset is not None:
            # TQFullAttentionSpec: page = block_size x kv_heads x slot_size_aligned (K and V in one slot)
            bits = 8.0 * tq_slot_bytes(preset, layer.head_dim) / layer.head_dim
        else:
            bits = fk.bits_per_element(layer.head_dim, auto_bits) + fv.bits_per_element(layer.head_dim, auto_bits)
        share = 1.0
        if context is not None and layer.type == SLIDING and layer.window:
            share = min(context, layer.window) / context
        total += layer.kv_heads * layer.head_dim * bits / 8 * share
    return total


def _format_name(f: str | KVFormat) -> str:
    """Canonical name of a format or a K/V pair (UsageError for an unknown one)."""
    return f.name if isinstance(f, KVFormat) else parse_kv_format(f)


def weights_bytes(model: str | os.PathLike[str]) -> tuple[int, str] | None:
    """(size in bytes, source) of a local checkpoint's weight files, or None when they cannot be found locally."""
    path = Path(model).expanduser()
    if is_gguf(str(model)) and path.is_file():
        return path.stat().st_size, path.name
    if not path.is_dir():
        path = _cached_snapshot(str(model))
        if path is None:
            return None
    for patterns in _WEIGHT_PATTERNS:
        files = sorted({p for pat in patterns for p in path.rglob(pat) if p.is_file()})
        if files:
            kinds = ", ".join(sorted({p.suffix for p in files}))
            return sum(p.stat().st_size for p in files), f"{len(files)} {kinds} file(s)"
    return None


def _cached_snapshot(model: str) -> Path | None:
    """The locally cached hub snapshot of a hub id, without network access."""
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(model, local_files_only=True))
    except Exception:  # not cached / not a hub id: the caller asks for --weights-gib
        return None


def layers_bytes_per_token(kv: KVSpec, layer_formats: list[str], context: int | None = None) -> float:
    """Bytes per token of one format (or K/V pair) per layer — a `kvcal plan` file's layers — each layer counted
    by kv_bytes_per_token on its own (`bf16` is 16 + 16 bits, what --skip-layers counts)."""
    if len(layer_formats) != kv.num_layers:
        raise UsageError(f"a plan of {len(layer_formats)} layers does not fit a model of {kv.num_layers} layers")
    return sum(
        kv_bytes_per_token(replace(kv, layers=(layer,)), f, context=context, tq_boundary=0)  # the plan says which are 16-bit
        for layer, f in zip(kv.layers, layer_formats, strict=True)
    )


def _free_bytes(gpu_mem_bytes: float | None, weights_bytes: float | None) -> float | None:
    """GPU memory left for the cache; UsageError naming the option when it cannot be known or is not positive."""
    if gpu_mem_bytes is None:
        return None
    if gpu_mem_bytes <= 0:
        raise UsageError(f"--gpu-mem-gib must be positive, got {gpu_mem_bytes / GIB:g}")
    if weights_bytes is None:
        raise UsageError("the weights' size is unknown; pass --weights-gib (GiB the weights take on the GPU)")
    free = gpu_mem_bytes - weights_bytes
    if free <= 0:
        raise UsageError(
            f"--gpu-mem-gib {gpu_mem_bytes / GIB:g} is not larger than the weights ({weights_bytes / GIB:.3g} "
            "GiB); give the GPU's memory for this model, or --weights-gib if the weights are smaller on the GPU"
        )
    return free


def _row(
    name: str, b: float, b_whole: float, kv: KVSpec, skip: frozenset[int], context: int | None,
    free: float | None,
) -> dict[str, Any]:  # fmt: skip
    """One table row from bytes per token at the context (`b`) and with every layer counted whole (`b_whole`)."""
    elems = sum(2 * layer.kv_heads * layer.head_dim for layer in kv.layers)
    max_tokens = None if free is None else math.floor(free / b)
    return {
        "kv_format": name,
        "bytes_per_token": b,
        "multiplier_vs_bf16": kv_bytes_per_token(kv, "bf16", frozenset(), context) / b,
        "multiplier_vs_fp8": kv_bytes_per_token(kv, "fp8_e4m3", skip, context) / b,
        "bits_per_element": 8 * b_whole / elems,
        "max_tokens": max_tokens,
        "max_sequences": None if max_tokens is None or context is None else max_tokens // context,
    }


def storage_bytes_per_token(kv: KVSpec, serde_name: str, elem_bytes: int = 2) -> dict[str, Any]:
    """LMCache's storage tier for serde `serde_name`: {"serde", "bytes_per_token", "bits_per_element",
    "multiplier_vs_bf16", "source", "emulated"} — bytes per token over every layer (kvcal.serde.layer_storage_bytes),
    K/V kept raw at `elem_bytes` (the serving dtype's 2)."""
    name = serde_key(serde_name)
    b = sum(
        layer_storage_bytes(name, layer.index, kv.num_layers, layer.kv_heads, layer.head_dim, elem_bytes)
        for layer in kv.layers
    )
    elems = sum(2 * layer.kv_heads * layer.head_dim for layer in kv.layers)
    return {
        "serde": name,
        "bytes_per_token": b,
        "bits_per_element": 8 * b / elems,
        "multiplier_vs_bf16": kv_bytes_per_token(kv, "bf16") / b,
        "source": f"{SERDES[name].source} (LMCache/LMCache)",
        "emulated": name not in NOT_EMULATED,
    }


def capacity_table(
    kv: KVSpec,
    formats: list[str | KVFormat] | None = None,
    skip_layers: frozenset[int] = frozenset(),
    context: int | None = None,
    gpu_mem_bytes: float | None = None,
    weights_bytes: float | None = None,
    plans: list[tuple[str, list[str]]] | None = None,
    tq_boundary: int = TQ_BOUNDARY_LAYERS,
) -> dict[str, Any]:
    """Per-format bytes per token, multiplier vs BF16 (and vs FP8) and, given GPU memory, the tokens that fit;
    then one row per plan (label, its format per layer: layers_bytes_per_token, skip_layers not applied).

    Returns {"formats": [{"kv_format", "bytes_per_token", "multiplier_vs_bf16", "multiplier_vs_fp8",
    "bits_per_element", "max_tokens", "max_sequences"}, ...], plus the inputs}."""
    if formats:
        fmts = [_format_name(f) for f in formats]
    elif plans:
        fmts = []
    else:  # every format this model's engine could build (int4_per_token_head needs a power-of-two head_dim)
        pow2 = all(layer.head_dim & (layer.head_dim - 1) == 0 for layer in kv.layers)
        fmts = [n for n, f in FORMATS.items() if pow2 or not f.codec.pow2_head_dim]
        if pow2 and not any(layer.type == SLIDING for layer in kv.layers):
            fmts += list(TQ_PRESETS)
    fmts = list(dict.fromkeys(fmts))  # drop repeats, keep order
    free = _free_bytes(gpu_mem_bytes, weights_bytes)
    rows = [
        _row(f, kv_bytes_per_token(kv, f, skip_layers, context, tq_boundary=tq_boundary),
             kv_bytes_per_token(kv, f, skip_layers, tq_boundary=tq_boundary), kv,
             skip_layers, context, free)
        for f in fmts
    ]  # fmt: skip
    for label, layers in plans or []:
        b, whole = layers_bytes_per_token(kv, layers, context), layers_bytes_per_token(kv, layers)
        rows.append(_row(label, b, whole, kv, skip_layers, context, free))
    return {
        "model_type": kv.model_type,
        "num_layers": kv.num_layers,
        "kv_heads": sorted({layer.kv_heads for layer in kv.layers}),
        "head_dim": sorted({layer.head_dim for layer in kv.layers}),
        "sliding_layers": [layer.index for layer in kv.layers if layer.type == SLIDING],
        "skip_layers": sorted(skip_layers),
        "tq_boundary_layers": tq_boundary if any(is_tq_preset(f) for f in fmts) else None,
        "context": context,
        "gpu_mem_bytes": gpu_mem_bytes,
        "weights_bytes": weights_bytes,
        "formats": rows,
    }


def run_capacity(
    kv: KVSpec, fmt: str | KVFormat, skip_layers: frozenset[int] = frozenset(), tq_boundary: int = 0
) -> dict[str, Any]:
    """What a run's metrics.json records about its cache: `kvcal capacity`'s numbers for one format without
    --context (no sliding-window discount: the longest-context view). `skip_layers`: every layer the run kept in
    BF16 (a TurboQuant run's boundary layers included, so `tq_boundary` adds none by default)."""
    row = capacity_table(kv, [fmt], skip_layers, tq_boundary=tq_boundary)["formats"][0]
    return {
        "bytes_per_token": row["bytes_per_token"],
        "bf16_bytes_per_token": kv_bytes_per_token(kv, "bf16"),
        "capacity_multiplier_vs_bf16": row["multiplier_vs_bf16"],
        "bits_per_element": row["bits_per_element"],
    }


def model_capacity(
    model: str,
    formats: list[str] | None = None,
    skip_layers: str | None = None,
    context: int | None = None,
    gpu_mem_gib: float | None = None,
    weights_gib: float | None = None,
    plans: list[tuple[str, list[str]]] | None = None,
    tq_boundary: int = TQ_BOUNDARY_LAYERS,
    prefix_serde: str | None = None,
) -> dict[str, Any]:
    """`kvcal capacity`: capacity_table for MODEL (HF folder, hub id, .gguf, or a real-model name); config only.
    `plans`: (label, format per layer) rows after the formats' (kvcal.pipeline.plan_cost reads plan files).
    `prefix_serde`: LMCache's storage tier, reported apart as `storage` (storage_bytes_per_token)."""
    fmts = [_format_name(f) for f in formats] if formats else None  # unknown names fail before any file is read
    if prefix_serde is not None:
        serde_key(prefix_serde)  # an unknown name fails before any file is read
    ref = resolve_real_name(model)
    kv = kv_spec(load_config(ref))
    skip = parse_skip_layers(skip_layers, kv)
    wbytes: float | None = None
    source = None
    if weights_gib is not None:
        if weights_gib < 0:
            raise UsageError(f"--weights-gib must not be negative, got {weights_gib:g}")
        wbytes, source = weights_gib * GIB, "--weights-gib"
    elif gpu_mem_gib is not None:
        found = weights_bytes(ref)
        if found is not None:
            wbytes, source = found
    table = capacity_table(
        kv,
        fmts,
        skip,
        context,
        None if gpu_mem_gib is None else gpu_mem_gib * GIB,
        wbytes,
        plans,
        tq_boundary,
    )
    table["model"] = ref
    table["weights_source"] = source
    # LMCache's storage tier: its own figure (None without --prefix-serde), not a row of the live cache's table
    table["storage"] = None if prefix_serde is None else storage_bytes_per_token(kv, prefix_serde)
    return table
