"""One task of a run: its runner (lm-eval's `simple_evaluate`, or kvcal's own `kl`), and the bookkeeping every task
gets (forward timing, non-finite K/V counts from every rank, the task saved as it finishes).

A runner takes the LM, the bound spec, the task name and the process group and returns (the task's part of
results.json, its sample records) on rank 0, (None, []) on the others: `run_kl_task` for kvcal's `kl`,
`run_lm_eval_task` for every other task. Adding a kvcal task = a runner here, its branch in `TaskLoop.run` and
its name in kvcal.evaluate.tasks.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable
from typing import Any

from kvcal import parallel
from kvcal.errors import KvcalError, UsageError
from kvcal.evaluate.bound import BoundSpec
from kvcal.evaluate.git_probe import quiet_git_probe
from kvcal.evaluate.record import check_nonfinite, nonfinite_kv, seeds, sum_nonfinite, task_part
from kvcal.evaluate.repeats import aggregate, check_mean_metrics, score_repeats, with_repeats
from kvcal.evaluate.runstore import RunStore
from kvcal.evaluate.tasks import DIVERGENCE_TASKS, KL_TASK, PASSKEY_TASKS, task_manager_for
from kvcal.evaluate.timing import FORWARDS_KEY, ForwardTimer, ForwardTotals
from kvcal.rundir import RunConfig

TaskResult = tuple[dict[str, Any] | None, list[dict[str, Any]]]


def _silent(_msg: str) -> None:
    return None


class TaskLoop:
    """A run's tasks on one LM: each task timed (prefill / decode forwards, TTFT; kvcal.evaluate.timing), its
    non-finite K/V counted, both gathered from every rank, and saved by rank 0 as it finishes (an interrupted run
    resumes after the last saved task). `close()` takes the timer's hooks off the model."""

    def __init__(
        self, lm: Any, timer: ForwardTimer, store: RunStore, dist: parallel.Dist, say: Callable[[str], None]
    ) -> None:
        self.lm, self.timer, self.store, self.dist, self.say = lm, timer, store, dist, say
        lm.forward_timer = timer  # the LM marks its generate calls' requests on the timer (TTFT)

    def close(self) -> None:
        self.timer.close()
        self.lm.forward_timer = None

    def run(self, bound: BoundSpec, task: str) -> None:
        """Run `task` of `bound` (the spec the LM was built from) and save it (rank 0)."""
        self.say(f"{task}: running")
        self.timer.take()  # start the task's totals afresh
        t0 = time.perf_counter()
        if task == KL_TASK:
            part, samples = run_kl_task(self.lm, bound, task, self.dist)
        elif task in DIVERGENCE_TASKS:
            part, samples = run_divergence_task(self.lm, bound, task, self.dist)
        else:
            part, samples = run_lm_eval_task(self.lm, bound, task, self.dist)
        mine = (self.timer.take().to_record(), nonfinite_kv(self.lm, task, False, _silent))
        shared = parallel.gather_objects(mine, self.dist)  # every rank's (forward totals, non-finite counts)
        if part is None or shared is None:
            return  # not rank 0: it holds the task's results
        forwards = ForwardTotals.merge([ForwardTotals.from_record(f) for f, _ in shared])
        part[FORWARDS_KEY] = forwards.to_record()
        metrics = {"wall_s": time.perf_counter() - t0, "tokens": forwards.tokens, **forwards.summary()}
        metrics["nonfinite_kv"] = check_nonfinite(
            _sum_counts([c for _, c in shared]), task, bound.spec.strict, self.say
        )
        part["kvcal_task_metrics"] = metrics
        self.store.save_task(task, part, samples)


def _sum_counts(counts: list[dict[str, Any] | None]) -> dict[str, Any] | None:
    return sum_nonfinite([{"nonfinite_kv": c} for c in counts])


# ---- sample hygiene -----------------------------------------------------------------------------------------


def private_sample(sample: dict[str, Any]) -> dict[str, Any]:
    """A GPQA sample with nothing of the question left in plain text: the doc, the prompts and the raw
    generations go; a hash of the doc stays (enough to pair samples across runs)."""
    out = {k: v for k, v in sample.items() if k not in ("doc", "arguments", "resps", "gen_token_ids")}
    out["doc_hash"] = (
        sample.get("doc_hash")
        or hashlib.sha256(repr(sorted((sample.get("doc") or {}).items())).encode()).hexdigest()
    )
    filtered = out.get("filtered_resps")
    if isinstance(filtered, list) and any(isinstance(f, str) and len(f) > 16 for f in filtered):
        out["filtered_resps"] = [
            f
            if not isinstance(f, str) or len(f) <= 16
            else "sha256:" + hashlib.sha256(f.encode()).hexdigest()
            for f in filtered
        ]
    return out


# ---- the runners ----------------------------------------------------------------------------------------------


