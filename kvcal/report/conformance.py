"""Engine vs emulation: does an engine's quantized cache do the damage kvcal's emulation of it does?

Two correct implementations (other kernels, other rounding) always differ at a large enough sample, even at BF16,
so the question is not "is there a difference" but whether the QUANTIZATION'S DAMAGE matches: per paired sample i,

    d_i = (engine_q,i - engine_bf16,i) - (emu_q,i - emu_bf16,i)

in the key metric's per-sample unit (kvcal.report.metrics.arrays: num / den, e.g. wikitext's negative
log-likelihood per word, nats; an accuracy's 0/1; kl's nats), from four runs: the engine's quantized run and its
own BF16 run (kv_cache_dtype auto), kvcal's emulation of the configuration and kvcal's BF16 run. The test is an
equivalence test, TOST (statsmodels.stats.weightstats.ttost_paired), of mean d within [-margin, +margin] at alpha.

The margin (unless `--margin`): the mean over the paired samples of |engine_bf16,i - emu_bf16,i|, the BF16 pair's
own per-sample disagreement. It bounds how far apart the two implementations' means can be at BF16
(|mean r| <= mean |r|): a damage gap inside it is no larger than what two correct implementations already show
without any quantization. It does not shrink with the sample size. A pair whose BF16 runs agree on every sample has
margin 0: nothing can be shown equivalent to it, and `--margin` must say what is close enough.

That margin is the BF16 disagreement, but a quantized cache amplifies a disagreement (a value near a code boundary
flips its code, which moves later K/V across other boundaries: docs/engines.md measured engine and emulation
4.6e-06 nats per token apart at 16 bits and 0.041 with FP8, the emulation 0.045 from itself with its weights moved
by 2**-22). `--conformance-noise Q=B` names two runs of the emulation with its weights perturbed (`kvcal eval
--perturb-weights ULPS`, kvcal.models.perturb: the same model as another correct implementation computes it), the
quantized configuration and BF16; the margin is then the mean over the paired samples of
|(pert_q,i - pert_bf16,i) - (emu_q,i - emu_bf16,i)|: how far the quantization's damage moves between two correct
implementations, the same statistic d measures between engine and emulation. The report states its source and the
perturbed pair's own BF16 disagreement beside the engine's, so a reader sees whether the perturbation is of the
engine's size.

Per key metric: "equivalent" (TOST p < alpha: the 1 - 2 alpha interval of mean d inside the margin); "not
equivalent" (the interval entirely beyond the margin: the one-sided t test of |mean d| > margin, Holm over the
pair's key metrics); else "not shown at this sample size", with the paired samples that would show it: the n at
which each one-sided test of TOST has power 0.9 at the measured mean and spread (statsmodels TTestPower; TOST's
power is then at least 0.8), or, with a measured gap beyond the margin, the n that shows "not equivalent" with
power 0.8. A pair is equivalent when every key metric is (an intersection-union test: no correction), not
equivalent when one is. Without a BF16 run on both sides there is no verdict: the report says which run is missing,
and the gate fails on it unless --allow-unjudged (a gate never passes what it could not judge).

Like with like: the four runs pair only when what decides their numbers besides the cache agrees — model dtype,
log-prob dtype (kvcal: --logprob-dtype; engines compute log-probs in float32), max length (lm-eval's rolling
window; an engine's max_model_len), few-shot, chat template, generation kwargs, repeats, limit and task version.
Otherwise `check_like_with_like` raises one UsageError naming every difference and the flag that fixes it.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from kvcal.errors import UsageError
from kvcal.kvconfig import KVConfig
from kvcal.report.choices import GOLD_LOGPROB
from kvcal.report.compare import Comparison, Configuration, Warn
from kvcal.report.lmeval_runs import (
    LOGLIKELIHOOD_TYPES,
    parse_model_args,
    same_documents,
    task_limit,
    task_settings,
)
from kvcal.report.metrics import MetricSpec, arrays, conformance_specs
from kvcal.report.runs import Run

# lm-eval backends that are serving engines (kvcal.report.lmeval_runs records the backend)
ENGINE_BACKENDS = frozenset({"vllm", "sglang", "local-completions", "local-chat-completions", "openai-completions"})
BF16_FORMATS = ("auto", "bf16")
# where a pair's margin comes from, as the report names it
MARGIN_SOURCES = {"bf16 pair": "the BF16 pair", "perturbed emulation": "the perturbed emulation",
                  "--margin": "--margin"}  # fmt: skip
EQUIVALENT, NOT_EQUIVALENT, NOT_SHOWN = "equivalent", "not equivalent", "not shown at this sample size"
TOST_POWER = 0.9  # per one-sided test of TOST: the pair's power is then at least 1 - 2 x 0.1 = 0.8
SHOW_POWER = 0.8


@dataclass
class DamageResult:
    """One key metric of a pair: the damage of each side (quantized minus BF16, means over the paired samples,
    in the metric's per-sample unit), their gap (engine minus emulation) with its 1 - 2 alpha interval, the
    margin, the TOST and the beyond-margin p-values, the verdict and the samples that would decide it."""

    task: str
    metric: str
    n: int
    unit: str
    engine_damage: float
    emulation_damage: float
    gap: float
    ci_low: float
    ci_high: float
    margin: float
    margin_source: str  # MARGIN_SOURCES: "bf16 pair" | "perturbed emulation" | "--margin"
    bf16_gap: float  # mean (engine_bf16 - emu_bf16): the two implementations' own difference at BF16
    bf16_spread: float = math.nan  # mean |engine_bf16 - emu_bf16|
    noise_bf16_spread: float | None = None  # mean |pert_bf16 - emu_bf16| (--conformance-noise)
    gap_spread: float = math.nan  # mean |d|: the engine's per-sample damage gap, beside a perturbed margin
    p_equivalence: float | None = None  # TOST: the larger of its two one-sided p-values
    p_beyond: float | None = None  # one-sided: |mean d| > margin (Holm-adjusted over the pair's key metrics)
    verdict: str = NOT_SHOWN
    n_needed: int | None = None  # paired samples that would decide it (not shown only)
    note: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}


@dataclass
class ConformanceResult:
    engine: str
    emulation: str
    claimed: str  # 'fp8_e4m3, scales calib-tensor, skip none'
    engine_bf16: str | None = None
    emulation_bf16: str | None = None
    results: list[DamageResult] = field(default_factory=list)  # key metrics
    agreement: dict[str, float] = field(default_factory=dict)  # 'task/metric' -> share of quantized samples equal
    conforms: bool | None = None  # True equivalent, False not equivalent, None not judged / not shown
    verdict: str = ""
    missing: list[str] = field(default_factory=list)  # what a verdict needs and is not there
    nonfinite: list[str] = field(default_factory=list)  # runs that scored samples NaN / inf: no verdict
    # generative tasks: each side's decode against its own BF16 (kvcal.report.decode_conformance), shown
    decode: list[Any] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {
            "engine": self.engine, "emulation": self.emulation, "engine_bf16": self.engine_bf16,
            "emulation_bf16": self.emulation_bf16, "claimed": self.claimed, "conforms": self.conforms,
            "verdict": self.verdict, "missing": self.missing, "nonfinite": self.nonfinite,
            "agreement": self.agreement,
            "results": [r.to_dict() for r in self.results], "decode": [d.to_dict() for d in self.decode],
        }  # fmt: skip


@dataclass(frozen=True)
class Pair:
    engine: Configuration
    emulation: Configuration
    engine_bf16: Configuration | None
    emulation_bf16: Configuration | None
    noise_q: Configuration | None = None  # --conformance-noise: the emulation with its weights perturbed
    noise_bf16: Configuration | None = None  # and its BF16 run, perturbed alike

    @property
    def configs(self) -> list[Configuration]:
        return [c for c in (self.engine, self.emulation, self.engine_bf16, self.emulation_bf16, self.noise_q,
                            self.noise_bf16) if c is not None]  # fmt: skip


# ---- which runs --------------------------------------------------------------------------------------------


def _backend(c: Configuration) -> str:
    """The lm-eval backend of a configuration's runs; kvcal's run directories are `kvcal`."""
    return str((c.runs[0].config.extra.get("lm_eval") or {}).get("backend") or "kvcal")


def _claim(c: Configuration) -> KVConfig:
    """What a run claims to be: its format, scales and 16-bit layers (an engine's lm-eval run records no plan)."""
    return c.key.without_plan()


def _describe(c: Configuration) -> str:
    return f"{c.kv_format}, scales {c.scales}, skip {c.skip}"


def is_bf16(c: Configuration) -> bool:
    return c.kv_format in BF16_FORMATS


def perturbation(c: Configuration) -> float | None:
    """The ulps its weights were perturbed by (kvcal eval --perturb-weights), None for the model as loaded."""
    return c.runs[0].config.perturb_weights


def _pair_labels(item: str, by_label: dict[str, Configuration], flag: str, what: str) -> tuple[str, str]:
    eng, eq, emu = str(item).partition("=")
    if not eq or eng not in by_label or emu not in by_label or eng == emu:
        raise UsageError(f"{flag} {item!r}: write {what} with two of the labels here ({', '.join(by_label)})")
    return eng, emu


def _bf16_of(side: Configuration, configs: list[Configuration], taken: set[str]) -> Configuration | None:
    """The one BF16 run of `side`'s backend here (None: none, or several to choose from)."""
    found = [c for c in configs if is_bf16(c) and c.label not in taken and _backend(c) == _backend(side)
             and perturbation(c) is None]  # fmt: skip
    return found[0] if len(found) == 1 else None


def find_pairs(
    configs: list[Configuration],
    named: Iterable[str] | None,
    references: Iterable[str] | None = None,
    noise: Iterable[str] | None = None,
) -> list[Pair]:
    """(engine, emulation, engine BF16, emulation BF16) quadruples. Pairs: those named `ENGINE=EMULATION`
    (labels), else every quantized engine run with the one kvcal run of the same claimed configuration (kv
    format, scales, skip layers). BF16 runs: named `ENGINE_BF16=EMULATION_BF16` (`--conformance-bf16`: one for
    every pair, or one per pair in order), else the one BF16 (auto / bf16) run of each side's lm-eval backend
    when the two sides' backends differ; None when not found (the pair then says what is missing). `noise`:
    `PERTURBED_Q=PERTURBED_BF16` (`--conformance-noise`, once for every pair or once per pair in order): the
    emulation's runs with perturbed weights whose damage scatter is the margin (with_noise)."""
    by_label = {c.label: c for c in configs}
    named, refs = list(named or []), list(references or [])
    quads: list[tuple[Configuration, Configuration]] = []
    for item in named:
        eng, emu = _pair_labels(item, by_label, "--conformance", "ENGINE=EMULATION")
        quads.append((by_label[eng], by_label[emu]))
    if not named:
        for eng in configs:
            if _backend(eng) not in ENGINE_BACKENDS or is_bf16(eng):
                continue
            emus = [c for c in configs if c is not eng and _backend(c) not in ENGINE_BACKENDS
                    and _claim(c) == _claim(eng) and perturbation(c) is None]  # fmt: skip
            if len(emus) == 1:
                quads.append((eng, emus[0]))
    if refs and len(refs) not in (1, len(quads)):
        raise UsageError(
            f"--conformance-bf16 given {len(refs)} times for {len(quads)} pairs: give it once (every pair) or "
            "once per --conformance, in the same order"
        )
    out = []
    for i, (eng, emu) in enumerate(quads):
        for c in (eng, emu):
            if is_bf16(c):
                raise UsageError(
                    f"--conformance: {c.label} is a BF16 run ({c.kv_format}); conformance tests a quantized "
                    "configuration's damage against its BF16 run: name the quantized runs, and their BF16 runs "
                    "with --conformance-bf16 ENGINE_BF16=EMULATION_BF16"
                )
        if refs:
            e16, m16 = _pair_labels(refs[0 if len(refs) == 1 else i], by_label, "--conformance-bf16",
                                    "ENGINE_BF16=EMULATION_BF16")  # fmt: skip
            for lab in (e16, m16):
                if not is_bf16(by_label[lab]):
                    raise UsageError(
                        f"--conformance-bf16: {lab} is not a BF16 run (kv format {by_label[lab].kv_format}); name "
                        "the engine's kv_cache_dtype=auto run and kvcal's --kv-format bf16 (or auto) run"
                    )
            out.append(Pair(eng, emu, by_label[e16], by_label[m16]))
            continue
        taken = {eng.label, emu.label}
        distinct = _backend(eng) != _backend(emu)
        e16 = _bf16_of(eng, configs, taken) if distinct else None
        m16 = _bf16_of(emu, configs, taken) if distinct else None
        out.append(Pair(eng, emu, e16, m16))
    return with_noise(out, by_label, list(noise or []))


def with_noise(pairs: list[Pair], by_label: dict[str, Configuration], noise: list[str]) -> list[Pair]:
    """The pairs with their `--conformance-noise` runs: a kvcal run of the emulated configuration and a BF16 one,
    both with perturbed weights; UsageError naming what is wrong otherwise."""
    if not noise:
        return pairs
    if len(noise) not in (1, len(pairs)):
        raise UsageError(
            f"--conformance-noise given {len(noise)} times for {len(pairs)} pairs: give it once (every pair) or once "
            "per --conformance, in the same order"
        )
    out = []
    for i, p in enumerate(pairs):
        q, b = _pair_labels(noise[0 if len(noise) == 1 else i], by_label, "--conformance-noise",
                            "PERTURBED_Q=PERTURBED_BF16")  # fmt: skip
        nq, nb = by_label[q], by_label[b]
        for c, want in ((nq, "the emulated configuration"), (nb, "BF16")):
            if perturbation(c) is None:
                raise UsageError(
                    f"--conformance-noise: {c.label} is not a perturbed run; make it with kvcal eval "
                    f"--perturb-weights 1 and {p.emulation.label}'s settings ({want})"
                )
        if is_bf16(nq) or not is_bf16(nb):
            raise UsageError(
                f"--conformance-noise {q}={b}: name the perturbed quantized run first and the perturbed BF16 run "
                f"second (kv formats {nq.kv_format}, {nb.kv_format})"
            )
        if _claim(nq) != _claim(p.emulation):
            raise UsageError(
                f"--conformance-noise: {q} is {_describe(nq)}, but {p.emulation.label} emulates "
                f"{_describe(p.emulation)}: perturb the same configuration"
            )
        if perturbation(nq) != perturbation(nb):
            raise UsageError(
                f"--conformance-noise: {q} is perturbed by {perturbation(nq):g} ulps, {b} by {perturbation(nb):g}: "
                "perturb both alike (the same --perturb-weights and --seed)"
            )
        out.append(dataclasses.replace(p, noise_q=nq, noise_bf16=nb))
    return out


# ---- like with like ----------------------------------------------------------------------------------------

_DTYPE_NAMES = {
    "bf16": "bfloat16", "bfloat16": "bfloat16", "torch.bfloat16": "bfloat16",
    "float32": "float32", "fp32": "float32", "float": "float32", "torch.float32": "float32",
    "float16": "float16", "fp16": "float16", "half": "float16", "torch.float16": "float16",
}  # fmt: skip
# How a difference is fixed, by setting (kvcal eval's flag / lm_eval's)
FIXES = {
    "model dtype": "serve and emulate one dtype: kvcal eval --dtype D, lm_eval --model_args dtype=D (an engine's "
    "'auto' is not recorded: pass it explicitly)",
    "log-prob dtype": "kvcal eval --logprob-dtype float32 (engines compute log-probs in float32); lm_eval --model hf "
    "--model_args softmax_dtype=float32",
    "max length": "kvcal eval --max-length N, lm_eval --model_args max_length=N (vLLM: max_model_len=N)",
    "few-shot": "the same --num-fewshot N on both (lm_eval --num_fewshot N)",
    "chat template": "lm_eval --apply_chat_template on every run or on none (kvcal eval applies none)",
    "system instruction": "the same lm_eval --system_instruction on every run, or none",
    "few-shot as multi-turn": "lm_eval --fewshot_as_multiturn on every run or on none (kvcal eval: none)",
    "generation kwargs": "the same kvcal eval --gen-kwargs / --max-gen-toks and lm_eval --gen_kwargs",
    "repeats": "the same kvcal eval --repeats (lm-eval task repeats)",
    "limit": "the same --limit N on every run (lm_eval --limit N)",
    "task version": "one lm-eval release for every run (its task versions differ)",
    "scoring": "the same kvcal eval --scoring on kvcal's runs",
}


def _canonical_dtype(value: Any) -> str | None:
    text = str(value or "").strip().lower()
    return _DTYPE_NAMES.get(text, text or None)


def _is_lm_eval(run: Run) -> bool:
    return "lm_eval" in run.config.extra


def _run_backend(run: Run) -> str:
    return str((run.config.extra.get("lm_eval") or {}).get("backend") or "kvcal")


def _model_args(run: Run) -> dict[str, Any]:
    cfg = run.results.get("config")
    return parse_model_args(cfg.get("model_args")) if isinstance(cfg, dict) and _is_lm_eval(run) else {}


def model_dtype(run: Run) -> str | None:
    """The dtype the model ran in: a kvcal run directory's (recorded resolved), an lm-eval run's model_args
    dtype; 'auto' of HFLM (hf, kvcal) resolved against the checkpoint when it is here; None when not known
    (an engine's 'auto')."""
    dtype = _canonical_dtype(run.config.dtype) or "auto"
    if dtype != "auto":
        return dtype
    if _run_backend(run) in ("hf", "kvcal") and run.config.model_dir and Path(run.config.model_dir).is_dir():
        from kvcal.models.loading import resolve_dtype

        try:
            return resolve_dtype("auto", Path(run.config.model_dir))
        except Exception:  # noqa: BLE001 — an unreadable checkpoint: not known
            return None
    return None


def logprob_dtype(run: Run) -> str | None:
    """The dtype of the run's log-softmax and sums: kvcal's run directories record it (RunConfig); engines
    compute log-probs in float32 (vLLM's sampler, SGLang's logits processor); lm-eval's HFLM in softmax_dtype,
    else the model's dtype; kvcal's lm-eval model in float32 unless logprob_dtype=model (or softmax_dtype)."""
    if not _is_lm_eval(run):
        return _canonical_dtype(run.config.logprob_dtype_used)
    backend, args = _run_backend(run), _model_args(run)
    if backend in ENGINE_BACKENDS or backend in ("vllm", "sglang"):
        return "float32"
    if args.get("softmax_dtype"):
        return _canonical_dtype(args["softmax_dtype"])
    if backend == "kvcal" and str(args.get("logprob_dtype") or "float32") == "float32":
        return "float32"
    return model_dtype(run)


def max_length(run: Run) -> int | None:
    """The window the run's model had: lm-eval's results record it (`max_length`, add_tokenizer_info; kvcal's
    results.json too), else model_args max_length / max_model_len or config.yaml's --max-length, else (a kvcal
    run directory of before the record) lm-eval's default from the checkpoint's config; None when not known."""
    got = run.results.get("max_length")
    if isinstance(got, int) and not isinstance(got, bool):
        return got
    args = _model_args(run)
    for key in ("max_length", "max_model_len"):
        if args.get(key):
            return int(args[key])
    if run.config.max_length:
        return int(run.config.max_length)
    if not _is_lm_eval(run) and run.config.model_dir and Path(run.config.model_dir).is_dir():
        from lm_eval.models.utils import resolve_max_length

        from kvcal.models.config import load_config

        try:
            return int(resolve_max_length(load_config(Path(run.config.model_dir))))
        except Exception:  # noqa: BLE001 — an unreadable config: not known
            return None
    return None


def run_settings(run: Run, task: str) -> dict[str, Any]:
    """What decides a run's numbers on `task` besides its cache (compared by check_like_with_like)."""
    cfg = (run.results.get("configs") or {}).get(task) or {}
    ts = task_settings(run, task)
    out: dict[str, Any] = {"model dtype": model_dtype(run), "max length": max_length(run)}
    if cfg.get("output_type") in LOGLIKELIHOOD_TYPES:
        out["log-prob dtype"] = logprob_dtype(run)
    out["chat template"] = run.results.get("chat_template_sha") or run.results.get("chat_template") or "none"
    out["system instruction"] = run.results.get("system_instruction") or "none"
    out["few-shot as multi-turn"] = bool(run.results.get("fewshot_as_multiturn"))
    named = {"num_fewshot": "few-shot", "generation_kwargs": "generation kwargs", "repeats": "repeats",
             "version": "task version", "scoring": "scoring"}  # fmt: skip
    for key, name in named.items():
        if key in ts:
            out[name] = ts[key]
    return out


def _shown(value: Any) -> str:
    return "not recorded" if value is None else repr(value) if not isinstance(value, str) else value


def check_like_with_like(pairs: list[Pair]) -> None:
    """UsageError naming every setting on which a pair's runs differ — per task and setting one line with each
    run's value and the flag that fixes it — before anything is paired; a setting a run does not record is a
    difference too (it cannot be shown the same). Task settings a record lacks (task_settings) are not compared."""
    diffs: list[str] = []
    for p in pairs:
        configs = p.configs
        for task in p.engine.tasks:
            runs = [(c.label, c.run_for(task)) for c in configs]
            present = [(label, r) for label, r in runs if r is not None]
            if p.emulation.run_for(task) is None or len(present) < 2:
                continue
            settings = [(label, run_settings(r, task)) for label, r in present]
            keys = list(dict.fromkeys(k for _, st in settings for k in st))
            for key in keys:
                have = [(label, st[key]) for label, st in settings if key in st]
                values = [v for _, v in have]
                if len(have) > 1 and (any(v is None for v in values) or any(v != values[0] for v in values)):
                    shown = ", ".join(f"{label} {_shown(v)}" for label, v in have)
                    diffs.append(f"{task} {key}: {shown} ({FIXES[key]})")
            limits = [(label, task_limit(r, task)) for label, r in present]
            if not all(same_documents(limits[0][1], lim) for _, lim in limits[1:]):
                shown = ", ".join(f"{label} {lim.describe()}" for label, lim in limits)
                diffs.append(f"{task} limit: {shown} ({FIXES['limit']})")
    if diffs:
        shown = list(dict.fromkeys(diffs))
        raise UsageError(
            f"conformance compares like with like, and these runs differ in {len(shown)} setting(s): "
            + "; ".join(shown)
        )


# ---- the damage test ---------------------------------------------------------------------------------------


def _unit(spec: MetricSpec) -> str:
    if spec.metric == GOLD_LOGPROB:
        return "nats (gold choice)"
    if spec.weighted == "pair":
        return "nats per " + ("byte" if "byte" in spec.metric else "word" if "word" in spec.metric else "token")
    return spec.metric


def _paired_values(
    task: str, spec: MetricSpec, runs: list[Run], warn: Warn
) -> tuple[list[Any], list[np.ndarray]]:
    """(the (doc_id, filter) keys, per-sample values (num / den) of `spec` in each run over them): the keys all
    of them scored, less those whose documents differ (lm-eval's doc_hash)."""
    samples = [r.samples[task] for r in runs]
    keys = [k for k in samples[0] if k[1] == spec.filter and all(k in s and spec.metric in s[k] for s in samples)]
    hashes = [[s[k].get("_doc_hash") for s in samples] for k in keys]
    same = [len({h for h in hs if h is not None}) <= 1 for hs in hashes]
    if not all(same):
        warn(f"{task}: {same.count(False)} doc ids hold different documents in the conformance runs; left out")
        keys = [k for k, ok in zip(keys, same, strict=True) if ok]
    out = []
    for s in samples:
        num, den = arrays([s[k] for k in keys], spec)
        out.append(num / den)
    return keys, out


def _nonfinite(labels: list[str], keys: list[Any], values: list[np.ndarray]) -> tuple[list[str], np.ndarray]:
    """(one line per run that scored a sample NaN or infinite, naming its doc ids; the mask of the samples every
    run scored finite). An engine returning a non-finite log-likelihood is a failure the damage test must not
    average over (its mean would be NaN) nor drop silently."""
    ok = np.ones(len(keys), dtype=bool)
    lines = []
    for label, v in zip(labels, values, strict=True):
        bad = ~np.isfinite(v)
        if bad.any():
            ids = [str(k[0]) for k, b in zip(keys, bad, strict=True) if b]
            lines.append(f"{label} scored {int(bad.sum())} of {len(v)} samples non-finite (doc ids {', '.join(ids)})")
        ok &= ~bad
    return lines, ok


def _solve_n(effect: float, alpha: float, power: float) -> int | None:
    """Paired samples for a one-sided one-sample t test of this standardized effect (statsmodels)."""
    if not math.isfinite(effect) or effect <= 0:
        return None
    import warnings

    from statsmodels.stats.power import TTestPower

    try:
        with warnings.catch_warnings():  # a root finder that does not converge returns nan: not known
            warnings.simplefilter("ignore")
            n = TTestPower().solve_power(effect_size=effect, alpha=alpha, power=power, alternative="larger")
    except Exception:  # noqa: BLE001 — statsmodels' root finder failed: not known
        return None
    n = float(np.asarray(n).ravel()[0])
    return int(math.ceil(n)) if math.isfinite(n) else None


def damage_test(
    task: str, spec: MetricSpec, eq: np.ndarray, eb: np.ndarray, mq: np.ndarray, mb: np.ndarray,
    alpha: float, margin: float | None, noise: tuple[np.ndarray, np.ndarray] | None = None,
) -> DamageResult:  # fmt: skip
    """The TOST of one key metric (module docstring); p_beyond unadjusted (check_pair applies Holm). `noise`:
    the perturbed emulation's (quantized, BF16) per-sample values, whose damage scatter is the margin."""
    from statsmodels.stats.weightstats import DescrStatsW, ttost_paired

    e_dmg, m_dmg = eq - eb, mq - mb
    d, r = e_dmg - m_dmg, eb - mb
    sign = 1.0 if not spec.higher_is_better else -1.0  # damage reads "worse" as positive
    if margin is not None:
        delta, source = float(margin), "--margin"
    elif noise is not None:  # how far the damage moves between two correct implementations (module docstring)
        delta, source = float(np.mean(np.abs((noise[0] - noise[1]) - m_dmg))), "perturbed emulation"
    else:
        delta, source = float(np.mean(np.abs(r))), "bf16 pair"
    res = DamageResult(
        task, spec.label, len(d), _unit(spec), sign * float(np.mean(e_dmg)), sign * float(np.mean(m_dmg)),
        sign * float(np.mean(d)), math.nan, math.nan, delta, source, float(np.mean(r)), float(np.mean(np.abs(r))),
        None if noise is None else float(np.mean(np.abs(noise[1] - mb))), float(np.mean(np.abs(d))),
    )  # fmt: skip
    mean, sd = float(np.mean(d)), float(np.std(d, ddof=1)) if len(d) > 1 else 0.0
    if sd == 0.0 or not math.isfinite(sd):  # every sample's gap the same: no spread to test against
        res.ci_low = res.ci_high = sign * mean
        if abs(mean) < delta:
            res.verdict, res.p_equivalence, res.p_beyond = EQUIVALENT, 0.0, 1.0
        elif abs(mean) > delta:
            res.verdict, res.p_equivalence, res.p_beyond = NOT_EQUIVALENT, 1.0, 0.0
        res.note = "every paired sample has the same damage gap"
        return res
    lo, hi = DescrStatsW(d).tconfint_mean(alpha=2 * alpha)  # the 1 - 2 alpha interval TOST decides on
    res.ci_low, res.ci_high = sorted((sign * float(lo), sign * float(hi)))
    if delta > 0:
        p_tost = float(ttost_paired(e_dmg, m_dmg, -delta, delta)[0])
        res.p_equivalence = p_tost
    stats = DescrStatsW(d)
    p_up = float(stats.ttest_mean(value=delta, alternative="larger")[1])
    p_down = float(stats.ttest_mean(value=-delta, alternative="smaller")[1])
    res.p_beyond = min(p_up, p_down)
    if abs(mean) < delta:
        res.n_needed = _solve_n((delta - abs(mean)) / sd, alpha, TOST_POWER)
    elif abs(mean) > delta:
        res.n_needed = _solve_n((abs(mean) - delta) / sd, alpha, SHOW_POWER)
    return res


def _judge(results: list[DamageResult], alpha: float) -> None:
    """Verdicts from the p-values: TOST at alpha (intersection-union: no correction), beyond the margin at
    alpha with Holm over the pair's key metrics."""
    from statsmodels.stats.multitest import multipletests

    tested = [r for r in results if r.p_beyond is not None and r.note == ""]
    if len(tested) > 1:
        adjusted = multipletests([r.p_beyond for r in tested], alpha=alpha, method="holm")[1]
        for r, p in zip(tested, adjusted, strict=True):
            r.p_beyond = float(p)
    for r in results:
        if r.note:
            continue
        if r.margin > 0 and r.p_equivalence is not None and r.p_equivalence < alpha:
            r.verdict = EQUIVALENT
        elif r.p_beyond is not None and r.p_beyond < alpha:
            r.verdict = NOT_EQUIVALENT
        else:
            r.verdict = NOT_SHOWN
        if r.verdict != NOT_SHOWN:
            r.n_needed = None  # decided: no more samples needed


def _agreement(task: str, spec: MetricSpec, eng: Run, emu: Run) -> float | None:
    """Share of the quantized runs' paired samples whose per-sample value is the same (shown, not judged)."""
    es, bs = eng.samples[task], emu.samples[task]
    keys = [k for k in bs if k in es and k[1] == spec.filter and spec.metric in bs[k] and spec.metric in es[k]]
    if not keys:
        return None
    nb, db = arrays([bs[k] for k in keys], spec)
    ne, de = arrays([es[k] for k in keys], spec)
    return float(np.mean((nb == ne) & (db == de)))


def _missing(p: Pair) -> list[str]:
    out = []
    if p.engine_bf16 is None:
        out.append(
            f"a BF16 run of the engine ({p.engine.label}'s backend {_backend(p.engine)} with kv_cache_dtype=auto, "
            "the same settings; name it with --conformance-bf16 ENGINE_BF16=EMULATION_BF16)"
        )
    if p.emulation_bf16 is None:
        out.append(
            f"a BF16 run of the emulation (kvcal eval --kv-format bf16 with {p.emulation.label}'s settings; name "
            "it with --conformance-bf16 ENGINE_BF16=EMULATION_BF16)"
        )
    return out


def _fmt(x: float) -> str:
    return f"{x:+.4g}"


def check_pair(p: Pair, cmp: Comparison, warn: Warn, margin: float | None = None) -> ConformanceResult:
    """The damage test of one quadruple (see the module docstring)."""
    s = cmp.settings
    eng, emu = p.engine, p.emulation
    out = ConformanceResult(eng.label, emu.label, _describe(emu),
                            p.engine_bf16.label if p.engine_bf16 else None,
                            p.emulation_bf16.label if p.emulation_bf16 else None)  # fmt: skip
    if _claim(eng) != _claim(emu):
        warn(f"conformance: {eng.label} claims {_describe(eng)}, {emu.label} emulates {_describe(emu)}")
    out.missing = _missing(p)
    if out.missing:
        out.verdict = f"not judged: no verdict without BF16 runs on both sides; missing {'; '.join(out.missing)}"
        return out
    assert p.engine_bf16 is not None and p.emulation_bf16 is not None
    sides = [c for c in (eng, p.engine_bf16, emu, p.emulation_bf16, p.noise_q, p.noise_bf16) if c is not None]
    for task in eng.tasks:
        runs = [c.run_for(task) for c in sides]
        if any(r is None for r in runs):
            continue
        eq_run, _, mq_run = runs[:3]
        for spec in conformance_specs(mq_run, task):  # type: ignore[arg-type]
            if spec.metric == "top1_agree":
                continue  # kl's top-1 agreement is itself a comparison with BF16, not a per-sample score
            keys, values = _paired_values(task, spec, runs, warn)  # type: ignore[arg-type]
            lines, ok = _nonfinite([c.label for c in sides], keys, values)
            out.nonfinite += [f"{task} {spec.label}: {ln}" for ln in lines]
            eq, eb, mq, mb, *pert = (v[ok] for v in values)
            if len(eq) < s.min_samples:
                warn(f"conformance {eng.label}: {task} {spec.label} has {len(eq)} samples in all {len(runs)} "
                     f"runs (fewer than {s.min_samples}); not judged")  # fmt: skip
                continue
            noise = (pert[0], pert[1]) if pert else None
            out.results.append(damage_test(task, spec, eq, eb, mq, mb, s.alpha, margin, noise))
            a = None if spec.metric == GOLD_LOGPROB else _agreement(task, spec, eq_run, mq_run)  # continuous: no ties
            if a is not None:
                out.agreement[f"{task}/{spec.label}"] = a
    out.decode = _decode(p)
    _judge(out.results, s.alpha)
    if out.nonfinite:
        for r in out.results:
            r.verdict = "not judged: non-finite samples"
        shown = "; ".join(_line(r) for r in out.results) or "no key metric left to test"
        out.verdict = (f"not judged: {'; '.join(out.nonfinite)}; on the samples all four runs scored finite: "
                       f"{shown}")  # fmt: skip
        return out
    if not out.results:
        out.verdict = (f"not judged: fewer than {s.min_samples} samples scored by {eng.label}, {p.engine_bf16.label}, "
                       f"{emu.label} and {p.emulation_bf16.label} alike")  # fmt: skip
        return out
    out.verdict = _verdict(out, p)
    return out


def _decode(p: Pair) -> list[Any]:
    """Each generative task's decode comparison (engine and emulation, each against its own BF16 run)."""
    from kvcal.report.decode_conformance import compare_decode

    sides = {"engine": p.engine, "engine_bf16": p.engine_bf16, "emulation": p.emulation,
             "emulation_bf16": p.emulation_bf16}  # fmt: skip
    out = []
    for task in p.engine.tasks:
        runs = {k: c.run_for(task) if c is not None else None for k, c in sides.items()}
        if any(r is None for r in runs.values()):
            continue
        row = compare_decode(runs, {k: c.label for k, c in sides.items() if c is not None}, task)
        if row is not None:
            out.append(row)
    return out


def _line(r: DamageResult) -> str:
    return (f"{r.task} {r.metric}: damage {_fmt(r.engine_damage)} (engine) vs {_fmt(r.emulation_damage)} "
            f"(emulation) {r.unit}, gap {_fmt(r.gap)} [{r.ci_low:.4g}, {r.ci_high:.4g}], margin ±{r.margin:.4g} "
            f"({MARGIN_SOURCES[r.margin_source]}), n = {r.n}")  # fmt: skip


def _verdict(out: ConformanceResult, p: Pair) -> str:
    rs = out.results
    bad = [r for r in rs if r.verdict == NOT_EQUIVALENT]
    if bad:
        out.conforms = False
        return (f"not equivalent: {out.engine}'s damage (vs {p.engine_bf16.label if p.engine_bf16 else '?'}) differs "
                f"from the emulation's ({out.emulation} vs {p.emulation_bf16.label if p.emulation_bf16 else '?'}) "
                "beyond the margin: " + "; ".join(f"{_line(r)}, p = {r.p_beyond:.2g}" for r in bad))  # fmt: skip
    zero = [r for r in rs if r.margin == 0]
    if zero:
        out.conforms = None
        return (f"not judged: the BF16 runs agree on every sample of {', '.join(f'{r.task} {r.metric}' for r in zero)} "
                "(margin 0): pass --margin to say what damage gap is close enough")  # fmt: skip
    if all(r.verdict == EQUIVALENT for r in rs):
        out.conforms = True
        return (f"equivalent: {out.engine}'s damage matches kvcal's emulation of {out.claimed} ({out.emulation}) "
                "within the margin: " + "; ".join(f"{_line(r)}, TOST p = {r.p_equivalence:.2g}" for r in rs))  # fmt: skip
    out.conforms = None
    parts = []
    for r in rs:
        if r.verdict == EQUIVALENT:
            continue
        need = (f"about {r.n_needed} paired samples would show "
                f"{'equivalence' if abs(r.gap) < r.margin else 'non-equivalence'} at the measured gap"
                if r.n_needed else "no sample size would decide it at the measured gap")  # fmt: skip
        parts.append(f"{_line(r)}: {need}")
    return f"{NOT_SHOWN}: " + "; ".join(parts)


def check_margin(margin: float | None, noise: Iterable[str] | None = None) -> None:
    if margin is not None and not (margin > 0 and math.isfinite(margin)):
        raise UsageError(f"--margin must be a positive number in the key metric's per-sample unit, got {margin}")
    if margin is not None and list(noise or []):
        raise UsageError(
            "--margin and --conformance-noise both set the margin: give --margin (a number you choose) or "
            "--conformance-noise (the perturbed emulation's damage scatter), not both"
        )


def before_pairing(
    named: Iterable[str] | None,
    references: Iterable[str] | None,
    margin: float | None = None,
    noise: Iterable[str] | None = None,
) -> Any:
    """A check for kvcal.report.compare.compare_runs to call on the loaded configurations before it pairs any
    samples: the conformance pairs found and their runs like with like (one UsageError naming every difference
    first, before another refusal names one of them)."""
    named, references, noise = list(named or []), list(references or []), list(noise or [])

    def check(configs: list[Configuration]) -> None:
        check_margin(margin, noise)
        check_like_with_like(find_pairs(configs, named, references, noise))

    return check


def add_conformance(
    cmp: Comparison,
    named: Iterable[str] | None = None,
    warn: Warn | None = None,
    references: Iterable[str] | None = None,
    margin: float | None = None,
    noise: Iterable[str] | None = None,
) -> None:
    """Fill cmp.conformance: the named pairs, or every engine run that has an emulation here; `noise`
    (--conformance-noise) the perturbed emulation runs whose damage scatter is each pair's margin."""

    def _warn(msg: str) -> None:
        cmp.warnings.append(msg)
        if warn is not None:
            warn(msg)

    noise = list(noise or [])
    check_margin(margin, noise)
    pairs = find_pairs(cmp.configs, named, references, noise)
    check_like_with_like(pairs)
    cmp.conformance = [check_pair(p, cmp, _warn, margin) for p in pairs]
