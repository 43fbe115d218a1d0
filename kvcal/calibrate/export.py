"""Export a scale set for serving engines.

`export_vllm`: an engine-ready checkpoint folder, laid out exactly as llm-compressor 0.14 / compressed-tensors
0.19 write a `kv_cache_scheme` checkpoint (checked against a real `oneshot` run):
- every file of the model folder, hard-linked where the file system allows, else copied;
- the scales in an extra shard `kv_scales.safetensors` as `model.layers.{i}.self_attn.k_scale` / `v_scale`,
  float32, shape (1,) for strategy "tensor" and (H_kv, 1, 1) for "attn_head" (compressed-tensors' attention
  qparam shape; vLLM's loader and transformers' compressed-tensors path both take it);
- `model.safetensors.index.json` created or extended to map every tensor; a single-file checkpoint's
  model.safetensors is linked as model-00001-of-00001.safetensors, because transformers loads a folder's
  model.safetensors alone when there is one and would never see the scale shard (vLLM reads the index either way);
- config.json gaining `quantization_config` = {"quant_method": "compressed-tensors", "format": "dense",
  "quantization_status": "compressed", "config_groups": {}, "ignore": [], "kv_cache_scheme": {"num_bits": 8,
  "type": "float", "strategy": "tensor"|"attn_head", "dynamic": false, "symmetric": true, ...}, ...}.
  vLLM's CompressedTensorsKVCacheMethod accepts type float / 8 bits / strategy tensor or attn_head / symmetric;
  per-head scales need vLLM's Flash Attention backend (vLLM docs, "Quantized KV Cache"). Transformers 5.17 with
  compressed-tensors installed attaches the scales as `self_attn.k_scale` / `v_scale` parameters on load.
  The scales are stored float32 (llm-compressor stores them in the model dtype; float32 keeps them exact).

`export_sglang`: the `--quantization-param-path` JSON of SGLang (QuantParamSchema / KVCacheQuantSchema):
{"model_type": ..., "kv_cache": {"dtype": "float8_e4m3fn", "scaling_factor": {tp_rank: {layer: scale}}}}.
SGLang reads ONE scale per layer and uses it for both K and V (`attn.k_scale = attn.v_scale = scaling_factor`),
so kvcal writes max(k_scale, v_scale): neither K nor V then saturates earlier than calibrated (the smaller one
loses a little resolution). The schema requires a map for every TP rank with every layer; per-tensor scales are
the same on every rank. Per-head scale sets are refused unless `reduce_heads=True` (max over heads = the
per-tensor minmax scale for a minmax observer; an upper bound for clipping observers).

Only FP8 E4M3 exports: compressed-tensors' FP8 (type float, 8 bits) is E4M3 and SGLang's schema asserts dtype
float8_e4m3fn. E5M2 caches and NVFP4 global scales have no checkpoint layout in these loaders; they are refused.
A K/V format pair (`k=fp8_e4m3,v=nvfp4`) is refused by both: released vLLM and SGLang take one KV cache dtype for
K and V (vLLM PR #53770 proposes `--kv-cache-dtype fp8_k_nvfp4_v` with no checkpoint scale layout yet).

FP8 attention (a scale set with q_scale, `kvcal calibrate --attention-scales`): written as llm-compressor 0.14
writes an attention scheme (recorded from a real `oneshot` with `config_groups={"attention": QuantizationScheme(
targets=["LlamaAttention"], input_activations=FP8 tensor)}` on a tiny Llama): `config_groups.group_0` =
{"targets": [the model's attention class], "input_activations": the FP8 args, "weights": null,
"output_activations": null, "format": "dense"}, the same args as `kv_cache_scheme`, and one more tensor per layer,
`model.layers.{i}.self_attn.q_scale` float32 (1,). vLLM reads it as the layer's q_scale for its FP8 attention
backends (FlashAttention-3, FlashInfer); transformers with compressed-tensors attaches `self_attn.q_scale`.
compressed-tensors applies one attention scheme to Q, K and V, and vLLM takes one Q scale per layer, so a
per-head K/V scale set with q_scale is refused (calibrate --granularity tensor --attention-scales).
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from importlib import metadata as importlib_metadata
from pathlib import Path
from typing import Any

import torch

from kvcal.errors import KvcalError, UsageError
from kvcal.filecache import sha256_file as file_sha256
from kvcal.io import atomic_write_text, public_mode, temp_dir_beside
from kvcal.scales import EXPORT_RECORD, K_NAME, Q_NAME, V_NAME, ScaleSet

SCALE_SHARD = "kv_scales.safetensors"
INDEX_NAME = "model.safetensors.index.json"
SINGLE_WEIGHTS = "model.safetensors"
RENAMED_SINGLE = "model-00001-of-00001.safetensors"
PROVENANCE = EXPORT_RECORD
_WRITTEN = ("config.json", INDEX_NAME, SCALE_SHARD, PROVENANCE)
_STRATEGY = {"tensor": "tensor", "head": "attn_head"}
_DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1}


def _require_fp8_e4m3(ss: ScaleSet, engine: str) -> None:
    if ss.kv_format == "fp8_e4m3":
        return
    if "=" in ss.kv_format:
        raise UsageError(
            f"{engine} takes one KV cache dtype for K and V, so the K/V pair {ss.kv_format} cannot be exported "
            f"(vLLM PR #53770's fp8_k_nvfp4_v is unreleased and has no checkpoint scale layout); calibrate one "
            "format for both, e.g. --kv-format fp8_e4m3"
        )
    if ss.kv_format == "int8_per_tensor":
        raise UsageError(
            f"{engine} has no per-tensor INT8 KV cache, so int8_per_tensor scales cannot be exported to it: only "
            "TensorRT-LLM loads one (kv_cache_quant_algo INT8 with kv_cache_scaling_factor), and kvcal does not "
            "write TensorRT-LLM checkpoints; calibrate --kv-format fp8_e4m3 to export"
        )
    if ss.kv_format == "nvfp4":
        raise UsageError(
            f"{engine} export holds FP8 E4M3 scales only: an NVFP4 global scale has no layout in "
            f"{'compressed-tensors kv_cache_scheme' if engine == 'vLLM' else 'SGLang --quantization-param-path'}; "
            "serve NVFP4 caches with the engine's own scales, or calibrate --kv-format fp8_e4m3 to export"
        )
    raise UsageError(
        f"{engine} export holds FP8 E4M3 scales only ({ss.kv_format} has no scale layout in "
        f"{'compressed-tensors (FP8 = E4M3)' if engine == 'vLLM' else 'SGLang (dtype float8_e4m3fn)'}); "
        "calibrate with --kv-format fp8_e4m3"
    )


def kv_cache_scheme(granularity: str) -> dict[str, Any]:
    """compressed-tensors' QuantizationArgs for an FP8 KV cache, as llm-compressor serializes it."""
    return {
        "actorder": None,
        "block_structure": None,
        "dynamic": False,
        "group_size": None,
        "num_bits": 8,
        "observer": None,
        "observer_kwargs": {},
        "scale_dtype": None,
        "strategy": _STRATEGY[granularity],
        "symmetric": True,
        "type": "float",
        "zp_dtype": None,
    }


