"""The multiple-choice knapsack of `kvcal plan`: one candidate per layer, least summed damage under a cost budget.

Solved exactly with scipy.optimize.milp (HiGHS branch and bound), never greedily. Binary x[l, c] = layer l takes
candidate c; sum_c x[l, c] = 1 per layer; sum cost[l, c] x[l, c] <= budget. Costs and the budget are integers
(see kvcal.pipeline.plan_cost): a binary point's cost is then an integer, so HiGHS's feasibility tolerance cannot
let a plan over the budget through. Two stages, lexicographic: (1) least damage; (2) among plans within
`rel_tol` of that damage, least cost — ties go to the cheaper plan.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from scipy.optimize import Bounds, LinearConstraint, milp

from kvcal.errors import KvcalError


@dataclass(frozen=True)
class Solution:
    choice: tuple[int, ...]  # per layer: the index of its candidate
    damage: float  # summed damage of the choice
    cost: int  # summed cost of the choice


def solve(
    damage: Sequence[Sequence[float]],
    cost: Sequence[Sequence[int]],
    budget: int,
    rel_tol: float = 1e-9,
) -> Solution | None:
    """The least-damage choice of one candidate per layer with summed cost <= `budget`; None when none fits.

    damage, cost: [L][K] (every layer has the same K candidates); budget: an integer in cost's units."""
    d = np.asarray(damage, dtype=np.float64)  # [L, K]
    c = np.asarray(cost, dtype=np.int64)  # [L, K]
    n_layers, n_cand = d.shape
    if int(c.min(axis=1).sum()) > budget:
        return None
    one_each = np.kron(np.eye(n_layers), np.ones(n_cand))  # [L, L*K]: row l sums layer l's x
    constraints = [
        LinearConstraint(one_each, 1, 1),
        LinearConstraint(c.reshape(1, -1).astype(np.float64), -np.inf, float(budget)),
    ]
    integrality = np.ones(n_layers * n_cand)
    bounds = Bounds(0, 1)
    first = milp(d.reshape(-1), constraints=constraints, integrality=integrality, bounds=bounds)
    if first.status != 0:
        raise KvcalError(f"the plan solver (HiGHS) failed: {first.message}")
    best = float(first.fun)
    cap = best + rel_tol * max(abs(best), 1e-300) + 1e-15
    second = milp(
        c.reshape(-1).astype(np.float64),
        constraints=[*constraints, LinearConstraint(d.reshape(1, -1), -np.inf, cap)],
        integrality=integrality,
        bounds=bounds,
    )
    x = (second if second.status == 0 else first).x.reshape(n_layers, n_cand)
    choice = tuple(int(i) for i in np.argmax(x, axis=1))
    return Solution(
        choice=choice,
        damage=float(sum(d[layer, k] for layer, k in enumerate(choice))),
        cost=int(sum(c[layer, k] for layer, k in enumerate(choice))),
    )