def run_lm_eval_task(lm: Any, bound: BoundSpec, task: str, dist: parallel.Dist) -> TaskResult:
    """lm-eval's `simple_evaluate` of one task on `lm` (its samples logged; GPQA's scrubbed of the question)."""
    from lm_eval import simple_evaluate

    plan, config = bound.tasks, bound.spec
    assert plan is not None
    spec = plan.lm_eval_specs[task]
    manager = task_manager_for(plan)
    repeated = config.repeats is not None and config.repeats > 1
    if repeated:
        spec = with_repeats(spec, int(config.repeats or 1), task, manager)
    limit = None if task in PASSKEY_TASKS else config.limit  # passkey: --limit = samples per cell
    with quiet_git_probe():  # lm-eval's `git describe` prints "fatal: ..." outside a checkout
        res = simple_evaluate(
            model=lm,
            tasks=[spec],
            num_fewshot=config.num_fewshot,
            limit=limit,
            log_samples=True,
            task_manager=manager,
            gen_kwargs=config.generation_kwargs,
            **seeds(config.seed),
        )
    generated = _generated_ids(lm, dist)  # every rank takes part (a collective), before rank 0 goes on alone
    if res is None:
        if lm.rank != 0:  # lm-eval gathered this rank's share on rank 0
            return None, []
        raise KvcalError(f"lm-eval returned no results for task '{task}'")
    samples_by_task = res.get("samples", {}) or {}
    samples: list[dict[str, Any]] = []
    for name, recs in samples_by_task.items():
        if lm.world_size > 1:
            recs = undo_rank_split(recs, (res.get("configs", {}).get(name) or {}).get("repeats", 1))
        for rec in recs:
            rec = with_token_ids(dict(rec), generated)
            if len(samples_by_task) > 1:
                rec["task"] = name
            samples.append(private_sample(rec) if task in plan.private else rec)
    part = task_part(res)
    if repeated:
        samples = _score_repeats(spec, manager, config, limit, samples, part, task, lm.sample_seed)
    if task in plan.private:
        part = _scrub_configs(part)
    if task in PASSKEY_TASKS:
        from kvcal.evaluate.passkey import cells

        part["passkey_by_cell"] = {task: cells(task, samples)}
    return part, samples


def _generated_ids(lm: Any, dist: parallel.Dist) -> dict[str, list[list[int]]]:
    """Every rank's generate_until token ids by context (kvcal.evaluate.adapter.GenerationRecorder), on rank 0."""
    gathered = parallel.gather_objects(lm.generations.take(), dist)  # [mine] in one process; None off rank 0
    merged: dict[str, list[list[int]]] = {}
    for part in gathered or []:
        for context, ids in part.items():
            merged.setdefault(context, []).extend(ids)
    return merged


def with_token_ids(rec: dict[str, Any], generated: dict[str, list[list[int]]]) -> dict[str, Any]:
    """A generate_until sample with `gen_token_ids`: the generated ids of each of its repeats (what the comparison
    finds the first differing token with). Records of other requests are returned as they are."""
    args = rec.get("arguments")
    if not generated or not isinstance(args, list) or not args or not isinstance(args[0], (list, tuple)):
        return rec
    ids = generated.get(str(args[0][0]))
    if ids is not None:
        repeats = len(rec["resps"][0]) if rec.get("resps") and isinstance(rec["resps"][0], list) else 1
        rec["gen_token_ids"] = ids[:repeats]
    return rec


def _score_repeats(
    spec: dict[str, Any],
    manager: Any,
    config: Any,
    limit: int | None,
    samples: list[dict[str, Any]],
    part: dict[str, Any],
    task: str,
    seed: int,
) -> list[dict[str, Any]]:
    """Every repeat scored (kvcal.evaluate.repeats): the task rebuilt as simple_evaluate built it, its samples'
    metrics the mean over their repeats, results.json's metrics the mean over documents."""
    from kvcal.evaluate.divergence import lm_eval_requests

    fewshot_seed = seeds(config.seed)["fewshot_random_seed"]
    lm_task, instances = lm_eval_requests(spec, manager, config.num_fewshot, fewshot_seed, limit)
    check_mean_metrics(lm_task, task)
    scored = score_repeats(lm_task, instances, samples)
    aggregate(part, lm_task.config.task, scored, int(config.repeats), seed)
    return scored


def undo_rank_split(recs: list[dict[str, Any]], repeats: int) -> list[dict[str, Any]]:
    """One process's sample records from several processes' (lm-eval's evaluator concatenates the ranks' records
    rank by rank, and pads a rank that has fewer requests with copies of its last request, whose responses then
    land in that request's `resps` too): per filter, in document order, `resps` cut back to `repeats`."""
    filters = list(dict.fromkeys(r.get("filter") for r in recs))  # first-seen order = lm-eval's filter order
    ordered = sorted(recs, key=lambda r: (filters.index(r.get("filter")), r.get("doc_id", 0)))
    out = []
    for rec in ordered:
        if isinstance(rec.get("resps"), list):
            rec = {**rec, "resps": [r[:repeats] if isinstance(r, list) else r for r in rec["resps"]]}
        out.append(rec)
    return out