def attention_group(granularity: str, attention_classes: list[str]) -> dict[str, Any]:
    """compressed-tensors' config group of llm-compressor's attention (query) quantization: the FP8 args as
    input_activations of the attention modules (post-RoPE Q, with K and V)."""
    return {
        "format": "dense",
        "input_activations": kv_cache_scheme(granularity),
        "output_activations": None,
        "targets": list(attention_classes),
        "weights": None,
    }


def quantization_config(granularity: str, attention_classes: list[str] | None = None) -> dict[str, Any]:
    """The config.json `quantization_config` of a KV-cache-only compressed-tensors checkpoint; with
    `attention_classes` (the model's attention module classes) also llm-compressor's attention group (q_scale)."""
    try:
        ct_version = importlib_metadata.version("compressed-tensors")
    except importlib_metadata.PackageNotFoundError:
        ct_version = "0.19.0"
    groups = {"group_0": attention_group(granularity, attention_classes)} if attention_classes else {}
    return {
        "config_groups": groups,
        "format": "dense",
        "global_compression_ratio": None,
        "ignore": [],
        "kv_cache_scheme": kv_cache_scheme(granularity),
        "quant_method": "compressed-tensors",
        "quantization_status": "compressed",
        "sparsity_config": {},
        "transform_config": {},
        "version": ct_version,
    }


