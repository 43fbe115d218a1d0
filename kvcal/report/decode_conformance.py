"""Engine vs emulation on generated outputs: does kvcal's emulation predict what the quantized cache does to the
engine's own greedy decode?

For a conformance pair with BF16 runs on both sides (kvcal.report.conformance.Pair) and an lm-eval generative task
(`generate_until`) all four runs generated, over the documents all four hold (their first filter's record, the
first repeat), each side is its quantized run against its own BF16 run:
- answer kept: the extracted answer (lm-eval's first filter) equals the BF16 run's; identical output text;
- tokens to the first divergence from the BF16 output (Kaplan-Meier median; an output that stopped where the
  other went on diverged at the next token, outputs the cap ended are censored: agreement.stopped_difference) and
  the divergence hazard (kvcal.report.agreement.summarize);
- output length change against the BF16 run (kvcal.report.length.paired_length_change).
Both sides are counted in one unit: text tokens (both texts re-encoded with the checkpoint's tokenizer,
kvcal.report.text_tokens) whenever a run of the four kept text only, as an engine's lm-eval folder does.

Then engine minus emulation, paired by document: the share of answers kept (Newcombe's interval, McNemar's exact
p: kvcal.report.stats.binary_difference), the length change in tokens (paired BCa bootstrap of the per-document
changes), and the two divergence-time distributions (log-rank test, statsmodels `survdiff`; it treats the two
sides as independent samples although their prompts are the same). These are differences, not a verdict: how
close is close enough for a decode behaviour is the user's call, and the key metrics' damage test
(kvcal.report.conformance) stays the verdict.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from kvcal.report import agreement, length, stats, text_tokens


@dataclass
class DecodeSide:
    """One side (engine or emulation): its quantized run against its BF16 run."""

    quantized: str
    bf16: str
    answer_kept: dict[str, float | None]  # share with its Wilson interval
    identical: dict[str, float | None]
    median_tokens: dict[str, float | None]  # Kaplan-Meier median tokens to the first divergence [95%]
    hazard_per_1k: dict[str, Any]
    length: dict[str, Any]  # kvcal.report.length.LengthChange as a dict


@dataclass
class DecodeComparison:
    task: str
    n: int  # documents all four runs generated
    unit: str  # text_tokens.GENERATED | text_tokens.TEXT
    engine: DecodeSide
    emulation: DecodeSide
    answer_kept_gap: dict[str, float | None]  # engine - emulation: value, lo, hi, p (McNemar)
    length_gap: dict[str, float | None]  # engine - emulation length change, tokens: value, lo, hi, p
    logrank_p: float | None  # the two sides' divergence times

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _side(
    q: tuple[str, Any, dict[str, dict[str, Any]]],
    b: tuple[str, Any, dict[str, dict[str, Any]]],
    docs: list[str],
    task: str,
    unit: str | None,
) -> tuple[DecodeSide, np.ndarray, dict[str, tuple[int, bool, int]], np.ndarray, str] | None:
    """(the side's figures, answer-kept flags [n], divergence times by doc, length changes [n], unit)."""
    (ql, qrun, qrecs), (bl, brun, brecs) = q, b
    times = agreement.divergence_times((brun, qrun), (brecs, qrecs), docs, task, unit)
    lengths = length.generated_lengths((brun, qrun), (brecs, qrecs), docs, unit)
    if times is None or lengths is None or len(times[0]) < 2 or len(lengths[0][0]) != len(docs):
        return None
    (tes, got_unit), ((bl_len, ql_len), _) = times, lengths
    kept = np.array([brecs[d].get("filtered_resps") == qrecs[d].get("filtered_resps") for d in docs], dtype=float)
    texts = [(text_tokens.texts(brecs[d]), text_tokens.texts(qrecs[d])) for d in docs]
    same = [x[0] == y[0] for x, y in texts if x and y]
    t, e, lens = zip(*tes.values(), strict=True)
    summary = agreement.summarize(list(t), list(e), at_lengths=[], task_lengths=list(lens))
    change = length.paired_length_change(bl_len, ql_len, config=ql, task=task, baseline=bl)
    side = DecodeSide(
        quantized=ql, bf16=bl, answer_kept=agreement.proportion(int(kept.sum()), len(docs)),
        identical=agreement.proportion(sum(same), len(same)), median_tokens=summary["km"]["median"],
        hazard_per_1k=summary["hazard_per_1k"], length=change.to_dict(),
    )  # fmt: skip
    return side, kept, tes, np.asarray(ql_len) - np.asarray(bl_len), got_unit


def _logrank(eng: dict[str, tuple[int, bool, int]], emu: dict[str, tuple[int, bool, int]]) -> float | None:
    from statsmodels.duration.survfunc import survdiff

    times = [v[0] for v in eng.values()] + [v[0] for v in emu.values()]
    events = [int(v[1]) for v in eng.values()] + [int(v[1]) for v in emu.values()]
    if not any(events):
        return None
    group = [0] * len(eng) + [1] * len(emu)
    _, p = survdiff(np.asarray(times, float), np.asarray(events), np.asarray(group))
    return float(p) if math.isfinite(p) else None


def compare_decode(runs: dict[str, Any], labels: dict[str, str], task: str) -> DecodeComparison | None:
    """The decode comparison of one task. `runs` / `labels`: 'engine', 'engine_bf16', 'emulation',
    'emulation_bf16' -> the run that generated `task` / its configuration's label. None when a run did not
    generate the task, fewer than two documents are common to all four, or no tokenizer gives a unit."""
    if any(length.output_type(r, task) != length.GENERATE for r in runs.values()):
        return None
    recs = {k: agreement.first_filter_records(r, task) for k, r in runs.items()}
    docs = sorted(set.intersection(*(set(r) for r in recs.values())), key=lambda d: (len(d), d))
    if len(docs) < 2:
        return None
    sides: dict[str, Any] = {}
    unit: str | None = None
    for name in ("engine", "emulation"):
        q, b = name, f"{name}_bf16"
        got = _side((labels[q], runs[q], recs[q]), (labels[b], runs[b], recs[b]), docs, task, unit)
        if got is None:
            return None
        sides[name] = got
        unit = got[4]
    if sides["engine"][4] != sides["emulation"][4]:  # the engine side had ids, the emulation's text only: redo
        got = _side(*[(labels[k], runs[k], recs[k]) for k in ("engine", "engine_bf16")], docs, task, text_tokens.TEXT)
        if got is None:
            return None
        sides["engine"] = got
    (eng, ekept, etimes, elen, unit), (emu, mkept, mtimes, mlen, _) = sides["engine"], sides["emulation"]
    kept_test, _, _ = stats.binary_difference(mkept, ekept)
    len_test = stats.bca_difference(mlen, elen)
    return DecodeComparison(
        task=task, n=len(docs), unit=unit, engine=eng, emulation=emu,
        answer_kept_gap={"value": float(ekept.mean() - mkept.mean()), "lo": kept_test.ci_low,
                         "hi": kept_test.ci_high, "p": kept_test.p_value},
        length_gap={"value": float(elen.mean() - mlen.mean()), "lo": len_test.ci_low, "hi": len_test.ci_high,
                    "p": len_test.p_value},
        logrank_p=_logrank(etimes, mtimes),
    )  # fmt: skip
