"""`kvcal plan`: which KV format per layer loses least for a capacity budget — measured, solved exactly, checked.

1. Damage (kvcal sensitivity's measurement, every candidate at once): per calibration batch one reference
   forward (the untouched cache) whose log-probabilities every one-layer forward reuses, then one forward per
   (layer, quantized candidate) with only that layer fake-quantized (PlanCache, sensitivity's FakeQuantCache per
   layer and side). Damage = mean KL(reference || quantized) per token, per sample; `bf16` is the model's own
   16-bit cache: damage 0, no forward. L x K' + 1 forwards per batch (K' quantized candidates), `batch_size`
   samples per forward; a forward whose first quantized layer is i replays the reference's layers 0..i-1
   (kvcal.pipeline.replay), so the one-layer forwards run (L + 1) / 2 decoder layers on average.
2. Tie-break: where a cheaper candidate's damage on a layer is within the standard error of the paired per-sample
   difference from a dearer one's, the dearer one is given the cheaper one's damage (it buys nothing measurable),
   and the solver's second stage (least cost among least-damage plans) then takes the cheaper.
3. Solve: kvcal.pipeline.plan_solve (scipy.optimize.milp / HiGHS, exact), costs from kvcal.pipeline.plan_cost
   (kvcal capacity's count). `--frontier`: a range of budgets, Pareto rows.
4. Measure: the chosen plan jointly (every layer in its format) on held-out windows (the kl task's text: WikiText-2
   test under --data-dir), KL per window with a t interval (scipy.stats); the estimate (summed one-at-a-time
   damage) beside it. Uniform configurations built from the candidates are measured on the same windows with
   paired differences. `--refine`: replace each chosen layer's damage by its in-context marginal (joint KL on the
   calibration samples minus the joint KL with that layer back in 16 bits), re-solve, keep the new plan while the
   held-out KL improves (at most `refine` rounds).
5. Uniform guard: the summed one-at-a-time damage misses interactions, so a solved plan can lose more than a
   one-format configuration the budget also allows. The chosen plan (and each
   frontier row) is measured jointly on the calibration samples beside every uniform configuration that meets its
   budget (exact integer costs); where one loses less there, it becomes the plan (`uniform_guard` in the result
   records every KL and the choice). The held-out windows decide nothing here: they only measure.
"""

from __future__ import annotations

import json
import math
import os
import statistics
from collections.abc import Sequence
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from scipy import stats
from transformers import DynamicCache

from kvcal import __version__
from kvcal.calibrate.hooks import ProgressFn, batches, pad_batch, per_row_attention
from kvcal.calibrate.observation import ObserveOptions
from kvcal.calibrate.run import check_output_path
from kvcal.errors import UsageError
from kvcal.evaluate.kl import bos_rule, kl_per_token, kl_text, make_windows
from kvcal.formats import KVFormat, fake_quantize, get_format, kv_pair, split_formats
from kvcal.io import atomic_write_json
from kvcal.models.config import load_config
from kvcal.models.geometry import SLIDING, KVSpec, kv_spec
from kvcal.models.loading import LoadedModel, check_device, input_device, loaded
from kvcal.models.real import resolve_real_name
from kvcal.pipeline.plan_cost import (
    Budget,
    check_reachable,
    integer_costs,
    meets_budget,
    parse_budget,
    plan_capacity,
)
from kvcal.pipeline.plan_export import SIXTEEN_BIT, canonical_layers, engine_commands
from kvcal.pipeline.plan_solve import solve
from kvcal.pipeline.replay import LayerReplay, first_quantized
from kvcal.pipeline.sensitivity import MINMAX, layer_scales
from kvcal.placement import Placement
from kvcal.planfile import plan_record, save_plan
from kvcal.scales import compute_binding, file_sha256

# per layer: (K format, K scale, V format, V scale), or None = untouched
LayerQuant = tuple[KVFormat, torch.Tensor | None, KVFormat, torch.Tensor | None] | None
Scales = dict[str, tuple[list[torch.Tensor | None], list[torch.Tensor | None]]]  # format -> (k, v) per layer


class PlanCache(DynamicCache):
    """Prefill-only cache returning each layer's K and V fake-quantized in that layer's own formats."""

    def __init__(self, config: Any, quant: Sequence[LayerQuant]) -> None:
        super().__init__(config=config)
        self.quant = quant

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # key_states, value_states: [B, H_kv, T, D]
        q = self.quant[layer_idx]
        if q is not None:
            fk, sk, fv, sv = q
            key_states = fake_quantize(key_states, fk, scale=sk)
            value_states = fake_quantize(value_states, fv, scale=sv)
        return key_states, value_states