def vllm_scale_tensors(ss: ScaleSet) -> dict[str, torch.Tensor]:
    """Engine tensors: (1,) per tensor, (H_kv, 1, 1) per head (compressed-tensors' attn_head shape); q_scale (1,)."""
    out = {}
    for i in range(ss.num_layers):
        for name, t in ((K_NAME.format(i=i), ss.k_scales[i]), (V_NAME.format(i=i), ss.v_scales[i])):
            t = t.detach().to(torch.float32).reshape(-1)
            out[name] = t.reshape(-1, 1, 1).contiguous() if ss.granularity == "head" else t.contiguous()
        if ss.q_scales is not None:
            out[Q_NAME.format(i=i)] = ss.q_scales[i].detach().to(torch.float32).reshape(1).contiguous()
    return out


def attention_classes(model_dir: Path) -> list[str]:
    """Class names of the model's attention modules (llm-compressor's attention targets), from its config on the
    meta device (no weights read)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_dir)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    names = {
        type(m).__name__
        for m in model.modules()
        if isinstance(getattr(m, "layer_idx", None), int) and type(m).__name__.endswith("Attention")
    }
    if not names:
        raise UsageError(f"model folder '{model_dir}' has no attention modules compressed-tensors can target")
    return sorted(names)


def _tensor_sizes(path: Path) -> dict[str, int]:
    """name -> bytes of every tensor in a safetensors file (header only)."""
    with open(path, "rb") as fh:
        n = int.from_bytes(fh.read(8), "little")
        header = json.loads(fh.read(n))
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        begin, end = info["data_offsets"]
        out[name] = int(end) - int(begin)
    return out


def link_or_copy(src: Path, dst: Path) -> str:
    """`dst` as a hard link of `src` where the file system allows, else a copy; 'linked' or 'copied'."""
    dst.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.link(src, dst)
        return "linked"
    except OSError:
        shutil.copy2(src, dst)
        return "copied"


def export_vllm(
    ss: ScaleSet, model_dir: str | os.PathLike[str], out_dir: str | os.PathLike[str]
) -> dict[str, Any]:
    """Write an engine-ready checkpoint folder (see the module docstring). The folder appears complete or not at
    all: it is built beside `out_dir` and renamed into place. Returns a summary dict."""
    _require_fp8_e4m3(ss, "vLLM")
    if ss.q_scales is not None and ss.granularity != "tensor":
        raise UsageError(
            "vLLM takes one q_scale per layer and compressed-tensors applies one attention scheme to Q, K and V, "
            "so per-head K/V scales cannot be exported with q_scale; calibrate --granularity tensor "
            "--attention-scales"
        )
    src, out = Path(model_dir), Path(out_dir)
    _check_export_target(src, out)
    weights = _source_weights(src)
    scales = vllm_scale_tensors(ss)
    clash = sorted(set(scales) & set(weights.weight_map))
    if clash:
        raise UsageError(
            f"model folder '{src}' already holds KV scales (e.g. {clash[0]}); export from the unquantized checkpoint"
        )
    config = _quantized_config(
        src, ss.granularity, attention_classes(src) if ss.q_scales is not None else None
    )
    try:
        tmp = temp_dir_beside(out)
    except OSError as exc:
        raise KvcalError(
            f"cannot write export folder '{out}': {exc.strerror or exc}; choose a writable path"
        ) from exc
    try:
        modes = _link_model_files(src, tmp, renamed_single=weights.renamed_single)
        _write_export_files(tmp, ss, scales, weights, config)
        os.rename(tmp, out)
    except OSError as exc:
        raise KvcalError(
            f"cannot write export folder '{out}': {exc.strerror or exc}; choose a writable path"
        ) from exc
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return {
        "engine": "vllm",
        "out": str(out),
        "kv_format": ss.kv_format,
        "strategy": _STRATEGY[ss.granularity],
        "num_layers": ss.num_layers,
        "files_linked": modes.get("linked", 0),
        "files_copied": modes.get("copied", 0),
        "scale_shard": SCALE_SHARD,
        "q_scale": ss.q_scales is not None,
        "serve": f"vllm serve {out} --kv-cache-dtype fp8"
        + (
            " --attention-backend FLASH_ATTN  # FA3 (Hopper) runs FP8 attention with q_scale"
            if ss.q_scales
            else ""
        ),
        "notes": (
            [
                "per-head (attn_head) scales need vLLM's Flash Attention backend (vLLM docs, Quantized KV Cache)"
            ]
            if ss.granularity == "head"
            else []
        ),
    }


def _check_export_target(src: Path, out: Path) -> None:
    if out.exists():
        raise UsageError(f"output folder '{out}' already exists; choose a new -o path or remove it")
    if out.resolve().is_relative_to(src.resolve()):
        raise UsageError(
            f"output folder '{out}' lies inside the model folder '{src}'; choose a path outside it"
        )


@dataclass
class _SourceWeights:
    """Where the checkpoint's tensors live: tensor name -> shard file, the index metadata, the total bytes."""

    weight_map: dict[str, str]
    index_meta: dict[str, Any]
    total_size: int
    renamed_single: bool  # a single-file checkpoint whose model.safetensors is linked under a shard name


