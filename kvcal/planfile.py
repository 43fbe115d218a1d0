"""The plan file `kvcal plan` writes: JSON, one KV format per layer (K and V sides), bound to its checkpoint like
a scale file (kvcal.scales.compute_binding: hashes of config, tokenizer, weights, and the KV geometry) and
refused on another one.

{"kvcal_plan": 1, "model", "binding", "budget": {"kind", "value", "context"}, "candidates": [...],
 "layers": [{"layer", "type", "kv_format", "k", "v"}], "scales": {format: {"path", "sha256"} | "minmax ..."},
 "capacity": {...}, "estimated_kl", "measured": {...}}
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvcal.errors import KvcalError, UsageError
from kvcal.filecache import sha256_file
from kvcal.formats import kv_pair
from kvcal.io import atomic_write_json
from kvcal.models.geometry import KVSpec
from kvcal.scales import bound_differences

PLAN_VERSION = 1


@dataclass(frozen=True)
class PlanFile:
    """A loaded plan: `layers` holds the canonical format (or `k=A,v=B` pair) of every layer; `record` the JSON."""

    path: Path
    layers: list[str]
    record: dict[str, Any]

    @property
    def model(self) -> str:
        return str(self.record["model"])

    @property
    def label(self) -> str:
        return plan_label(self.record)

    def run_record(self) -> dict[str, Any]:
        """What a run of this plan records (config.yaml's `plan`): its label and budget decide what was measured
        (with the format and 16-bit layers the run records anyway); its path and sha256 say which file it was."""
        return {
            "label": self.label,
            "budget": self.record.get("budget"),
            "path": str(self.path.resolve()),
            "sha256": sha256_file(self.path),
        }


def is_plan_path(value: object) -> bool:
    """A --kv-format value naming a plan file (`-f plan.json`) rather than a format."""
    return str(value).strip().lower().endswith(".json")


def _number(value: float) -> str:
    """3 -> '3.0', 2.75 -> '2.75': a budget as people write it."""
    return f"{value:.1f}" if float(value) * 10 == round(float(value) * 10) else f"{value:g}"


def plan_label(record: dict[str, Any]) -> str:
    """A plan's name among configurations, from its budget: `plan@3.0x`, `plan@3.0x/ctx4096` (a capacity at a
    context), `plan@5.5bits` (an effective-bits budget); `plan` for a plan file without one."""
    budget = record.get("budget")
    if not isinstance(budget, dict) or not isinstance(budget.get("value"), (int, float)):
        return "plan"
    if budget.get("kind") == "effective_bits":
        return f"plan@{_number(budget['value'])}bits"
    context = budget.get("context")
    return f"plan@{_number(budget['value'])}x" + (f"/ctx{context}" if context else "")


def plan_record(
    model: str,
    binding: dict[str, Any],
    kv: KVSpec,
    layers: list[str],
    **fields: Any,
) -> dict[str, Any]:
    """The JSON of a plan; `fields`: budget, candidates, scales, capacity, estimated_kl, measured, ..."""
    rows = []
    for i, f in enumerate(layers):
        k, v = kv_pair(f)
        rows.append({"layer": i, "type": kv.layers[i].type, "kv_format": f, "k": k.name, "v": v.name})
    return {"kvcal_plan": PLAN_VERSION, "model": model, "binding": binding, "layers": rows, **fields}


def save_plan(path: str | os.PathLike[str], record: dict[str, Any]) -> Path:
    out = Path(path)
    try:
        atomic_write_json(out, record)
    except OSError as exc:
        raise KvcalError(f"cannot write '{out}': {exc.strerror or exc}; choose another -o path") from None
    return out


def load_plan(path: str | os.PathLike[str]) -> PlanFile:
    """Read and check a plan file's shape (UsageError naming what is wrong); no checkpoint needed."""
    p = Path(path)
    if not p.is_file():
        raise UsageError(f"plan file '{p}' does not exist; write one with `kvcal plan MODEL ... -o {p.name}`")
    try:
        record = json.loads(p.read_text())
    except (OSError, ValueError) as exc:
        raise UsageError(f"plan file '{p}' is not JSON ({exc}); write it with `kvcal plan`") from None
    if not isinstance(record, dict) or record.get("kvcal_plan") != PLAN_VERSION:
        raise UsageError(
            f"'{p}' is not a kvcal plan file (version {PLAN_VERSION}); write it with `kvcal plan`"
        )
    try:
        rows = sorted(record["layers"], key=lambda r: int(r["layer"]))
        if [int(r["layer"]) for r in rows] != list(range(len(rows))):
            raise ValueError("layer indices are not 0..L-1")
        layers = []
        for r in rows:
            k, v = kv_pair(f"k={r['k']},v={r['v']}")
            layers.append(k.name if k is v else f"k={k.name},v={v.name}")
        n = record["binding"]["num_layers"]
        if isinstance(n, bool) or not isinstance(n, int) or n != len(layers):
            raise ValueError(f"{len(layers)} layers listed for a model of {n!r} (binding.num_layers)")
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise UsageError(f"plan file '{p}' is malformed ({exc}); write it again with `kvcal plan`") from None
    return PlanFile(path=p, layers=layers, record=record)


def load_plan_for_model(
    path: str | os.PathLike[str], model_ref: str, model_dir: str | os.PathLike[str], kv: KVSpec
) -> PlanFile:
    """`load_plan`, then refused (KvcalError naming what changed) unless it was solved on this checkpoint."""
    plan = load_plan(path)
    if len(plan.layers) != kv.num_layers:
        raise KvcalError(
            f"plan file '{plan.path}' has {len(plan.layers)} layers but model '{model_ref}' has {kv.num_layers}; "
            "run `kvcal plan` on this model"
        )
    diffs = bound_differences(plan.record["binding"], model_ref, model_dir, kv)
    if diffs:
        raise KvcalError(
            f"plan file '{plan.path}' was solved for another checkpoint ({plan.model}): {'; '.join(diffs)}; "
            "run `kvcal plan` on this checkpoint"
        )
    return plan


def one_format_plus_16_bit(plan: PlanFile) -> tuple[str, str | None]:
    """(kv_format, skip_layers) of a plan that is one format plus 16-bit layers — what kvcal's quantized cache and
    `--skip-layers` run; UsageError naming the formats otherwise."""
    quantized = sorted({f for f in plan.layers if f != "bf16"})
    if len(quantized) != 1:
        raise UsageError(
            f"plan file '{plan.path}' uses {len(quantized)} quantized formats ({', '.join(quantized) or 'none'}); "
            "kvcal's quantized cache runs one format per model plus 16-bit layers, so evaluate such a plan by "
            "its joint KL (`kvcal plan --compare-uniform`), or re-plan with one quantized candidate and bf16"
        )
    skipped = [i for i, f in enumerate(plan.layers) if f == "bf16"]
    return quantized[0], ",".join(map(str, skipped)) or None