def _scale(s: torch.Tensor | None) -> torch.Tensor | None:
    return None if s is None else (s.reshape(()) if s.numel() == 1 else s)


def layer_quant(layer: int, fmt: str, scales: Scales) -> LayerQuant:
    """How PlanCache quantizes `layer` in `fmt` (a format or K/V pair); bf16 = untouched (the model's cache)."""
    if fmt == SIXTEEN_BIT:
        return None
    fk, fv = kv_pair(fmt)
    k = scales[fk.name][0][layer] if fk.name in scales else None
    v = scales[fv.name][1][layer] if fv.name in scales else None
    return (fk, _scale(k), fv, _scale(v))


def plan_quant(layers: Sequence[str], scales: Scales) -> list[LayerQuant]:
    return [layer_quant(i, f, scales) for i, f in enumerate(layers)]


def _logprobs(model: Any, ids: torch.Tensor, cache: DynamicCache) -> torch.Tensor:
    out = model(input_ids=ids, past_key_values=cache, use_cache=True)
    return torch.log_softmax(out.logits.float(), dim=-1)  # [B, T, V]


def _row_kl(ref: torch.Tensor, q: torch.Tensor, lengths: Sequence[int]) -> list[tuple[float, float]]:
    kl, agree = kl_per_token(ref, q)  # [B, T] each
    return [(float(kl[b, :n].mean()), float(agree[b, :n].mean())) for b, n in enumerate(lengths)]


def per_sample_kl(
    model: Any,
    samples: Sequence[torch.Tensor],
    configs: Sequence[Sequence[LayerQuant]],
    batch_size: int,
    progress: ProgressFn | None = None,
    phase: str = "plan",
) -> torch.Tensor:
    """KL(reference || config) per sample and config: [N, C] float64 (top-1 agreement in [..., 1] of a second
    plane: returned as [2, N, C]). One reference forward per batch, reused by every config: its log-probabilities,
    and its outputs of the layers before a config's first quantized layer (kvcal.pipeline.replay)."""
    out = torch.zeros(2, len(samples), len(configs), dtype=torch.float64)
    device = input_device(model)
    lengths: list[int] = []
    rowwise = per_row_attention(model, lengths) if batch_size > 1 else nullcontext()
    groups = batches(samples, batch_size)
    total, done = len(samples) * (len(configs) + 1), 0
    untouched = [None] * model.config.num_hidden_layers
    replay = LayerReplay(model, len(untouched))
    with torch.no_grad(), rowwise:
        for group in groups:
            ids, lengths[:] = pad_batch([samples[i] for i in group])
            ids = ids.to(device)
            with replay.capture():
                ref = _logprobs(model, ids, PlanCache(model.config, untouched))
            done += len(group)
            for j, quant in enumerate(configs):
                with replay.skip(first_quantized(quant)):  # the layers before it are the reference's
                    q = _logprobs(model, ids, PlanCache(model.config, quant))
                for i, (kl, agree) in zip(group, _row_kl(ref, q, lengths), strict=True):
                    out[0, i, j], out[1, i, j] = kl, agree
                done += len(group)
                if progress:
                    progress(done, total, phase)
    return out


def interval(values: Sequence[float], level: float = 0.95) -> dict[str, float | None]:
    """Mean and its t interval (scipy.stats.t) of per-window values."""
    n = len(values)
    mean = statistics.fmean(values)
    if n < 2:
        return {"mean": mean, "lo": None, "hi": None, "stderr": None, "n": n}
    se = statistics.stdev(values) / math.sqrt(n)
    if se == 0:
        return {"mean": mean, "lo": mean, "hi": mean, "stderr": 0.0, "n": n}
    lo, hi = stats.t.interval(level, n - 1, loc=mean, scale=se)
    return {"mean": mean, "lo": float(lo), "hi": float(hi), "stderr": se, "n": n}