def _source_weights(src: Path) -> _SourceWeights:
    index_path = src / INDEX_NAME
    if index_path.is_file():
        index = json.loads(index_path.read_text())
        meta = dict(index.get("metadata", {}))
        return _SourceWeights(dict(index.get("weight_map", {})), meta, int(meta.get("total_size", 0)), False)
    if (src / SINGLE_WEIGHTS).is_file():
        # transformers loads a folder's model.safetensors alone whenever it exists (the index, and with it the
        # scale shard, would be ignored), so a single-file checkpoint's weights are linked under a shard name.
        sizes = _tensor_sizes(src / SINGLE_WEIGHTS)
        return _SourceWeights(dict.fromkeys(sizes, RENAMED_SINGLE), {}, sum(sizes.values()), True)
    raise UsageError(
        f"model folder '{src}' has no {SINGLE_WEIGHTS} or {INDEX_NAME}; vLLM export needs safetensors weights"
    )


def _quantized_config(src: Path, granularity: str, attention: list[str] | None = None) -> dict[str, Any]:
    """config.json with the KV cache scheme added (a compressed-tensors weight checkpoint keeps its groups); with
    `attention` (attention class names) also the attention group of q_scale."""
    config = json.loads((src / "config.json").read_text())
    qc = config.get("quantization_config")
    if qc is not None and qc.get("quant_method") != "compressed-tensors":
        raise UsageError(
            f"model folder '{src}' is already quantized with '{qc.get('quant_method')}'; vLLM reads one "
            "quantization_config, so KV scales can be added to unquantized or compressed-tensors checkpoints only"
        )
    if qc is None:
        config["quantization_config"] = quantization_config(granularity, attention)
    else:
        groups = dict(qc.get("config_groups") or {})
        if attention:
            groups[f"group_{len(groups)}"] = attention_group(granularity, attention)
        config["quantization_config"] = {
            **qc,
            "config_groups": groups,
            "kv_cache_scheme": kv_cache_scheme(granularity),
        }
    return config


def _link_model_files(src: Path, dst: Path, renamed_single: bool) -> dict[str, int]:
    """Every file of the model folder into `dst` (hard links where possible); returns {'linked'|'copied': n}."""
    modes: dict[str, int] = {}
    for f in sorted(src.rglob("*")):
        rel = f.relative_to(src)
        # Files this export writes itself are never linked: writing through a hard link would change the
        # source checkpoint.
        if not f.is_file() or rel.parts[0].startswith(".") or str(rel) in _WRITTEN:
            continue
        dest = dst / (RENAMED_SINGLE if renamed_single and str(rel) == SINGLE_WEIGHTS else rel)
        mode = link_or_copy(f, dest)
        modes[mode] = modes.get(mode, 0) + 1
    return modes


