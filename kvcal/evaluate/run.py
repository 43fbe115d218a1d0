"""`run_eval(EvalSpec) -> Path`: one model x one KV configuration x a task list, into one run directory.

Order of work (so bad input never damages an existing run): the spec is parsed and checked at the edge
(kvcal.evaluate.spec.eval_spec) -> bound to its checkpoint (kvcal.evaluate.bound.bind: model, scale file, lengths,
task data) -> the run directory opened (complete: skip; other config: error) -> the model loaded once -> each
unfinished task run and saved as it finishes (kvcal.evaluate.task_runs) -> results.json, metrics.json, env.json
(kvcal.evaluate.record) -> COMPLETE.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from kvcal import parallel
from kvcal.evaluate.bound import BoundSpec, bind
from kvcal.evaluate.record import environment, metrics_record, results_record, seeds
from kvcal.evaluate.runstore import RunStore, open_shared
from kvcal.evaluate.spec import EvalConfig, EvalSpec, run_dir_name
from kvcal.evaluate.task_runs import TaskLoop
from kvcal.evaluate.timing import ForwardTimer
from kvcal.rundir import ENV, METRICS, RESULTS

__all__ = ["BoundSpec", "EvalConfig", "EvalSpec", "bind", "run_dir_name", "run_eval"]


def run_eval(config: EvalSpec, progress: Callable[[str], None] | None = None) -> Path:
    """Evaluate the spec `config` (built by `eval_spec`) into its run directory and return the directory. A
    complete directory with the same config is returned untouched; an interrupted one resumes (finished tasks
    are not rerun)."""
    bound = bind(config)  # everything checked, against the checkpoint too, before anything is written
    spec = bound.spec
    if spec.limit is not None:  # several processes (torchrun): each needs a sample
        parallel.check_enough_work(spec.limit, "samples (--limit)", parallel.from_env())
    dist = parallel.setup(spec.device)
    root = _evaluate(bound, dist, (progress or _silent) if dist.is_main else _silent)
    parallel.finish(dist)  # every rank waits for rank 0's writes, then leaves the process group in order
    return root


def _evaluate(bound: BoundSpec, dist: parallel.Dist, say: Callable[[str], None]) -> Path:
    """run_eval's work in this process: rank 0 speaks and writes; the others compute."""
    spec, plan, recorded = bound.spec, bound.tasks, bound.recorded
    assert plan is not None and recorded is not None  # a spec of kvcal eval has tasks
    store = RunStore(spec.run_dir)
    state, pending = open_shared(store, recorded, plan.names, dist)
    if state == "complete":
        say(f"{store.root}: complete, skipped")
        return store.root
    for task in plan.names:
        if task not in pending:
            say(f"{task}: already done, skipped")
    described, window = None, None
    if pending:
        from kvcal.evaluate.adapter import KvcalLM

        say(f"loading {recorded.model} ({recorded.dtype}, {recorded.device}, kv {recorded.kv_format})")
        # the bound spec's cache plan (the checked scale set, the skip indices) and placement: nothing is parsed
        # or read again
        lm = KvcalLM.from_bound(
            bound,
            dtype=bound.dtype,
            device=spec.device,
            batch_size=spec.batch_size,
            trust_remote_code=spec.trust_remote_code,
            scoring=spec.scoring,
            prefill_chunk=spec.prefill_chunk,
            logprob_dtype=spec.logprob_dtype,
            max_length=spec.max_length,
            perturb_weights=spec.perturb_weights,
            perturb_seed=spec.seed,
        )
        lm.sample_seed = seeds(spec.seed)["torch_random_seed"]  # sampled requests' seeds derive from it
        loop = TaskLoop(lm, ForwardTimer(lm.model), store, dist, say)
        try:
            for task in pending:
                loop.run(bound, task)
        finally:
            loop.close()
        window = lm.max_length  # lm-eval's rolling window / truncation, as its results record it
        if lm.runtime is not None:  # its first-batch scales, when the run fixed them, are in its description
            described = lm.runtime.describe()
    if not dist.is_main:
        return store.root
    parts = store.finished_parts(plan.names)
    records = {
        RESULTS: results_record(parts, bound, described, window),
        ENV: environment(spec.device),
        METRICS: metrics_record(parts, bound),
    }
    store.finish(records, recorded)
    say(f"{store.root}: complete")
    return store.root


def _silent(_msg: str) -> None:
    return None