@dataclass
class Damage:
    """Per-layer, per-candidate damage: `mean` [L][K] nats, `per_sample` [N, L, K]."""

    candidates: list[str]
    mean: list[list[float]]
    per_sample: torch.Tensor

    def tie_broken(self, costs: list[list[int]]) -> tuple[list[list[float]], list[dict[str, Any]]]:
        """Damage the solver sees (see the module docstring, 2.) and what was tied."""
        n = self.per_sample.shape[0]
        eff = [row[:] for row in self.mean]
        ties = []
        for layer, row in enumerate(costs):
            order = sorted(range(len(row)), key=lambda k: row[k])
            for a, cheap in enumerate(order):
                for dear in order[a + 1 :]:
                    if row[dear] == row[cheap] or n < 2:
                        continue
                    diff = (self.per_sample[:, layer, cheap] - self.per_sample[:, layer, dear]).tolist()
                    se = statistics.stdev(diff) / math.sqrt(n)
                    if statistics.fmean(diff) <= se and eff[layer][dear] < self.mean[layer][cheap]:
                        eff[layer][dear] = self.mean[layer][cheap]
                        ties.append(
                            {
                                "layer": layer,
                                "cheaper": self.candidates[cheap],
                                "dearer": self.candidates[dear],
                            }
                        )
        return eff, ties


def measure_damage(
    model: Any,
    samples: Sequence[torch.Tensor],
    kv: KVSpec,
    candidates: list[str],
    scales: Scales,
    batch_size: int,
    progress: ProgressFn | None = None,
) -> Damage:
    """One layer at a time, every quantized candidate (bf16: 0 without a forward)."""
    n_layers, untouched = kv.num_layers, [None] * kv.num_layers
    jobs: list[tuple[int, int]] = []
    configs: list[list[LayerQuant]] = []
    for layer in range(n_layers):
        for k, f in enumerate(candidates):
            if f == SIXTEEN_BIT:
                continue
            quant: list[LayerQuant] = list(untouched)
            quant[layer] = layer_quant(layer, f, scales)
            jobs.append((layer, k))
            configs.append(quant)
    kl = per_sample_kl(model, samples, configs, batch_size, progress, "damage")[0]  # [N, jobs]
    per = torch.zeros(len(samples), n_layers, len(candidates), dtype=torch.float64)
    for j, (layer, k) in enumerate(jobs):
        per[:, layer, k] = kl[:, j]
    mean = per.mean(dim=0)  # [L, K]
    return Damage(candidates, mean.tolist(), per)


DAMAGE_KIND = "kvcal plan damage"


def damage_key(
    binding: dict[str, Any], candidates: list[str], scales: dict[str, Any], calibration: dict[str, Any], dtype: str
) -> dict[str, Any]:
    """What a damage measurement depends on; a damage checkpoint is reused only under the same key."""
    return {"binding": binding, "candidates": candidates, "scales": scales, "calibration": calibration,
            "dtype": dtype}  # fmt: skip


def save_damage(path: str, key: dict[str, Any], damage: Damage) -> None:
    """The per-sample damage [N, L, K] with its key, as JSON (written atomically)."""
    atomic_write_json(
        path, {"kind": DAMAGE_KIND, "version": 1, "key": key, "per_sample": damage.per_sample.tolist()}, indent=None
    )


def read_damage_file(path: str) -> dict[str, Any] | None:
    """The damage record at `path` (None when there is no file); UsageError when it is not one. Checked before
    the model loads."""
    p = Path(path).expanduser()
    if not p.exists():
        check_output_path(p)
        return None
    try:
        record = json.loads(p.read_text())
        ok = isinstance(record, dict) and record.get("kind") == DAMAGE_KIND and record.get("version") == 1
    except (OSError, ValueError) as exc:
        raise UsageError(f"--checkpoint '{path}' is not a kvcal plan damage file ({exc}); pass another path") from exc
    if not ok:
        raise UsageError(f"--checkpoint '{path}' is not a kvcal plan damage file; pass another path")
    _check_damage_shape(path, record)
    return record


def _check_damage_shape(path: str, record: dict[str, Any]) -> None:
    """A damage record's schema: `key` a mapping, `per_sample` a [N, L, K] nested list (N, L, K >= 1) of finite
    numbers. UsageError naming what is wrong, before the model loads (a file written by kvcal always passes)."""
    bad = f"--checkpoint '{path}' is a damaged kvcal plan damage file"
    if not isinstance(record.get("key"), dict):
        raise UsageError(f"{bad}: 'key' is not a mapping; delete it to measure again")
    per = record.get("per_sample")
    if not (isinstance(per, list) and per and all(isinstance(s, list) and s for s in per)):
        raise UsageError(f"{bad}: 'per_sample' is not an [N, L, K] list of samples; delete it to measure again")
    shape = (len(per[0]), len(per[0][0]) if isinstance(per[0][0], list) else -1)
    for sample in per:
        if len(sample) != shape[0] or any(not isinstance(row, list) or len(row) != shape[1] for row in sample):
            raise UsageError(f"{bad}: 'per_sample' rows differ in shape; delete it to measure again")
        for row in sample:
            if any(isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) for v in row):
                raise UsageError(
                    f"{bad}: 'per_sample' holds a value that is not a finite number; delete it to measure again"
                )
    if shape[1] < 1:
        raise UsageError(f"{bad}: 'per_sample' is not an [N, L, K] list of samples; delete it to measure again")


