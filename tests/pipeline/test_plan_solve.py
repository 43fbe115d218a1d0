"""`kvcal plan`'s solver and budget: the MILP's answer is brute force's on small random instances, and the budget is
met exactly as `kvcal capacity` counts bytes (sliding-window layers at min(context, window))."""

from __future__ import annotations

import itertools
import random

import pytest

from kvcal.capacity import kv_bytes_per_token
from kvcal.errors import UsageError
from kvcal.models.geometry import FULL, SLIDING, KVSpec, LayerSpec
from kvcal.pipeline.plan_cost import Budget, integer_costs, parse_budget, plan_bytes_per_token, plan_capacity
from kvcal.pipeline.plan_solve import solve


def _brute(damage: list[list[float]], cost: list[list[int]], budget: int) -> tuple[float, int] | None:
    """(least damage, least cost among the least-damage choices) over every choice, or None."""
    best: tuple[float, int] | None = None
    for choice in itertools.product(range(len(damage[0])), repeat=len(damage)):
        c = sum(cost[i][k] for i, k in enumerate(choice))
        if c > budget:
            continue
        d = sum(damage[i][k] for i, k in enumerate(choice))
        if best is None or d < best[0] - 1e-12 or (abs(d - best[0]) <= 1e-12 and c < best[1]):
            best = (d, c)
    return best


@pytest.mark.parametrize("seed", range(40))
def test_solver_equals_brute_force(seed: int) -> None:
    rng = random.Random(seed)
    n_layers, n_cand = rng.randint(1, 6), rng.randint(2, 3)
    ties = seed % 2 == 0  # half the instances: damages from a few values, so least-damage plans tie
    damage = [
        [rng.choice([0.0, 0.5, 1.0]) if ties else rng.random() for _ in range(n_cand)]
        for _ in range(n_layers)
    ]
    cost = [[rng.randint(1, 20) for _ in range(n_cand)] for _ in range(n_layers)]
    lo = sum(min(r) for r in cost)
    hi = sum(max(r) for r in cost)
    budget = rng.randint(lo - 3, hi)
    expected = _brute(damage, cost, budget)
    got = solve(damage, cost, budget)
    if expected is None:
        assert got is None
        return
    assert got is not None
    assert got.cost <= budget
    assert got.damage == pytest.approx(expected[0], abs=1e-9)
    assert got.cost == expected[1]  # ties go to the cheaper plan


def _gemma_like() -> KVSpec:
    """Gemma-3-270M's geometry: 18 layers, every 6th full, the rest sliding (window 512), 1 KV head, head_dim 256."""
    types = [FULL if (i + 1) % 6 == 0 else SLIDING for i in range(18)]
    layers = tuple(LayerSpec(i, t, 512 if t == SLIDING else None, 4, 1, 256) for i, t in enumerate(types))
    return KVSpec("gemma3_text", layers, 32768, "bfloat16")


CANDS = ["bf16", "fp8_e4m3", "nvfp4", "k=fp8_e4m3,v=nvfp4"]


@pytest.mark.parametrize("context", [4096, 32768, None])
def test_plan_bytes_are_kvcal_capacitys(context: int | None) -> None:
    kv = _gemma_like()
    sliding = frozenset(layer.index for layer in kv.layers if layer.type == SLIDING)
    for f in CANDS[1:]:
        assert plan_bytes_per_token(kv, [f] * 18, context) == pytest.approx(
            kv_bytes_per_token(kv, f, context=context), rel=1e-13
        )
        two_level = ["bf16" if i in sliding else f for i in range(18)]
        assert plan_bytes_per_token(kv, two_level, context) == pytest.approx(
            kv_bytes_per_token(kv, f, sliding, context), rel=1e-13
        )


@pytest.mark.parametrize("context", [4096, 32768])
@pytest.mark.parametrize("target", [2.0, 2.5, 3.0, 3.5])
def test_the_integer_budget_is_kvcal_capacitys_multiplier(context: int, target: float) -> None:
    """Every plan of random layer formats: summed integer cost <= the integer budget exactly when kvcal
    capacity's x BF16 of that plan is >= the target (uniform fp8 at 2.0x is exactly on the boundary)."""
    kv = _gemma_like()
    budget = Budget("capacity", target, context)
    costs, limit, _ = integer_costs(kv, CANDS, budget)
    rng = random.Random(int(target * 10) + context)
    plans = [[rng.randrange(len(CANDS)) for _ in range(18)] for _ in range(300)] + [[1] * 18, [2] * 18]
    for choice in plans:
        layers = [CANDS[k] for k in choice]
        mult = kv_bytes_per_token(kv, "bf16", context=context) / plan_bytes_per_token(kv, layers, context)
        fits = sum(costs[i][k] for i, k in enumerate(choice)) <= limit
        if abs(mult - target) > 1e-9:
            assert fits == (mult > target), (layers, mult)
        else:
            assert fits  # exactly at the target: meets it
    assert plan_capacity(kv, ["fp8_e4m3"] * 18, context)["multiplier_vs_bf16"] == pytest.approx(2.0)


def test_solved_plan_meets_the_budget_as_capacity_counts() -> None:
    kv = _gemma_like()
    rng = random.Random(3)
    damage = [[0.0] + [rng.random() for _ in CANDS[1:]] for _ in range(18)]
    for context in (4096, 32768):
        for target in (2.0, 2.5, 3.0, 3.5):
            costs, limit, _ = integer_costs(kv, CANDS, Budget("capacity", target, context))
            sol = solve(damage, costs, limit)
            assert sol is not None
            layers = [CANDS[k] for k in sol.choice]
            assert plan_capacity(kv, layers, context)["multiplier_vs_bf16"] >= target * (1 - 1e-12)


def test_effective_bits_budget_counts_bits_per_element() -> None:
    kv = _gemma_like()
    costs, limit, _ = integer_costs(kv, CANDS, Budget("effective_bits", 6.25, None))
    k_fp8_v_nvfp4 = [3] * 18  # (8 + 4.5) / 2 = 6.25 bits per element: exactly the budget
    assert sum(costs[i][k] for i, k in enumerate(k_fp8_v_nvfp4)) <= limit
    assert sum(costs[i][1] for i in range(18)) > limit  # fp8: 8 bits
    assert plan_capacity(kv, ["k=fp8_e4m3,v=nvfp4"] * 18, None)["bits_per_element"] == 6.25


@pytest.mark.parametrize(
    ("capacity", "bits", "match"),
    [
        ("0.5x", None, r"--capacity 0.5x: a plan holds at least BF16's tokens"),
        ("three", None, "--capacity must be a multiple"),
        (None, None, "give exactly one budget"),
        ("2x", 6.0, "give exactly one budget"),
        (None, 0.0, r"--effective-bits must be in \(0, 32\]"),
    ],
)
def test_bad_budgets(capacity: str | None, bits: float | None, match: str) -> None:
    with pytest.raises(UsageError, match=match):
        parse_budget(capacity, bits, None)
    assert parse_budget("3.0x", None, 4096) == Budget("capacity", 3.0, 4096)
