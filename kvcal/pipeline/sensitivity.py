"""Per-layer sensitivity: how much does quantizing ONE layer's KV cache move the model's next-token distribution?

For each sample: one reference forward (K/V untouched), one forward with every layer's K/V fake-quantized, and one
forward per layer with only that layer quantized. A `DynamicCache` subclass fake-quantizes K/V inside `update`
(kvcal.formats.fake_quantize, with the calibrated scales), so every attention read of the prefill sees the
quantized cache, exactly as it would in an engine that stores the format. Damage = mean KL(reference || quantized)
over the sample's tokens (nats), and the share of tokens whose top-1 prediction changes. The layers before a
forward's only quantized layer are not run again: their outputs are the reference's (kvcal.pipeline.replay).

Advice: layers whose damage exceeds `factor` x the median layer's are the skip-layer candidates; when the
sliding-window layers as a group take more damage per layer than the full-attention ones, `sliding_window` (vLLM's
`--kv-cache-dtype-skip-layers` name) is suggested. `advice.layers` lists exactly the layers the suggestion keeps
in BF16 (what `kvcal sensitivity` marks).

Scales (the same policy as `kvcal eval`): without --scales, 1.0 for fp8 and nvfp4's global scale (vLLM's default
when the checkpoint has none); `--scales FILE` a calibrated scale file; `--scales minmax` minmax per tensor on the
same samples; formats with dynamic scales need none.
"""

from __future__ import annotations

import os
import statistics
from collections.abc import Sequence
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import DynamicCache

from kvcal.calibrate.hooks import ProgressFn, batches, pad_batch, per_row_attention
from kvcal.calibrate.observation import ObserveOptions
from kvcal.calibrate.observers import get_observer
from kvcal.calibrate.run import check_output_path, observed_scales
from kvcal.errors import KvcalError, UsageError
from kvcal.evaluate.kl import kl_per_token
from kvcal.formats import KVFormat, fake_quantize, get_format
from kvcal.io import atomic_write_json
from kvcal.models.geometry import FULL, SLIDING, KVSpec, kv_spec
from kvcal.models.loading import LoadedModel, check_device, input_device, loaded
from kvcal.pipeline.replay import LayerReplay
from kvcal.placement import Placement, PlacementOptions
from kvcal.scales import load_scales_for_model

MINMAX = "minmax"  # --scales minmax: scales observed on the samples themselves (the pre-issue-27 default)


class FakeQuantCache(DynamicCache):
    """Prefill-only cache that returns fake-quantized K/V for the chosen layers (nothing is stored)."""

    def __init__(
        self,
        config: Any,
        fmt: KVFormat,
        layers: frozenset[int],
        k_scales: Sequence[torch.Tensor | None],
        v_scales: Sequence[torch.Tensor | None],
    ) -> None:
        super().__init__(config=config)
        self.fmt, self.quant_layers, self.k_scales, self.v_scales = fmt, layers, k_scales, v_scales

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # key_states, value_states: [B, H_kv, T, D]
        if layer_idx in self.quant_layers:
            key_states = fake_quantize(key_states, self.fmt, scale=_scale_arg(self.k_scales[layer_idx]))
            value_states = fake_quantize(value_states, self.fmt, scale=_scale_arg(self.v_scales[layer_idx]))
        return key_states, value_states


def _scale_arg(s: torch.Tensor | None) -> torch.Tensor | None:
    if s is None:
        return None
    return s.reshape(()) if s.numel() == 1 else s


def _logprobs(model: Any, ids: torch.Tensor, cache: DynamicCache) -> torch.Tensor:
    out = model(input_ids=ids, past_key_values=cache, use_cache=True)
    return torch.log_softmax(out.logits.float(), dim=-1)  # [1, T, V]


def _damage(ref: torch.Tensor, q: torch.Tensor, lengths: Sequence[int]) -> list[tuple[float, float]]:
    """Per row: mean KL(ref || q) per real token (nats) and top-1 agreement; ref, q: [B, T, V] log-probabilities
    of a right-padded batch, `lengths` the real tokens per row."""
    kl, agree = kl_per_token(ref, q)  # [B, T] each
    return [
        (float(kl[b : b + 1, :n].mean()), float(agree[b : b + 1, :n].mean())) for b, n in enumerate(lengths)
    ]