def check_damage_fits(path: str, record: dict[str, Any], layers: int, candidates: Sequence[str]) -> None:
    """The saved damage's [N, L, K] against this model's layers and these candidates (before the model loads)."""
    per = record["per_sample"]
    have = (len(per[0]), len(per[0][0]))
    if have != (layers, len(candidates)):
        raise UsageError(
            f"--checkpoint '{path}' holds damage of {have[0]} layers x {have[1]} candidates; this model has {layers}"
            f" layers and {len(candidates)} candidates ({', '.join(candidates)}): use a different checkpoint path"
        )


def load_damage(path: str, record: dict[str, Any], key: dict[str, Any]) -> Damage:
    """The saved damage, refused (UsageError) when it was measured under another key."""
    want = json.loads(json.dumps(key, default=str))
    differ = [k for k in want if record["key"].get(k) != want[k]]
    if differ:
        raise UsageError(
            f"--checkpoint '{path}' was measured with another {', '.join(differ)}; use a different checkpoint "
            "path (or delete it to measure again)"
        )
    per = torch.tensor(record["per_sample"], dtype=torch.float64)  # [N, L, K]
    return Damage(key["candidates"], per.mean(dim=0).tolist(), per)


def choose(
    damage: list[list[float]], costs: list[list[int]], limit: int, candidates: list[str]
) -> list[str] | None:
    sol = solve(damage, costs, limit)
    return None if sol is None else [candidates[k] for k in sol.choice]


def estimated_kl(damage: Damage, layers: Sequence[str]) -> float:
    return float(sum(damage.mean[i][damage.candidates.index(f)] for i, f in enumerate(layers)))


def uniform_configurations(kv: KVSpec, candidates: list[str]) -> dict[str, list[str]]:
    """The one-format plans the study compares with: every quantized candidate on every layer, and with the
    sliding-window layers in BF16 where the model has them (`--kv-cache-dtype-skip-layers sliding_window`)."""
    out: dict[str, list[str]] = {}
    sliding = {layer.index for layer in kv.layers if layer.type == SLIDING}
    for f in candidates:
        if f == SIXTEEN_BIT:
            continue
        out[f] = [f] * kv.num_layers
        if sliding and len(sliding) < kv.num_layers:
            out[f"{f} +sliding bf16"] = [SIXTEEN_BIT if i in sliding else f for i in range(kv.num_layers)]
    return out


def load_heldout(
    lm: LoadedModel, data_dir: str | None, num: int, seq_len: int
) -> tuple[list[torch.Tensor], str, list[str]]:
    """`num` non-overlapping windows of `seq_len` tokens of the kl task's text (WikiText-2 test in --data-dir)."""
    text, source = kl_text(data_dir)
    bos = bos_rule(lm.tokenizer)["bos_token_id"]
    windows, available = make_windows(lm.tokenizer, text, seq_len, num, bos)
    warnings = []
    if len(windows) < num:
        warnings.append(
            f"held-out text ({source}) has {available} windows of {seq_len}; measured on {len(windows)}"
        )
    return [torch.tensor(w, dtype=torch.int64) for w in windows], source, warnings


def parse_candidates(candidates: Sequence[str]) -> list[str]:
    """Canonical, de-duplicated candidates; UsageError for auto, unknown names, or fewer than two."""
    out = []
    for c in candidates:
        name = canonical_layers([c])[0] if str(c).strip().lower() not in ("", "auto") else "auto"
        if name == "auto":
            raise UsageError("--candidates: 'auto' is not a storage format; use bf16 for a 16-bit layer")
        if name not in out:
            out.append(name)
    if len(out) < 2:
        raise UsageError(
            f"--candidates needs at least two formats to choose between, got {', '.join(out) or 'none'}"
        )
    return out


DEFAULT_CANDIDATES = "bf16,fp8_e4m3,nvfp4,k=fp8_e4m3,v=nvfp4"