def _scrub_configs(part: dict[str, Any]) -> dict[str, Any]:
    """GPQA configs carry only templates, but keep the local zip path and loader out of results.json."""
    for cfg in part.get("configs", {}).values():
        if isinstance(cfg, dict):
            cfg.pop("dataset_kwargs", None)
            if "custom_dataset" in cfg:
                cfg["custom_dataset"] = "kvcal.evaluate.tasks.gpqa_in_memory"
    return part


def _baseline_side(bound: BoundSpec) -> dict[str, Any]:
    """The BF16 baseline's description, part of its disk cache's key (kl windows, divergence trajectories); a
    perturbed model's (--perturb-weights) is another model's baseline, with its own entries (every other key as
    before)."""
    spec = bound.spec
    base = {"kv_format": "bf16", "impl": spec.impl, "dtype": bound.dtype, "device": spec.device}
    if spec.perturb_weights is not None:
        base.update(perturb_weights=spec.perturb_weights, perturb_seed=spec.seed)
    return base


def run_kl_task(lm: Any, bound: BoundSpec, task: str = KL_TASK, dist: parallel.Dist | None = None) -> TaskResult:
    """kvcal's `kl`: the LM's cache against a BF16 cache read through kvcal's attention (kvcal.evaluate.kl)."""
    from kvcal.evaluate.kl import lm_sides, run_kl

    spec, recorded = bound.spec, bound.recorded
    assert recorded is not None
    quant_session, baseline = lm_sides(lm, spec.impl)
    base = _baseline_side(bound)
    return run_kl(
        lm.model,
        lm.tokenizer,
        quant_session=quant_session,
        baseline=baseline,
        baseline_desc={**base, "attention": "kvcal"},
        evaluated_desc=_kl_evaluated_side(recorded),
        model_dir=bound.model_dir,
        data_dir=spec.data_dir,
        limit=spec.limit,
        seq_len=spec.kl_seq_len,
        prefill_chunk=spec.prefill_chunk,
        subsample=spec.kl_subsample,
        dist=dist,
    )


def _kl_evaluated_side(recorded: RunConfig) -> dict[str, Any]:
    """What the kl task compares against its BF16 baseline (kvcal's attention over a BF16 cache)."""
    if recorded.kv_format == "auto":
        return {
            "kv_format": "auto",
            "attention": "transformers (the model's own)",
            "cache_dtype": recorded.dtype,
            "note": "the model's own attention over its own-dtype cache vs kvcal's attention over a BF16 cache: "
            "the KL holds the attention implementations' difference as well as the cache's",
        }
    return {
        "kv_format": recorded.kv_format,
        "attention": "kvcal",
        "impl": recorded.impl,
        "skip_layers": recorded.skip_layer_indices,
        "note": "same attention as the baseline: the KL is the cache format's alone",
    }


def run_divergence_task(lm: Any, bound: BoundSpec, task: str, dist: parallel.Dist | None = None) -> TaskResult:
    """A divergence task (kvcal.evaluate.divergence): the bound spec's model, cache and options; its BF16 baseline
    as kl's (kvcal.evaluate.kl.lm_sides)."""
    from kvcal.evaluate.divergence import DEFAULT_GEN_LEN, UserPrompts, private_record, run_divergence
    from kvcal.evaluate.kl import lm_sides, model_fingerprint, position_buckets

    if dist is not None and dist.active:
        raise UsageError(f"task '{task}' runs in one process; drop --num-processes / torchrun for it")
    spec, recorded, plan = bound.spec, bound.recorded, bound.tasks
    assert recorded is not None and plan is not None
    gen_len = spec.max_gen_toks or DEFAULT_GEN_LEN
    quant_session, baseline = lm_sides(lm, spec.impl)
    fingerprint = model_fingerprint(bound.model_dir)
    edges = position_buckets(gen_len)  # kl's position buckets over the generated positions
    base = _baseline_side(bound)
    evaluated = {
        "kv_format": recorded.kv_format,
        "attention": "kvcal" if recorded.kv_format != "auto" else "transformers (the model's own)",
        "impl": recorded.impl,
        "skip_layers": recorded.skip_layer_indices,
    }
    seed = seeds(spec.seed)["fewshot_random_seed"]  # the few-shot seed lm-eval tasks of the run get
    part, samples = run_divergence(
        lm,
        task=task,
        prompts_spec=plan.lm_eval_specs.get(DIVERGENCE_TASKS[task], ""),  # absent with --prompts
        task_manager=task_manager_for(plan),
        quant_session=quant_session,
        baseline=baseline,
        baseline_desc={**base, "attention": "kvcal"},
        evaluated_desc=evaluated,
        fingerprint=fingerprint,
        gen_len=gen_len,
        edges=edges,
        limit=spec.limit,
        num_fewshot=spec.num_fewshot,
        fewshot_seed=seed,
        prefill_chunk=spec.prefill_chunk,
        user_prompts=UserPrompts(spec.prompts.read(), spec.prompts.sha256) if spec.prompts else None,
        batch_size=spec.batch_size,
    )
    if task in plan.private:  # GPQA: no output a reader could decode back into the question's text
        samples = [private_record(r) for r in samples]
    return part, samples