def layer_sensitivity(
    model: Any,
    samples: Sequence[torch.Tensor],
    kv: KVSpec,
    fmt: KVFormat,
    k_scales: Sequence[torch.Tensor | None],
    v_scales: Sequence[torch.Tensor | None],
    progress: ProgressFn | None = None,
    factor: float = 2.0,
    batch_size: int = 1,
) -> dict[str, Any]:
    """Per-layer KL / top-1 damage of quantizing one layer's KV cache, the all-layer damage, and advice.
    `batch_size` samples per forward, right-padded, attention row by row (hooks.per_row_attention): the same
    numbers as one sample per forward."""
    n_layers = kv.num_layers
    device = input_device(model)
    # per sample (in the given order, whatever the batching), per layer; last column: all layers quantized
    per_kl = torch.zeros(len(samples), n_layers + 1, dtype=torch.float64)
    per_agree = torch.zeros(len(samples), n_layers + 1, dtype=torch.float64)
    total = len(samples) * (n_layers + 2)
    done = 0
    all_layers = frozenset(range(n_layers))
    row_lengths: list[int] = []
    rowwise = per_row_attention(model, row_lengths) if batch_size > 1 else nullcontext()
    replay = LayerReplay(model, n_layers)
    with torch.no_grad(), rowwise:
        for group in batches(samples, batch_size):
            ids, row_lengths[:] = pad_batch([samples[i] for i in group])
            ids = ids.to(device)
            with replay.capture():
                ref = _logprobs(model, ids, FakeQuantCache(model.config, fmt, frozenset(), k_scales, v_scales))
            done += len(group)
            for j, layers in enumerate([frozenset([i]) for i in range(n_layers)] + [all_layers]):
                with replay.skip(min(layers)):  # layers before the first quantized one: the reference's outputs
                    q = _logprobs(model, ids, FakeQuantCache(model.config, fmt, layers, k_scales, v_scales))
                for i, (d_kl, d_agree) in zip(group, _damage(ref, q, row_lengths), strict=True):
                    per_kl[i, j], per_agree[i, j] = d_kl, d_agree
                done += len(group)
                if progress:
                    progress(done, total, "sensitivity")
    kl = torch.zeros(n_layers + 1, dtype=torch.float64)
    agree = torch.zeros(n_layers + 1, dtype=torch.float64)
    for i in range(len(samples)):  # summed sample by sample, as one sample per forward always did
        kl += per_kl[i]
        agree += per_agree[i]
    kl /= len(samples)
    agree /= len(samples)
    layers = [
        {"layer": i, "type": kv.layers[i].type, "kl": float(kl[i]), "top1_agree": float(agree[i])}
        for i in range(n_layers)
    ]
    by_type: dict[str, dict[str, float]] = {}
    for t in sorted({r["type"] for r in layers}):
        rows = [r for r in layers if r["type"] == t]
        by_type[t] = {"layers": len(rows), "mean_kl": statistics.fmean(r["kl"] for r in rows)}
    return {
        "all_layers": {"kl": float(kl[n_layers]), "top1_agree": float(agree[n_layers])},
        "layers": layers,
        "by_type": by_type,
        "worst": [r["layer"] for r in sorted(layers, key=lambda r: -r["kl"])[:5]],
        "advice": _advice(layers, by_type, factor),
    }


def _advice(
    layers: list[dict[str, Any]], by_type: dict[str, dict[str, float]], factor: float
) -> dict[str, Any]:
    """The --skip-layers suggestion: the layers above `factor` x the median damage, or `sliding_window` when the
    sliding-window layers take `factor` x the full-attention layers' mean damage."""
    med = statistics.median(r["kl"] for r in layers)
    skip = sorted(r["layer"] for r in layers if med > 0 and r["kl"] > factor * med)
    reasons = []
    suggestion = ",".join(map(str, skip))
    if SLIDING in by_type and len(by_type) > 1:
        s, f = by_type[SLIDING]["mean_kl"], by_type[FULL]["mean_kl"]
        if s > factor * f:
            suggestion = "sliding_window"
            reasons.append(
                f"sliding-window layers take {s / max(f, 1e-30):.1f}x the damage of full-attention layers"
            )
    if skip:
        reasons.append(f"layers {skip} exceed {factor}x the median layer damage ({med:.3g} nats)")
    chosen = [r["layer"] for r in layers if r["type"] == SLIDING] if suggestion == "sliding_window" else skip
    return {
        "skip_layers": suggestion or None,
        "layers": chosen,
        "reasons": reasons or ["no layer stands out"],
    }


@dataclass
class SensitivityConfig(PlacementOptions):
    """The options of `kvcal sensitivity` as given (by name and default); `sensitivity_spec` parses them once."""

    model: str | LoadedModel
    kv_format: str
    scales: str | None = None  # a scale file, "minmax" (on the same samples), or None (scale 1.0)
    dataset: str | None = None
    num_samples: int = 8
    seq_len: int = 256
    seed: int = 0
    output: str | os.PathLike[str] | None = None  # the report as JSON
    text_field: str | None = None
    dtype: str = "float32"
    device: str = "cpu"
    factor: float = 2.0  # layers above factor x the median damage are the skip candidates
    batch_size: int = 1  # samples per forward (the same numbers as 1)
    # (PlacementOptions: accelerate's placement, device_map / max_memory / offload_folder)


@dataclass(frozen=True)
class SensitivitySpec:
    """One sensitivity measurement, parsed and checked without a model (build it with `sensitivity_spec`)."""

    model: str | LoadedModel
    fmt: KVFormat
    scales: str | None
    output: Path | None  # checked writable (check_output_path)
    opts: ObserveOptions  # K/V as the model computes them (kv_input_dtype None): fake-quantized unrounded
    placement: Placement
    dtype: str
    device: str
    factor: float