@dataclass
class PlanConfig:
    """The options of `kvcal plan` as given (by name and default); `plan_spec` parses them once."""

    model: str | LoadedModel
    candidates: str | Sequence[str] = DEFAULT_CANDIDATES  # comma-separated (k=A,v=B pairs stay one) or a list
    capacity: str | None = None  # the budget: at least this many x BF16's tokens ("3.0x")
    effective_bits: float | None = None  # or: mean storage bits per K/V element
    context: int | None = None  # sequence length of the budget
    scales: Sequence[str] = ()  # scale files of candidate formats (default: minmax on the samples)
    dataset: str | None = None
    num_samples: int = 16  # calibration text the per-layer damage is measured on
    seq_len: int = 512
    seed: int = 0
    heldout_windows: int = 16
    heldout_seq_len: int = 512
    data_dir: str | None = None
    frontier: bool = False
    frontier_step: float = 0.25
    refine: int = 0
    compare_uniform: bool = False
    output: str | os.PathLike[str] | None = None  # the plan file
    text_field: str | None = None
    dtype: str = "float32"
    device: str = "cpu"
    batch_size: int = 1
    # a damage file (ModelOpt auto_quantize's `checkpoint`): reused when it exists and was measured on the same
    # checkpoint, candidates, scales, calibration tokens and dtype (refused otherwise), written when not
    checkpoint: str | None = None


@dataclass(frozen=True)
class PlanSpec:
    """One `kvcal plan`, parsed and checked before the model loads (build it with `plan_spec`)."""

    model: str | LoadedModel
    candidates: list[str]  # canonical (parse_candidates)
    budget: Budget
    scale_files: dict[str, str]  # format -> its --scales file
    opts: ObserveOptions
    output: Path | None  # checked writable
    checkpoint: str | None
    saved: dict[str, Any] | None  # the damage file's record when it exists
    heldout_windows: int
    heldout_seq_len: int
    data_dir: str | None
    frontier: bool
    frontier_step: float
    refine: int
    compare_uniform: bool
    dtype: str
    device: str


def plan_spec(config: PlanConfig) -> PlanSpec:
    """Every model-free check, in this order: candidates, budget, steps and windows, output, sampling, scale
    files, the damage file, and (a model given by name) the device and whether its config reaches the budget."""
    c = config
    cands = parse_candidates(split_formats(c.candidates) if isinstance(c.candidates, str) else c.candidates)
    budget = parse_budget(c.capacity, c.effective_bits, c.context)
    if c.frontier and budget.kind != "capacity":
        raise UsageError("--frontier steps --capacity budgets; drop --effective-bits or --frontier")
    if c.frontier_step <= 0:
        raise UsageError(f"--frontier-step must be positive, got {c.frontier_step:g}")
    if c.refine < 0:
        raise UsageError(f"--refine must be a number of rounds >= 0, got {c.refine}")
    if c.heldout_windows < 1:
        raise UsageError(f"--heldout-windows must be at least 1, got {c.heldout_windows}")
    for flag, n in (("--seq-len", c.seq_len), ("--heldout-seq-len", c.heldout_seq_len)):
        if n < 2:  # the KL of the next-token distributions: one token attends only to itself
            raise UsageError(
                f"{flag} must be at least 2 tokens (damage is measured on the next tokens), got {n}"
            )
    out = check_output_path(c.output)
    opts = ObserveOptions.parse(
        dataset=c.dataset, text_field=c.text_field, num_samples=c.num_samples, seq_len=c.seq_len, seed=c.seed,
        batch_size=c.batch_size,
    )  # fmt: skip
    scale_files = _scale_files(list(c.scales or []), cands)
    saved = read_damage_file(c.checkpoint) if c.checkpoint is not None else None
    if not isinstance(c.model, LoadedModel):
        check_device(c.device)  # the budget needs the config only: refused before the load
        pre = kv_spec(load_config(resolve_real_name(c.model)))
        check_reachable(pre, cands, budget)
        if saved is not None and c.checkpoint is not None:
            check_damage_fits(c.checkpoint, saved, pre.num_layers, cands)
    return PlanSpec(
        model=c.model, candidates=cands, budget=budget, scale_files=scale_files, opts=opts, output=out,
        checkpoint=c.checkpoint, saved=saved, heldout_windows=c.heldout_windows,
        heldout_seq_len=c.heldout_seq_len, data_dir=c.data_dir, frontier=c.frontier,
        frontier_step=c.frontier_step, refine=c.refine, compare_uniform=c.compare_uniform, dtype=c.dtype,
        device=c.device,
    )  # fmt: skip


