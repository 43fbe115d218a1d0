"""What a per-layer KV plan costs, counted exactly as `kvcal capacity` counts (kvcal.capacity.kv_bytes_per_token),
and the budget `kvcal plan` solves for.

Layer l in format pair (K, V) takes kv_heads x head_dim x (bits_K + bits_V) / 8 bytes per token, a sliding-window
layer weighted by min(context, window) / context when a context is given; `bf16` is 16 + 16 bits (what
--skip-layers counts). Two budgets:

- `--capacity Nx`: bytes/token <= BF16 bytes/token / N at the context (kvcal capacity's `xBF16` column >= N);
- `--effective-bits B`: mean storage bits per K/V element <= B (ModelOpt auto_quantize's `kv_effective_bits`,
  which has no context: every layer counts whole, as kvcal capacity's `bits` column does).

The solver needs exact integers (kvcal.pipeline.plan_solve): every cost is a Fraction (bits are dyadic, the
sliding share is min(C, w)/C) scaled by the common denominator.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from fractions import Fraction
from typing import Any

from kvcal.capacity import kv_bytes_per_token, layers_bytes_per_token, model_capacity
from kvcal.errors import UsageError
from kvcal.formats import TQ_BOUNDARY_LAYERS, kv_pair
from kvcal.models.geometry import SLIDING, KVSpec


def layer_bytes(kv: KVSpec, layer: int, fmt: str, context: int | None) -> float:
    """kvcal capacity's bytes per token of one layer in `fmt` (its own function on a one-layer spec)."""
    return kv_bytes_per_token(replace(kv, layers=(kv.layers[layer],)), fmt, context=context)


def plan_bytes_per_token(kv: KVSpec, layer_formats: list[str], context: int | None = None) -> float:
    """Bytes per token of a plan (one format or K/V pair per layer): kvcal capacity's own count of a plan."""
    return layers_bytes_per_token(kv, list(layer_formats), context)


def _exact_layer_bits(kv: KVSpec, layer: int, fmt: str, context: int | None) -> Fraction:
    """8 x layer_bytes as an exact Fraction (bits per token of the layer, sliding share included)."""
    spec = kv.layers[layer]
    fk, fv = kv_pair(fmt)
    bits = Fraction(fk.bits_per_element(spec.head_dim)) + Fraction(fv.bits_per_element(spec.head_dim))
    share = Fraction(1)
    if context is not None and spec.type == SLIDING and spec.window:
        share = Fraction(min(context, spec.window), context)
    return spec.kv_heads * spec.head_dim * bits * share


@dataclass(frozen=True)
class Budget:
    """A parsed budget: `kind` 'capacity' (value = N, x BF16 at `context`) or 'effective_bits' (value = B)."""

    kind: str
    value: float
    context: int | None = None

    def to_dict(self) -> dict[str, object]:
        return {"kind": self.kind, "value": self.value, "context": self.context}


def parse_budget(capacity: str | float | None, effective_bits: float | None, context: int | None) -> Budget:
    """--capacity 3.0x | 3 or --effective-bits B (exactly one); UsageError naming the flag otherwise."""
    if (capacity is None) == (effective_bits is None):
        raise UsageError("give exactly one budget: --capacity Nx (x BF16 tokens) or --effective-bits B")
    if context is not None and context < 1:
        raise UsageError(f"--context must be a positive number of tokens, got {context}")
    if effective_bits is not None:
        if not (0 < effective_bits <= 32) or not math.isfinite(effective_bits):
            raise UsageError(f"--effective-bits must be in (0, 32], got {effective_bits:g}")
        return Budget("effective_bits", float(effective_bits), None)
    text = str(capacity).strip().lower().removesuffix("x")
    try:
        n = float(text)
    except ValueError:
        raise UsageError(
            f"--capacity must be a multiple of BF16's tokens such as 3.0x, got '{capacity}'"
        ) from None
    if not math.isfinite(n) or n < 1.0:
        raise UsageError(
            f"--capacity {capacity}: a plan holds at least BF16's tokens (1.0x); ask for 1.0x or more, e.g. 3.0x"
        )
    return Budget("capacity", n, context)


def integer_costs(kv: KVSpec, candidates: list[str], budget: Budget) -> tuple[list[list[int]], int, Fraction]:
    """(cost[L][K] integers, the integer budget, the unit): cost x unit = bits per token (capacity) or bits per
    token of elements counted whole (effective bits); a plan meets the budget iff its summed cost <= the budget."""
    context = budget.context if budget.kind == "capacity" else None
    exact = [[_exact_layer_bits(kv, i, f, context) for f in candidates] for i in range(kv.num_layers)]
    if budget.kind == "capacity":
        bf16 = sum(_exact_layer_bits(kv, i, "bf16", context) for i in range(kv.num_layers))
        limit = bf16 / Fraction(budget.value)
    else:
        elements = sum(2 * layer.kv_heads * layer.head_dim for layer in kv.layers)
        limit = Fraction(budget.value) * elements
    denom = math.lcm(*(x.denominator for row in exact for x in row))
    unit = Fraction(1, denom)
    costs = [[int(x * denom) for x in row] for row in exact]
    return costs, math.floor(limit * denom), unit