def sensitivity_spec(config: SensitivityConfig) -> SensitivitySpec:
    """Every check that needs no model (format, --scales, output path, device, the dataset), in this order."""
    c = config
    fmt = get_format(c.kv_format)
    if fmt.name == "auto":
        raise UsageError("sensitivity of 'auto' is zero by definition; pick a quantized --kv-format")
    if c.scales and not fmt.calibratable:
        raise UsageError(f"KV format '{fmt.name}' has dynamic scales; drop --scales")
    if c.seq_len < 2:  # the KL of the next-token distributions: one token attends only to itself
        raise UsageError(
            f"--seq-len must be at least 2 tokens (damage is measured on the next tokens), got {c.seq_len}"
        )
    if c.factor is not None and c.factor <= 0:
        raise UsageError(f"--factor must be a positive multiple of the median damage, got {c.factor:g}")
    out = check_output_path(c.output)
    opts = ObserveOptions.parse(
        dataset=c.dataset, text_field=c.text_field, num_samples=c.num_samples, seq_len=c.seq_len, seed=c.seed,
        batch_size=c.batch_size,
    )  # fmt: skip
    placement = c.placement()
    if not isinstance(c.model, LoadedModel):
        check_device(c.device)
        placement.check()
    return SensitivitySpec(c.model, fmt, c.scales, out, opts, placement, c.dtype, c.device, c.factor)


def sensitivity(
    model: Any,
    kv_format: str,
    scales: str | None = None,
    dataset: str | None = None,
    num_samples: int = 8,
    seq_len: int = 256,
    seed: int = 0,
    output: str | None = None,
    progress: ProgressFn | None = None,
    *,
    text_field: str | None = None,
    dtype: str = "float32",
    device: str = "cpu",
    factor: float = 2.0,
    batch_size: int = 1,
    device_map: str | None = None,
    max_memory: str | None = None,
    offload_folder: str | None = None,
) -> dict[str, Any]:
    """`run_sensitivity(sensitivity_spec(SensitivityConfig(...)))` for keyword callers: the keywords are
    SensitivityConfig's fields (see there), `progress` the callback `progress(done, total, phase)`."""
    options = {k: v for k, v in locals().items() if k != "progress"}  # exactly SensitivityConfig's fields
    return run_sensitivity(sensitivity_spec(SensitivityConfig(**options)), progress)


def run_sensitivity(spec: SensitivitySpec, progress: ProgressFn | None = None) -> dict[str, Any]:
    """Load, sample, get scales (a scale file, or minmax on the same samples for calibratable formats), measure;
    the report, also written to the spec's output."""
    opts, fmt = spec.opts, spec.fmt
    source = opts.texts()
    lm = loaded(spec.model, spec.dtype, spec.device, spec.placement)
    kv = kv_spec(lm.model.config)
    data = opts.samples(lm, source)
    k_scales, v_scales, scale_source = layer_scales(lm, kv, fmt, spec.scales, data.samples, progress, opts)
    result = layer_sensitivity(
        lm.model, data.samples, kv, fmt, k_scales, v_scales, progress=progress, factor=spec.factor,
        batch_size=opts.batch_size,
    )  # fmt: skip
    report = {
        "model": lm.ref,
        "model_type": kv.model_type,
        "kv_format": fmt.name,
        "scales": scale_source,
        "calibration": data.manifest(),
        "metric": "mean per-token KL(reference || quantized) in nats; top-1 agreement",
        **result,
        "warnings": data.warnings,
    }
    if spec.output is not None:
        try:
            atomic_write_json(spec.output, report)
        except OSError as exc:
            raise KvcalError(
                f"cannot write '{spec.output}': {exc.strerror or exc}; choose another -o path"
            ) from None
    return report


def layer_scales(
    lm: LoadedModel,
    kv: KVSpec,
    fmt: KVFormat,
    scales: str | None,
    samples: Sequence[torch.Tensor],
    progress: ProgressFn | None,
    opts: ObserveOptions,
) -> tuple[list[torch.Tensor | None], list[torch.Tensor | None], str]:
    """(k_scales, v_scales, where they came from) for a calibratable format: 1.0 without `scales` (kvcal eval's
    and vLLM's default: kvcal.kernels.cache policy "one"), a scale file, or "minmax": minmax per tensor on the
    same samples; else None per layer (the format's dynamic scales)."""
    n = kv.num_layers
    if not fmt.calibratable:
        return [None] * n, [None] * n, "dynamic (format has no static scales)"
    if scales is None:
        one = torch.ones(())
        return [one] * n, [one] * n, "scale 1.0, as kvcal eval and vLLM without scales"
    if scales == MINMAX:
        ks, vs, _ = observed_scales(
            lm.model, samples, kv, fmt, "tensor", get_observer("minmax"), opts, progress
        )
        return list(ks), list(vs), "minmax per tensor on the same samples"
    ss = load_scales_for_model(scales, lm.ref, lm.model_dir, kv, kv_format=fmt.name)
    return list(ss.k_scales), list(ss.v_scales), f"scale file {scales}"