def run_plan(spec: PlanSpec, progress: ProgressFn | None = None) -> dict[str, Any]:
    """Everything `kvcal plan` does after its checks (see the module docstring): damage (measured or the damage
    file's), the solved plan, its refinement, frontier and uniform guard, the held-out measurements, and the
    plan file when the spec has an output."""
    cands, budget, opts = spec.candidates, spec.budget, spec.opts
    lm = loaded(spec.model, spec.dtype, spec.device, Placement())
    kv = kv_spec(lm.model.config)
    if (
        spec.saved is not None and spec.checkpoint is not None
    ):  # a model given loaded: checked here, before any forward
        check_damage_fits(spec.checkpoint, spec.saved, kv.num_layers, cands)
    costs, limit, _unit = integer_costs(kv, cands, budget)
    check_reachable(kv, cands, budget)
    binding = compute_binding(lm.ref, lm.model_dir, kv)
    data = opts.samples(lm, opts.texts())
    scale_sets, scale_record = _scales(lm, kv, cands, spec.scale_files, data.samples, progress, opts)
    damage = _damage(spec, lm, kv, scale_sets, damage_key(binding, cands, scale_record, data.manifest(), spec.dtype),
                     data.samples, progress)  # fmt: skip
    solver_damage, ties = damage.tie_broken(costs)
    layers = choose(solver_damage, costs, limit, cands)
    assert layers is not None  # check_reachable
    windows, source, warnings = load_heldout(lm, spec.data_dir, spec.heldout_windows, spec.heldout_seq_len)
    warnings = list(data.warnings) + warnings

    def joint(plans: list[list[str]], on: Sequence[torch.Tensor], phase: str) -> torch.Tensor:
        return per_sample_kl(
            lm.model, on, [plan_quant(p, scale_sets) for p in plans], opts.batch_size, progress, phase
        )

    rounds = []
    if spec.refine:
        measured = joint([layers], windows, "measure")
        layers, measured, rounds = _refine(
            layers, measured, damage, solver_damage, costs, limit, cands, data.samples, windows, joint
        )
    rows = _frontier(kv, cands, damage, budget, spec.frontier_step) if spec.frontier else []
    guards = uniform_guard(
        kv, cands, [budget] + [Budget("capacity", r["target"], budget.context) for r in rows],
        [layers] + [r["layers"] for r in rows], data.samples, joint,
    )  # fmt: skip
    if guards[0]["chosen"] != "plan" or not spec.refine:
        layers = guards[0]["layers"]
        measured = joint([layers], windows, "measure")
    _guard_rows(kv, rows, guards[1:], damage, budget)
    result: dict[str, Any] = {
        "model": lm.ref,
        "model_type": kv.model_type,
        "budget": budget.to_dict(),
        "candidates": cands,
        "scales": scale_record,
        "calibration": data.manifest(),
        "heldout": {"source": source, "windows": len(windows), "seq_len": spec.heldout_seq_len},
        "layers": layers,
        "capacity": plan_capacity(kv, layers, budget.context),
        "estimated_kl": estimated_kl(damage, layers),
        "measured": _measured(measured[:, :, 0]),
        "refine_rounds": rounds,
        "uniform_guard": {k: v for k, v in guards[0].items() if k != "layers"},
        "ties": ties,
        "damage": {"candidates": cands, "per_layer": damage.mean, "checkpoint": spec.checkpoint},
        "engines": engine_commands(lm.ref, layers, kv, str(spec.output or "plan.json")),
        "warnings": warnings,
    }
    if spec.frontier:
        if spec.compare_uniform:  # every Pareto plan measured jointly on the same held-out windows
            m = joint([row["layers"] for row in rows], windows, "frontier")  # [2, W, rows]
            for j, row in enumerate(rows):
                row["measured"] = _measured(m[:, :, j])
        result["frontier"] = rows
    if spec.compare_uniform:
        result["uniform"] = _uniform(kv, cands, budget, windows, measured[0, :, 0], joint)
    if spec.output is not None:
        _save_plan_file(spec.output, lm.ref, binding, kv, result)
    return result


def _damage(
    spec: PlanSpec,
    lm: LoadedModel,
    kv: KVSpec,
    scale_sets: Scales,
    key: dict[str, Any],
    samples: Sequence[torch.Tensor],
    progress: ProgressFn | None,
) -> Damage:
    """The damage file's damage when it was measured with `key`, else measured now (and written to the file)."""
    checkpoint, saved = spec.checkpoint, spec.saved
    damage = load_damage(checkpoint, saved, key) if checkpoint and saved else None
    if damage is None:
        damage = measure_damage(
            lm.model, samples, kv, spec.candidates, scale_sets, spec.opts.batch_size, progress
        )
        if checkpoint is not None:
            save_damage(checkpoint, key, damage)
    return damage