def meets_budget(kv: KVSpec, layers: Sequence[str], budget: Budget) -> bool:
    """Whether a per-layer plan (a format per layer) meets `budget` by the solver's exact integer costs (the
    solver's own constraint): the test `check_reachable`, the uniform guard and the report's uniform rows apply
    (no float tolerance)."""
    formats = sorted(set(layers))
    costs, limit, _unit = integer_costs(kv, formats, budget)
    return sum(costs[i][formats.index(f)] for i, f in enumerate(layers)) <= limit


def check_reachable(kv: KVSpec, cands: list[str], budget: Budget) -> None:
    """UsageError naming the largest reachable capacity (or least bits) when no plan of `cands` meets `budget`."""
    costs, _limit, _unit = integer_costs(kv, cands, budget)
    layers = [cands[min(range(len(cands)), key=lambda k: row[k])] for row in costs]  # the cheapest per layer
    if meets_budget(kv, layers, budget):
        return
    cap = plan_capacity(kv, layers, budget.context)
    names = ", ".join(sorted(set(layers)))
    if budget.kind == "capacity":
        at = f" at context {budget.context}" if budget.context else ""
        raise UsageError(
            f"--capacity {budget.value:g}x is out of reach: the cheapest candidates ({names} on every layer) give "
            f"{math.floor(cap['multiplier_vs_bf16'] * 100) / 100:.2f}x{at}; ask for at most that or add a cheaper "
            "candidate"
        )
    raise UsageError(
        f"--effective-bits {budget.value:g} is out of reach: the cheapest candidates ({names}) take "
        f"{cap['bits_per_element']:.3g} bits per element; ask for at least that or add a cheaper candidate"
    )


def plan_capacity(kv: KVSpec, layer_formats: list[str], context: int | None) -> dict[str, float]:
    """kvcal capacity's numbers of a plan: bytes per token at `context`, x BF16 there, mean bits per element."""
    b = plan_bytes_per_token(kv, layer_formats, context)
    elems = sum(2 * layer.kv_heads * layer.head_dim for layer in kv.layers)
    return {
        "bytes_per_token": b,
        "multiplier_vs_bf16": kv_bytes_per_token(kv, "bf16", context=context) / b,
        "bits_per_element": 8 * plan_bytes_per_token(kv, layer_formats, None) / elems,
    }


def _plans_context(plans: list[Any], context: int | None) -> int | None:
    """--context, else the context the plans' budgets were solved at (one for all of them)."""
    if context is not None or not plans:
        return context
    found = {(p.record.get("budget") or {}).get("context") for p in plans}
    if len(found) > 1:
        shown = ", ".join(str(c) for c in sorted(found, key=str))
        raise UsageError(f"the plans' budgets are at different contexts ({shown}); pass --context")
    return found.pop()


def capacity_with_plans(
    model: str,
    formats: list[str] | None = None,
    skip_layers: str | None = None,
    context: int | None = None,
    gpu_mem_gib: float | None = None,
    weights_gib: float | None = None,
    tq_boundary: int = TQ_BOUNDARY_LAYERS,
    prefix_serde: str | None = None,
) -> dict[str, Any]:
    """`kvcal capacity`: kvcal.capacity.model_capacity, where a `formats` item ending in .json is a `kvcal plan`
    file (refused unless solved on this checkpoint): one row of its formats per layer, labelled by its budget
    (`plan@3.0x`), at --context or else at the context its budget was solved at."""
    from kvcal.models.real import resolve_real_name
    from kvcal.planfile import is_plan_path, load_plan_for_model

    paths = [f for f in formats or [] if is_plan_path(f)]
    names = [f for f in formats or [] if not is_plan_path(f)]
    if not paths:
        return model_capacity(
            model, formats, skip_layers, context, gpu_mem_gib, weights_gib, tq_boundary=tq_boundary,
            prefix_serde=prefix_serde,
        )  # fmt: skip
    if skip_layers:
        raise UsageError("--skip-layers does not apply to a plan file (its 16-bit layers are the plan's); drop one")
    from kvcal.scales import resolve_model_and_spec

    ref = resolve_real_name(model)
    model_dir, kv = resolve_model_and_spec(ref)
    plans = [load_plan_for_model(p, ref, model_dir, kv) for p in paths]
    rows = [(p.label, p.layers) for p in plans]
    table = model_capacity(
        model, names, None, _plans_context(plans, context), gpu_mem_gib, weights_gib, rows, tq_boundary,
        prefix_serde,
    )
    for row, p in zip(table["formats"][-len(plans) :], plans, strict=True):
        row.update(plan_file=str(p.path), layers=p.layers)
    return table
