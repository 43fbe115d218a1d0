"""The scale file: calibrated K/V scales bound to the exact checkpoint they were measured on.

One `.safetensors` file (never a pickle). Tensors carry the engines' names,
`model.layers.{i}.self_attn.k_scale` / `...v_scale`, float32, shape `(1,)` per tensor or `(H_kv,)` per KV head —
exactly the `scale` argument of `kvcal.formats.quantize` (fp8: x ~ codes * scale; nvfp4: the global scale) — and,
from schema version 2, optionally `model.layers.{i}.self_attn.q_scale` (float32 `(1,)`, every layer or none): the
post-RoPE query's FP8 E4M3 scale for FP8 attention (`kvcal calibrate --attention-scales`; llm-compressor's and
vLLM's name). Version-1 files (no q_scale) load unchanged. A K/V format pair (`k=fp8_e4m3,v=nvfp4`) stores each
side's scale as that side's format defines it.
The safetensors metadata holds two strings:

- `kvcal_manifest`: the manifest JSON (schema version, kvcal version, time, format, granularity, observer +
  params, binding, calibration, per-layer stats; see `make_scale_set`).
- `kvcal_checksum`: sha256 over the manifest string and every tensor's name and bytes, so a flipped byte anywhere
  in the file is refused on load (safetensors itself has no checksum).

The binding (`compute_binding`) names the checkpoint: sha256 of config.json, of each tokenizer file and of each
weight file (streamed once; cached by absolute path + size + mtime under $KVCAL_CACHE or ~/.cache/kvcal, so
re-verification reads no weights), plus the KV geometry (layer count, KV heads, head_dim, layer types).
`binding_differences` says in words what changed; `load_scales_for_model` refuses a foreign checkpoint unless
forced (force overrides the binding only, never the geometry or the format).
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch

from kvcal import __version__
from kvcal.errors import KvcalError, UsageError
from kvcal.filecache import cached_sha256
from kvcal.filecache import sha256_file as file_sha256
from kvcal.formats import CPU_STORES
from kvcal.io import atomic_write_with
from kvcal.models.config import load_config
from kvcal.models.geometry import KVSpec, kv_spec
from kvcal.models.resolve import resolve_model

log = logging.getLogger(__name__)

SCHEMA = "kvcal.scales"
# 1: K/V scales. 2: optional per-layer q_scale tensors (FP8 attention) and K/V format pairs; 1 still loads.
SCHEMA_VERSION = 2
MANIFEST_KEY = "kvcal_manifest"
CHECKSUM_KEY = "kvcal_checksum"
GRANULARITIES = ("tensor", "head")
K_NAME = "model.layers.{i}.self_attn.k_scale"
V_NAME = "model.layers.{i}.self_attn.v_scale"
Q_NAME = "model.layers.{i}.self_attn.q_scale"

# Files that define how text becomes token ids (whichever a model folder has).
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "spiece.model",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "special_tokens_map.json",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
)
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")


@dataclass
class ScaleSet:
    """Calibrated K/V scales of every attention layer plus the manifest that says what they belong to.

    `k_scales[i]` / `v_scales[i]`: fp32, shape (1,) for granularity 'tensor' or (H_kv,) for 'head'.
    `binding_warnings` is filled by `load_scales_for_model(force=True)` when the binding did not match."""

    kv_format: str
    granularity: str
    k_scales: list[torch.Tensor]
    v_scales: list[torch.Tensor]
    manifest: dict[str, Any]
    binding_warnings: list[str] = field(default_factory=list)
    q_scales: list[torch.Tensor] | None = None  # fp32 (1,) per layer: the query's FP8 scale, or None

    @property
    def num_layers(self) -> int:
        return len(self.k_scales)

    @property
    def binding(self) -> dict[str, Any]:
        return self.manifest.get("binding", {})

    @property
    def layer_stats(self) -> list[dict[str, Any]]:
        return self.manifest.get("layer_stats", [])

    @property
    def kv_input_dtype(self) -> str:
        """The dtype of the K/V the scales were measured on (manifest calibration.kv_input_dtype, written by
        `kvcal calibrate --kv-input-dtype`); a file without it (older kvcal) observed them as computed:
        float32 (or the model's dtype, recorded as calibration.dtype, when that was narrower)."""
        cal = self.manifest.get("calibration") or {}
        if cal.get("kv_input_dtype"):
            return str(cal["kv_input_dtype"])
        narrow = cal.get("dtype") in ("bfloat16", "float16")
        return str(cal["dtype"]) if narrow else "float32"

    def tensors(self) -> dict[str, torch.Tensor]:
        """The tensors as stored (engine names)."""
        out: dict[str, torch.Tensor] = {}
        for i, (k, v) in enumerate(zip(self.k_scales, self.v_scales, strict=True)):
            out[K_NAME.format(i=i)] = k.detach().to(torch.float32).contiguous()
            out[V_NAME.format(i=i)] = v.detach().to(torch.float32).contiguous()
        for i, q in enumerate(self.q_scales or []):
            out[Q_NAME.format(i=i)] = q.detach().to(torch.float32).contiguous()
        return out


# ----------------------------------------------------------------------------------------------- formats


# Formats whose scales mean what another format's scales mean (x ~ codes * s, the same E4M3 codes): a scale file of
# the second serves the first (vLLM's CPU build stores fp8_e4m3 scales' checkpoint with another rounding).
SAME_SCALES = dict(CPU_STORES)

# The provenance record `kvcal export --to vllm` writes into the checkpoint it makes (kvcal.calibrate.export): the
# scale file's binding (its source model's reference and folder), format, granularity and the scale shard's name.
EXPORT_RECORD = "kvcal_export.json"


def export_record(folder: str | os.PathLike[str]) -> dict[str, Any] | None:
    """The EXPORT_RECORD of a checkpoint folder `kvcal export --to vllm` wrote, or None for any other folder."""
    try:
        record = json.loads((Path(folder) / EXPORT_RECORD).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None


def canonical_format(name: str) -> str:
    """The canonical name of a calibratable KV format (fp8_e4m3, fp8_e5m2, nvfp4) or of a K/V pair of them
    (`k=fp8_e4m3,v=nvfp4`); UsageError otherwise."""
    from kvcal.formats import FORMATS, kv_pair, parse_kv_format

    for fmt in kv_pair(name):
        if not fmt.calibratable:
            valid = ", ".join(f.name for f in FORMATS.values() if f.calibratable)
            raise UsageError(
                f"KV format '{fmt.name}' has no static scales (they are computed at run time); "
                f"scale files hold {valid}"
            )
    return parse_kv_format(name)


# ----------------------------------------------------------------------------------------------- building


def _as_scale(x: float | torch.Tensor | Sequence[float]) -> torch.Tensor:
    t = torch.as_tensor(x, dtype=torch.float32).detach().cpu().reshape(-1)
    return t.clone().contiguous()


def _json_safe(obj: Any) -> Any:
    """Plain JSON values: tensors to lists, non-finite floats to None (strict JSON has no NaN/Inf)."""
    if isinstance(obj, torch.Tensor):
        obj = obj.detach().cpu().tolist()
    if isinstance(obj, dict):
        return {str(k): _json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_json_safe(v) for v in obj]
    if isinstance(obj, Path):
        return str(obj)
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, (str, int, bool)) or obj is None:
        return obj
    if hasattr(obj, "item"):  # numpy scalars
        return _json_safe(obj.item())
    return str(obj)


def make_scale_set(
    kv_format: str,
    granularity: str,
    k_scales: Sequence[float | torch.Tensor | Sequence[float]],
    v_scales: Sequence[float | torch.Tensor | Sequence[float]],
    *,
    observer: str,
    observer_params: dict[str, Any] | None = None,
    binding: dict[str, Any],
    calibration: dict[str, Any] | None = None,
    layer_stats: Sequence[dict[str, Any]] | None = None,
    extra: dict[str, Any] | None = None,
    q_scales: Sequence[float | torch.Tensor] | None = None,
) -> ScaleSet:
    """Build (and validate) a ScaleSet from raw per-layer scales.

    k_scales / v_scales: one entry per layer; a float or 0-d/(1,) tensor for granularity 'tensor', (H_kv,) for
    'head'. binding: from `compute_binding`. calibration: {source, num_samples, seq_len, seed,
    token_ids_sha256, ...}. layer_stats: one dict per layer, {layer, k_amax, v_amax, k_clipped_fraction,
    v_clipped_fraction, k_sqnr_db, v_sqnr_db} (amax may be a per-head list). extra: more manifest keys
    (e.g. {"engine": "llmcompressor"})."""
    fmt = canonical_format(kv_format)
    if granularity not in GRANULARITIES:
        raise UsageError(f"unknown granularity '{granularity}'; use one of {', '.join(GRANULARITIES)}")
    manifest: dict[str, Any] = {
        "schema": SCHEMA,
        "schema_version": SCHEMA_VERSION,
        "kvcal_version": __version__,
        "created": datetime.now(UTC).isoformat(timespec="seconds"),
        "kv_format": fmt,
        "granularity": granularity,
        "observer": {"name": observer, "params": dict(observer_params or {})},
        "binding": dict(binding),
        "calibration": dict(calibration or {}),
        "layer_stats": [dict(s) for s in (layer_stats or [])],
    }
    for key, value in (extra or {}).items():
        manifest.setdefault(key, value)
    ss = ScaleSet(
        kv_format=fmt,
        granularity=granularity,
        k_scales=[_as_scale(k) for k in k_scales],
        v_scales=[_as_scale(v) for v in v_scales],
        manifest=_json_safe(manifest),
        q_scales=None if q_scales is None else [_as_scale(q) for q in q_scales],
    )
    validate_scale_set(ss, where="new scale set")
    return ss


# ----------------------------------------------------------------------------------------------- validation


def _layer_kv_heads(binding: dict[str, Any], i: int) -> int | None:
    heads = binding.get("num_kv_heads")
    if isinstance(heads, list):
        return int(heads[i]) if i < len(heads) else None
    return int(heads) if heads is not None else None


def validate_scale_set(ss: ScaleSet, where: str) -> None:
    """Everything a scale set must satisfy; KvcalError naming `where`, the layer and the fix otherwise."""
    fix = "re-run `kvcal calibrate` to produce a valid scale file"
    m = ss.manifest
    if not isinstance(m, dict):
        raise KvcalError(f"{where}: the manifest is not a JSON object; {fix}")
    try:
        fmt = canonical_format(ss.kv_format)
    except UsageError as exc:
        raise KvcalError(f"{where}: {exc}") from None
    if fmt != ss.kv_format or m.get("kv_format") != fmt:
        raise KvcalError(
            f"{where}: format '{m.get('kv_format')}' is not a canonical calibratable format; {fix}"
        )
    if ss.granularity not in GRANULARITIES or m.get("granularity") != ss.granularity:
        raise KvcalError(f"{where}: unknown granularity '{m.get('granularity')}' (tensor or head); {fix}")
    binding = m.get("binding")
    if not isinstance(binding, dict):
        raise KvcalError(f"{where}: the manifest has no binding section; {fix}")
    n = binding.get("num_layers")
    if not isinstance(n, int) or n <= 0:
        raise KvcalError(f"{where}: the binding has no valid layer count; {fix}")
    if len(ss.k_scales) != n or len(ss.v_scales) != n:
        raise KvcalError(
            f"{where}: {len(ss.k_scales)} K and {len(ss.v_scales)} V scale tensors for a model of {n} layers; {fix}"
        )
    stats = m.get("layer_stats", [])
    if not isinstance(stats, list) or (stats and len(stats) != n):
        raise KvcalError(f"{where}: per-layer stats for {len(stats)} layers, model has {n}; {fix}")
    for i in range(n):
        heads = _layer_kv_heads(binding, i)
        want = (1,) if ss.granularity == "tensor" else ((heads,) if heads else None)
        for kind, t in (("k_scale", ss.k_scales[i]), ("v_scale", ss.v_scales[i])):
            if not isinstance(t, torch.Tensor) or t.dtype != torch.float32:
                raise KvcalError(f"{where}: layer {i} {kind} is not a float32 tensor; {fix}")
            if want is None or tuple(t.shape) != want:
                raise KvcalError(
                    f"{where}: layer {i} {kind} has shape {tuple(t.shape)}, expected {want} for granularity "
                    f"'{ss.granularity}' with {heads} KV heads; {fix}"
                )
            if not bool(torch.isfinite(t).all()):
                raise KvcalError(f"{where}: layer {i} {kind} is not finite (NaN or Inf); {fix}")
            if not bool((t > 0).all()):
                raise KvcalError(
                    f"{where}: layer {i} {kind} has a zero or negative scale ({t.min().item():g}); {fix}"
                )
    _validate_q_scales(ss, n, where, fix)


def _validate_q_scales(ss: ScaleSet, n: int, where: str, fix: str) -> None:
    """q_scale: none, or one float32 (1,) finite positive scale per layer (vLLM takes per-tensor Q scales only)."""
    if ss.q_scales is None:
        return
    if len(ss.q_scales) != n:
        raise KvcalError(f"{where}: {len(ss.q_scales)} q_scale tensors for a model of {n} layers; {fix}")
    for i, t in enumerate(ss.q_scales):
        ok = isinstance(t, torch.Tensor) and t.dtype == torch.float32 and tuple(t.shape) == (1,)
        if not ok or not bool(torch.isfinite(t).all()) or not bool((t > 0).all()):
            raise KvcalError(f"{where}: layer {i} q_scale is not one finite positive float32 value; {fix}")


# ----------------------------------------------------------------------------------------------- save / load


def _checksum(manifest_str: str, tensors: dict[str, torch.Tensor]) -> str:
    h = hashlib.sha256()
    h.update(manifest_str.encode("utf-8"))
    for name in sorted(tensors):
        t = tensors[name].detach().cpu().contiguous()  # hashed as stored, whatever the dtype
        h.update(f"\0{name}\0{t.dtype}\0{tuple(t.shape)}\0".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def save_scale_file(path: str | os.PathLike[str], ss: ScaleSet) -> Path:
    """Validate and write `ss` atomically (a crash leaves no partial file). Returns the path."""
    from safetensors.torch import save_file

    target = Path(path)
    validate_scale_set(ss, where=f"scale set for {target}")
    tensors = ss.tensors()
    manifest_str = json.dumps(_json_safe(ss.manifest), sort_keys=True, separators=(",", ":"), allow_nan=False)
    metadata = {MANIFEST_KEY: manifest_str, CHECKSUM_KEY: _checksum(manifest_str, tensors)}
    if target.is_dir():
        raise UsageError(f"output path '{target}' is a folder; pass a file name like scales.safetensors")
    try:

        def write(tmp: Path) -> None:
            save_file(tensors, str(tmp), metadata=metadata)

        atomic_write_with(target, write)
    except OSError as exc:
        raise KvcalError(
            f"cannot write scale file '{target}': {exc.strerror or exc}; choose a writable output path"
        ) from exc
    return target


def load_scale_file(path: str | os.PathLike[str]) -> ScaleSet:
    """Read and validate a scale file (no unpickling: safetensors + JSON only)."""
    from safetensors import safe_open

    p = Path(path)
    fix = "re-run `kvcal calibrate` to regenerate it"
    if not p.is_file():
        what = "is a folder" if p.is_dir() else "does not exist"
        raise UsageError(f"scale file '{p}' {what}; pass the .safetensors file `kvcal calibrate` wrote")
    try:
        with safe_open(str(p), framework="pt") as fh:
            metadata = fh.metadata() or {}
            tensors = {name: fh.get_tensor(name) for name in fh.keys()}  # noqa: SIM118
    except Exception as exc:  # safetensors raises its own error types for truncated / garbled headers
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise KvcalError(f"scale file '{p}' is truncated or corrupted ({first}); {fix}") from None
    if MANIFEST_KEY not in metadata:
        raise KvcalError(f"'{p}' is not a kvcal scale file (no '{MANIFEST_KEY}' metadata); {fix}")
    manifest_str = metadata[MANIFEST_KEY]
    try:
        manifest = json.loads(manifest_str)
    except json.JSONDecodeError as exc:
        raise KvcalError(f"scale file '{p}' has a garbled manifest ({exc.msg} at {exc.pos}); {fix}") from None
    if metadata.get(CHECKSUM_KEY) != _checksum(manifest_str, tensors):
        raise KvcalError(f"scale file '{p}' was modified after kvcal wrote it (checksum mismatch); {fix}")
    if not isinstance(manifest, dict) or manifest.get("schema") != SCHEMA:
        raise KvcalError(f"scale file '{p}' has no kvcal manifest (schema '{SCHEMA}'); {fix}")
    version = manifest.get("schema_version")
    if not isinstance(version, int) or version > SCHEMA_VERSION:
        raise KvcalError(
            f"scale file '{p}' has schema version {version!r}; this kvcal reads up to {SCHEMA_VERSION}: "
            "upgrade kvcal"
        )
    binding = manifest.get("binding") if isinstance(manifest.get("binding"), dict) else {}
    n = binding.get("num_layers")
    if not isinstance(n, int) or n <= 0:
        raise KvcalError(f"scale file '{p}' has no valid layer count in its manifest binding; {fix}")
    expected = {K_NAME.format(i=i) for i in range(n)} | {V_NAME.format(i=i) for i in range(n)}
    q_names = [Q_NAME.format(i=i) for i in range(n)]
    has_q = isinstance(version, int) and version >= 2 and q_names[0] in tensors
    if has_q:
        expected |= set(q_names)
    if set(tensors) != expected:
        extra = sorted(set(tensors) - expected)[:3]
        missing = sorted(expected - set(tensors))[:3]
        raise KvcalError(
            f"scale file '{p}' does not hold exactly the K/V scales of {n} layers "
            f"(unexpected: {extra or 'none'}, missing: {missing or 'none'}); {fix}"
        )
    fmt = manifest.get("kv_format")
    ss = ScaleSet(
        kv_format=str(fmt),
        granularity=str(manifest.get("granularity")),
        k_scales=[tensors[K_NAME.format(i=i)] for i in range(n)],
        v_scales=[tensors[V_NAME.format(i=i)] for i in range(n)],
        manifest=manifest,
        q_scales=[tensors[name] for name in q_names] if has_q else None,
    )
    validate_scale_set(ss, where=f"scale file '{p}'")
    return ss


# ----------------------------------------------------------------------------------------------- binding


def weight_files(model_dir: Path) -> list[Path]:
    """Every weight file of a model folder (top level, sorted)."""
    return sorted(p for p in model_dir.iterdir() if p.is_file() and p.name.endswith(WEIGHT_SUFFIXES))


def _combine(named: dict[str, str]) -> str:
    h = hashlib.sha256()
    for name in sorted(named):
        h.update(f"{name}:{named[name]}\n".encode())
    return h.hexdigest()


def compute_binding(model_ref: str, model_dir: str | os.PathLike[str], kv: KVSpec) -> dict[str, Any]:
    """What a scale set is bound to: hashes of config.json, tokenizer files and weight files, and KV geometry."""
    d = Path(model_dir)
    config = d / "config.json"
    if not config.is_file():
        raise UsageError(f"model folder '{d}' has no config.json; pass a Hugging Face model folder")
    tokenizer = {name: file_sha256(d / name) for name in TOKENIZER_FILES if (d / name).is_file()}
    weights_list = weight_files(d)
    if not weights_list:
        raise UsageError(f"model folder '{d}' has no weight files ({', '.join(WEIGHT_SUFFIXES)})")
    weights = {
        wf.name: digest for wf, (digest, _hit) in zip(weights_list, cached_sha256(weights_list), strict=True)
    }
    kv_heads = [layer.kv_heads for layer in kv.layers]
    head_dims = [layer.head_dim for layer in kv.layers]
    return {
        "model": str(model_ref),
        "model_dir": str(d.resolve()),
        "model_type": kv.model_type,
        "config_sha256": file_sha256(config),
        "tokenizer_sha256": _combine(tokenizer) if tokenizer else None,
        "tokenizer_files": tokenizer,
        "weights_sha256": _combine(weights),
        "weight_files": weights,
        "num_layers": kv.num_layers,
        "num_kv_heads": kv_heads[0] if len(set(kv_heads)) == 1 else kv_heads,
        "head_dim": head_dims[0] if len(set(head_dims)) == 1 else head_dims,
        "layer_types": kv.layer_types,
    }


def _geometry_differences(bound: dict[str, Any], kv: KVSpec) -> list[str]:
    """Differences that make the scales unusable on this model whatever the user says."""
    diffs = []
    if bound.get("num_layers") != kv.num_layers:
        diffs.append(f"layer count {bound.get('num_layers')} != {kv.num_layers}")
        return diffs
    kv_heads = [layer.kv_heads for layer in kv.layers]
    want_heads = kv_heads[0] if len(set(kv_heads)) == 1 else kv_heads
    if bound.get("num_kv_heads") != want_heads:
        diffs.append(f"KV heads {bound.get('num_kv_heads')} != {want_heads}")
    head_dims = [layer.head_dim for layer in kv.layers]
    want_dim = head_dims[0] if len(set(head_dims)) == 1 else head_dims
    if bound.get("head_dim") != want_dim:
        diffs.append(f"head_dim {bound.get('head_dim')} != {want_dim}")
    return diffs


def _files_changed(kind: str, old: dict[str, str], new: dict[str, str]) -> list[str]:
    parts = [name for name in sorted(set(old) & set(new)) if old[name] != new[name]]
    parts += [f"{name} added" for name in sorted(set(new) - set(old))]
    parts += [f"{name} removed" for name in sorted(set(old) - set(new))]
    return [f"{kind} changed ({', '.join(parts)})"] if parts else []


def binding_differences(
    ss: ScaleSet, model_ref: str, model_dir: str | os.PathLike[str], kv: KVSpec
) -> list[str]:
    """What differs between the checkpoint the scales were calibrated on and this one; [] = bound."""
    return bound_differences(ss.binding, model_ref, model_dir, kv)


def bound_differences(
    bound: dict[str, Any], model_ref: str, model_dir: str | os.PathLike[str], kv: KVSpec
) -> list[str]:
    """What differs between the checkpoint a `compute_binding` record was made on and this one; [] = bound (a
    scale file's binding, or a `kvcal plan` file's)."""
    diffs = _geometry_differences(bound, kv)
    if bound.get("layer_types") != kv.layer_types and not diffs:
        diffs.append("layer types changed (sliding/full attention pattern differs)")
    now = compute_binding(model_ref, model_dir, kv)
    if bound.get("config_sha256") != now["config_sha256"]:
        diffs.append("config.json changed")
    if bound.get("tokenizer_sha256") != now["tokenizer_sha256"]:
        detail = _files_changed("tokenizer", bound.get("tokenizer_files") or {}, now["tokenizer_files"])
        diffs += detail or ["tokenizer changed"]
    if bound.get("weights_sha256") != now["weights_sha256"]:
        detail = _files_changed("weights", bound.get("weight_files") or {}, now["weight_files"])
        diffs += detail or ["weights changed"]
    return diffs


def load_scales_for_model(
    path: str | os.PathLike[str],
    model_ref: str,
    model_dir: str | os.PathLike[str],
    kv: KVSpec,
    kv_format: str | None = None,
    force: bool = False,
) -> ScaleSet:
    """Load a scale file for use with this model; everything checked.

    A different format, layer count, KV heads or head_dim is always refused (the scales cannot fit). A binding
    mismatch (config, tokenizer, weights changed) is refused unless `force`; then the differences are returned
    in `ss.binding_warnings` (and logged) and the caller must warn loudly."""
    want = None if kv_format is None else canonical_format(kv_format)
    return _checked(load_scale_file(path), path, model_ref, model_dir, kv, want, force)[0]


def bind_scale_file(
    ss: ScaleSet | None,
    path: str | os.PathLike[str],
    model_ref: str,
    model_dir: str | os.PathLike[str],
    kv: KVSpec,
    *,
    kv_format: str,
    force: bool,
    attention: str,
) -> tuple[ScaleSet, dict[str, Any]]:
    """An evaluation's scale file against its checkpoint (kvcal.evaluate.bound.bind): `load_scales_for_model`'s
    checks with the spec's canonical `kv_format`, the query scales `--attention fp8` needs, and config.yaml's
    `scales` record (what the file is and how it fits the checkpoint; the binding compared once). `ss`: the file
    as `eval_spec` loaded it, or None to read it now (a sweep cell's file, calibrated after the cell was named)."""
    if ss is None:
        ss = load_scale_file(path)
    ss, diffs = _checked(ss, path, model_ref, model_dir, kv, kv_format, force)
    query_scales(attention, ss, kv.num_layers)  # --attention fp8 refuses a scale file without q_scale
    observer = ss.manifest.get("observer")
    record: dict[str, Any] = {
        "sha256": file_sha256(path),
        "granularity": ss.granularity,
        "observer": observer.get("name") if isinstance(observer, dict) else observer,
        "binding_differences": diffs,
        "kv_input_dtype": ss.kv_input_dtype,  # what the scales were measured on (the eval's: kv_input_dtype)
    }
    if diffs and force:
        record["WARNING"] = "scales were measured on another checkpoint; used anyway because of --force-scales"
    return ss, record


def _checked(
    ss: ScaleSet,
    path: str | os.PathLike[str],
    model_ref: str,
    model_dir: str | os.PathLike[str],
    kv: KVSpec,
    want: str | None,
    force: bool,
) -> tuple[ScaleSet, list[str]]:
    """(`ss`, its binding differences) after the checks; `want`: the canonical format the run uses."""
    if want is not None and want != ss.kv_format and SAME_SCALES.get(want) != ss.kv_format:
        raise KvcalError(
            f"scale file '{path}' holds {ss.kv_format} scales but the KV format is {want}; "
            f"calibrate for {want} or use --kv-format {ss.kv_format}"
        )
    geometry = _geometry_differences(ss.binding, kv)
    if geometry:
        raise KvcalError(
            f"scale file '{path}' does not fit model '{model_ref}': {'; '.join(geometry)}; "
            "calibrate scales for this model"
        )
    diffs = binding_differences(ss, model_ref, model_dir, kv)
    if diffs and not force:
        raise KvcalError(
            f"scale file '{path}' is stale for model '{model_ref}': {'; '.join(diffs)}; "
            "re-run `kvcal calibrate` on this checkpoint (or force it, at your own risk)"
        )
    if diffs:
        ss.binding_warnings = [
            f"scale file '{path}' was calibrated on another checkpoint ({d}); using it anyway (forced)"
            for d in diffs
        ]
        for w in ss.binding_warnings:
            log.warning(w)
    return ss, diffs


def query_scales(attention: str, scales: ScaleSet | None, num_layers: int) -> list[float] | None:
    """Per-layer q_scale for FP8 attention: the scale file's (`kvcal calibrate --attention-scales`), 1.0 without
    a scale file (what vLLM uses when the checkpoint has none: kv_cache.py warns "Using uncalibrated q_scale 1.0");
    None when attention is not FP8. A scale file without q scales is refused: its K/V scales are calibrated, so a
    silent 1.0 for Q would mix a calibrated cache with an uncalibrated query."""
    if attention != "fp8":
        return None
    if scales is None:
        return [1.0] * num_layers
    q = scales.q_scales
    if not q:
        raise UsageError(
            "--attention fp8 needs the query scale (q_scale) of every layer, but this scale file has none; "
            "recalibrate with `kvcal calibrate --attention-scales`, or drop --scales to use q_scale 1.0"
        )
    return [float(torch.as_tensor(x).reshape(-1)[0]) for x in q]


def resolve_model_and_spec(model: str) -> tuple[Path, KVSpec]:
    """(local model folder, KV geometry) for a MODEL argument: a folder, hub id, .gguf file or real-model name
    (kvcal.models.resolve.resolve_model)."""
    model_dir = resolve_model(model)
    return model_dir, kv_spec(load_config(model_dir))