def _guard_rows(
    kv: KVSpec, rows: list[dict[str, Any]], guards: list[dict[str, Any]], damage: Damage, budget: Budget
) -> None:
    """In place: each frontier row takes its uniform guard's choice (and records the guard)."""
    for row, g in zip(rows, guards, strict=True):
        if g["chosen"] != "plan":
            row.update(
                layers=g["layers"],
                capacity=plan_capacity(kv, g["layers"], budget.context)["multiplier_vs_bf16"],
                estimated_kl=estimated_kl(damage, g["layers"]),
            )
        row["uniform_guard"] = {k: v for k, v in g.items() if k != "layers"}


def _save_plan_file(out: Path, ref: str, binding: dict[str, Any], kv: KVSpec, result: dict[str, Any]) -> None:
    """The plan file (kvcal.planfile) of `result`; `result` records where it went."""
    record = plan_record(
        ref, binding, kv, result["layers"], budget=result["budget"], candidates=result["candidates"],
        scales=result["scales"], capacity=result["capacity"], estimated_kl=result["estimated_kl"],
        measured=result["measured"], heldout=result["heldout"], calibration=result["calibration"],
        producer=f"kvcal {__version__}",
    )  # fmt: skip
    save_plan(out, record)
    result["plan_file"] = str(out)


def uniform_guard(
    kv: KVSpec,
    cands: list[str],
    budgets: Sequence[Budget],
    plans: Sequence[list[str]],
    samples: Sequence[torch.Tensor],
    joint: Any,
) -> list[dict[str, Any]]:
    """Module docstring, 5: per plan (with the budget it was solved for) the mean joint KL on the calibration samples
    of the plan and of every uniform configuration meeting that budget (`joint(variants, samples, phase)` ->
    [2, N, variants]: per_sample_kl), and the plan kept or the uniform configuration that loses less taken.
    -> per plan {"chosen": "plan" | configuration, "layers": the chosen layers, "calibration_kl": {name: KL}}."""
    configs = uniform_configurations(kv, cands)
    kl = joint([*plans, *configs.values()], samples, "uniform guard")[0].mean(dim=0).tolist()  # [P + C]
    plan_kl, config_kl = kl[: len(plans)], dict(zip(configs, kl[len(plans) :], strict=True))
    out = []
    for budget, layers, own in zip(budgets, plans, plan_kl, strict=True):
        meets = [name for name, cfg in configs.items() if meets_budget(kv, cfg, budget)]
        record = {"plan": own, **{name: config_kl[name] for name in meets}}
        best = min(meets, key=lambda name: config_kl[name], default=None)
        if best is not None and config_kl[best] < own:
            out.append({"chosen": best, "layers": list(configs[best]), "calibration_kl": record})
        else:
            out.append({"chosen": "plan", "layers": list(layers), "calibration_kl": record})
    return out


def _measured(t: torch.Tensor) -> dict[str, Any]:
    """t: [2, W] (KL, top-1 agreement per window) -> the KL interval and mean agreement."""
    return {"kl": interval(t[0].tolist()), "top1_agree": float(t[1].mean()), "kl_per_window": t[0].tolist()}


def _scale_files(scales: Sequence[str], cands: list[str]) -> dict[str, str]:
    """--scales files by the format they hold (each file's manifest), checked against the candidates."""
    from kvcal.scales import load_scale_file

    sides = {f.name for c in cands for f in kv_pair(c)}
    out: dict[str, str] = {}
    for path in scales:
        if not Path(path).is_file():
            raise UsageError(f"--scales '{path}' does not exist; calibrate it with `kvcal calibrate`")
        fmt = load_scale_file(path).kv_format
        if fmt not in sides:
            raise UsageError(f"--scales '{path}' holds {fmt} scales, which no candidate uses; drop it")
        if fmt in out:
            raise UsageError(f"--scales: two files for {fmt} ('{out[fmt]}', '{path}'); keep one")
        out[fmt] = path
    return out


