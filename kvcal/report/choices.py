"""The gold choice's log-probability of a multiple-choice sample: a continuous score where `acc` is 0 or 1.

lm-eval scores a multiple-choice question (`output_type: multiple_choice`) by the log-likelihood of each choice's
continuation (`filtered_resps`: [[loglikelihood, is_greedy], ...], one per choice); `acc` is whether the gold
choice has the largest. The log-probability of the gold choice among the choices,

    gold_logprob = ll[gold] - logsumexp(ll)      (nats, <= 0, higher is better)

is the quantity `acc` thresholds, so a cache that moves it moves `acc` only where it crosses a tie: per question
it changes by hundredths of a nat where `acc` changes by 0 or 1. On GPQA Diamond (198 questions) the engine's and
the emulation's FP8 damage to `acc` needs about 1,500 questions to be told apart from a margin; on gold_logprob
the same runs decide it (docs/studies/engine-gpqa-smollm2.md).

The gold index comes from the record: `target` as an index (lm-eval's doc_to_target of most multiple-choice
tasks), else the choice whose continuation equals `target` (the record's `arguments`), else a lettered target
"(A)" / "A" without arguments (GPQA's; kvcal's private GPQA records keep no arguments). Otherwise: none.
"""

from __future__ import annotations

import math
import re
from typing import Any

GOLD_LOGPROB = "gold_logprob"
_LETTER = re.compile(r"^\(?([A-Z])\)?$")


def _lls(resps: Any) -> list[float] | None:
    """The choices' log-likelihoods of `filtered_resps` ([ll, is_greedy] pairs; lm-eval's vllm output writes them
    as strings)."""
    if not isinstance(resps, list) or len(resps) < 2:
        return None
    out = []
    for x in resps:
        if not isinstance(x, (list, tuple)) or not x:
            return None
        try:
            out.append(float(x[0]))
        except (TypeError, ValueError):
            return None
    return out


def _continuations(args: Any) -> list[str] | None:
    """Each choice's continuation from lm-eval's `arguments` ({"gen_args_i": {"arg_0": context, "arg_1":
    continuation}} or [[context, continuation], ...])."""
    items = list(args.values()) if isinstance(args, dict) else args if isinstance(args, list) else None
    if not items:
        return None
    out = []
    for a in items:
        cont = a.get("arg_1") if isinstance(a, dict) else a[1] if isinstance(a, (list, tuple)) and len(a) > 1 else None
        if not isinstance(cont, str):
            return None
        out.append(cont)
    return out


def gold_index(rec: dict[str, Any], n_choices: int) -> int | None:
    """The gold choice's index in a multiple-choice record (module docstring), None when it cannot be told."""
    target = rec.get("target")
    if isinstance(target, bool):
        return None
    if isinstance(target, int) or (isinstance(target, str) and target.strip().isdigit()):
        i = int(target)
        return i if 0 <= i < n_choices else None
    if not isinstance(target, str):
        return None
    conts = _continuations(rec.get("arguments"))
    if conts is not None:
        hits = [i for i, c in enumerate(conts) if c.strip() == target.strip()]
        return hits[0] if len(hits) == 1 and len(conts) == n_choices else None
    m = _LETTER.match(target.strip())
    if m:
        i = ord(m.group(1)) - ord("A")
        return i if i < n_choices else None
    return None


def gold_logprob(rec: dict[str, Any]) -> float | None:
    """ll[gold] - logsumexp(ll) of a multiple-choice record (one scored with `acc`; NaN when a choice's
    log-likelihood is not finite), None otherwise."""
    metrics = rec.get("metrics")
    if not isinstance(metrics, list) or "acc" not in metrics:
        return None
    lls = _lls(rec.get("filtered_resps"))
    if lls is None:
        return None
    gold = gold_index(rec, len(lls))
    if gold is None:
        return None
    if not all(math.isfinite(x) for x in lls):  # an engine's non-finite log-likelihood: flagged, not dropped
        return math.nan
    top = max(lls)
    return lls[gold] - (top + math.log(sum(math.exp(x - top) for x in lls)))