def _write_export_files(
    tmp: Path,
    ss: ScaleSet,
    scales: dict[str, torch.Tensor],
    weights: _SourceWeights,
    config: dict[str, Any],
) -> None:
    """The scale shard, the extended index, config.json and the provenance record, into the staging folder."""
    from safetensors.torch import save_file

    save_file(scales, str(tmp / SCALE_SHARD), metadata={"format": "pt"})
    weight_map, total = dict(weights.weight_map), weights.total_size
    for name, t in scales.items():
        weight_map[name] = SCALE_SHARD
        total += t.numel() * t.element_size()
    index_out = {
        "metadata": {**weights.index_meta, "total_size": total},
        "weight_map": dict(sorted(weight_map.items())),
    }
    (tmp / INDEX_NAME).write_text(json.dumps(index_out, indent=2) + "\n")
    (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    provenance = {
        "kvcal_version": ss.manifest.get("kvcal_version"),
        "kv_format": ss.kv_format,
        "granularity": ss.granularity,
        "observer": ss.manifest.get("observer"),
        "binding": ss.binding,
        "calibration": ss.manifest.get("calibration"),
        "scale_shard": SCALE_SHARD,
        "scale_shard_sha256": file_sha256(tmp / SCALE_SHARD),
    }
    (tmp / PROVENANCE).write_text(json.dumps(provenance, indent=2) + "\n")
    os.chmod(tmp, public_mode(0o777))  # mkdtemp made it 0700
    for name in _WRITTEN:
        os.chmod(tmp / name, public_mode(0o666))


def sglang_scales(ss: ScaleSet, reduce_heads: bool = False) -> list[float]:
    """One scale per layer for SGLang: max(k_scale, v_scale) (SGLang applies one scale to both K and V)."""
    _require_fp8_e4m3(ss, "SGLang")
    if ss.granularity != "tensor" and not reduce_heads:
        raise UsageError(
            "SGLang's --quantization-param-path holds one scale per layer; this scale set is per KV head: "
            "calibrate with --granularity tensor, or pass --reduce-heads to use the max over heads"
        )
    return [float(max(k.max().item(), v.max().item())) for k, v in zip(ss.k_scales, ss.v_scales, strict=True)]


def export_sglang(
    ss: ScaleSet,
    model_dir: str | os.PathLike[str],
    out_file: str | os.PathLike[str],
    tp_size: int = 1,
    reduce_heads: bool = False,
) -> dict[str, Any]:
    """Write SGLang's --quantization-param-path JSON atomically. Returns a summary dict.

    `model_type` is config.json's top-level model_type: SGLang compares it with its config class's model_type."""
    model_type = json.loads((Path(model_dir) / "config.json").read_text()).get("model_type")
    if tp_size < 1:
        raise UsageError(f"--tp-size must be at least 1, got {tp_size}")
    per_layer = sglang_scales(ss, reduce_heads=reduce_heads)
    layer_map = {str(i): s for i, s in enumerate(per_layer)}
    doc = {
        "model_type": model_type,
        "kv_cache": {
            "dtype": "float8_e4m3fn",
            "scaling_factor": {str(rank): dict(layer_map) for rank in range(tp_size)},
        },
    }
    out = Path(out_file)
    if out.is_dir():
        raise UsageError(f"output path '{out}' is a folder; pass a file name like kv_scales.json")
    try:
        atomic_write_text(out, json.dumps(doc, indent=2) + "\n")
    except OSError as exc:
        raise KvcalError(
            f"cannot write '{out}': {exc.strerror or exc}; choose a writable output path"
        ) from exc
    return {
        "engine": "sglang",
        "out": str(out),
        "kv_format": ss.kv_format,
        "num_layers": ss.num_layers,
        "tp_size": tp_size,
        "reduced_heads": ss.granularity == "head",
        "serve": f"python -m sglang.launch_server --kv-cache-dtype fp8_e4m3 --quantization-param-path {out}",
    }