def _scales(
    lm: LoadedModel,
    kv: KVSpec,
    cands: list[str],
    files: dict[str, str],
    samples: Sequence[torch.Tensor],
    progress: ProgressFn | None,
    opts: ObserveOptions,
) -> tuple[Scales, dict[str, Any]]:
    """Per calibratable side format: a scale file (checked against the checkpoint) or minmax on the samples."""
    out: Scales = {}
    record: dict[str, Any] = {}
    for name in sorted({f.name for c in cands for f in kv_pair(c)}):
        fmt = get_format(name)
        if not fmt.calibratable:
            continue
        # no file: minmax on the samples (plan's documented policy; sensitivity's own default is eval's 1.0)
        k, v, source = layer_scales(lm, kv, fmt, files.get(name, MINMAX), samples, progress, opts)
        out[name] = (k, v)
        record[name] = {"path": files[name], "sha256": file_sha256(files[name])} if name in files else source
    return out, record


def _refine(
    layers: list[str],
    measured: torch.Tensor,
    damage: Damage,
    solver_damage: list[list[float]],
    costs: list[list[int]],
    limit: int,
    cands: list[str],
    samples: Sequence[torch.Tensor],
    windows: Sequence[torch.Tensor],
    joint: Any,
    rounds: int = 3,
) -> tuple[list[str], torch.Tensor, list[dict[str, Any]]]:
    """See the module docstring, 4. Returns the best plan by held-out KL, its measurement, and the rounds."""
    corrected = [row[:] for row in solver_damage]
    best, best_m = layers, measured
    log: list[dict[str, Any]] = []
    for r in range(rounds):
        quantized = [i for i, f in enumerate(best) if f != SIXTEEN_BIT]
        variants = [best] + [[SIXTEEN_BIT if j == i else f for j, f in enumerate(best)] for i in quantized]
        kl = joint(variants, samples, f"refine {r + 1}")[0].mean(dim=0)  # [1 + len(quantized)]
        for n, i in enumerate(quantized, start=1):
            corrected[i][cands.index(best[i])] = max(float(kl[0] - kl[n]), 0.0)
        new = choose(corrected, costs, limit, cands)
        if new is None or new == best:
            log.append({"round": r + 1, "changed": False})
            break
        m = joint([new], windows, "measure")
        entry = {"round": r + 1, "changed": True, "measured_kl": float(m[0, :, 0].mean()), "layers": new}
        log.append(entry)
        if float(m[0, :, 0].mean()) >= float(best_m[0, :, 0].mean()):
            entry["kept"] = False
            break
        entry["kept"] = True
        best, best_m = new, m
    return best, best_m, log


def _frontier(
    kv: KVSpec, cands: list[str], damage: Damage, budget: Budget, step: float
) -> list[dict[str, Any]]:
    """Solve at 1.0x, 1.0x + step, ... up to the largest reachable capacity; Pareto rows (capacity, est. KL)."""
    rows: list[dict[str, Any]] = []
    target = 1.0
    while True:
        b = Budget("capacity", round(target, 6), budget.context)
        costs, limit, _ = integer_costs(kv, cands, b)
        solver_damage, _ties = damage.tie_broken(costs)
        layers = choose(solver_damage, costs, limit, cands)
        if layers is None:
            break
        cap = plan_capacity(kv, layers, budget.context)
        rows.append(
            {"target": b.value, "capacity": cap["multiplier_vs_bf16"], "estimated_kl": estimated_kl(damage, layers),
             "layers": layers}
        )  # fmt: skip
        target += step
    pareto = []
    for row in rows:
        dominated = any(
            o["capacity"] >= row["capacity"] and o["estimated_kl"] < row["estimated_kl"]
            for o in rows
            if o is not row
        )
        if not dominated and not any(p["layers"] == row["layers"] for p in pareto):
            pareto.append(row)
    return pareto


def _uniform(
    kv: KVSpec,
    cands: list[str],
    budget: Budget,
    windows: Sequence[torch.Tensor],
    plan_kl: torch.Tensor,
    joint: Any,
) -> list[dict[str, Any]]:
    """Every uniform configuration measured on the held-out windows, whether it meets the budget, and the paired
    per-window difference plan - uniform (negative: the plan loses less)."""
    configs = uniform_configurations(kv, cands)
    m = joint(list(configs.values()), windows, "uniform")  # [2, W, C]
    rows = []
    for j, (name, layers) in enumerate(configs.items()):
        rows.append(
            {
                "config": name,
                "capacity": plan_capacity(kv, layers, budget.context),
                "meets_budget": meets_budget(kv, layers, budget),
                "measured": _measured(m[:, :, j]),
                "plan_minus_uniform": interval((plan_kl - m[0, :, j]).tolist()),
            }
        )
    return rows
