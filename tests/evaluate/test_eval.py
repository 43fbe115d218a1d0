"""kvcal's lm-eval adapter, end to end on tiny random models (Llama and Gemma 3 with sliding layers; `tiny_lm_dir`).

Parity: with kv_format=auto, `simple_evaluate(model="kvcal")` equals `simple_evaluate(model="hf")` exactly on a
loglikelihood (multiple-choice), a rolling-loglikelihood and a generate_until task (tiny task YAMLs + jsonl data
under tmp_path, loaded through include_path exactly as `lm_eval --include_path` does).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

pytestmark = pytest.mark.slow  # lm-eval end to end on tiny models: ~2 minutes on 2 cores

CORPUS = [
    "the cat sat on the mat and the dog sat on the log",
    "one two three four five six seven eight nine ten",
    "question : what is two plus two ? answer : four",
    "a quick brown fox jumps over the lazy dog near the river bank",
    "paris is the capital of france and rome is the capital of italy",
]

MC_DOCS = [
    {"q": "the cat sat on the", "choices": ["mat", "dog", "river"], "label": 0},
    {"q": "paris is the capital of", "choices": ["italy", "france"], "label": 1},
    {"q": "one two three", "choices": ["four", "ten", "cat"], "label": 0},
]
ROLL_DOCS = [{"text": t} for t in CORPUS[:3]]
GEN_DOCS = [
    {"q": "what is two plus two ?", "a": "four"},
    {"q": "the quick brown", "a": "fox"},
]

GEN_KWARGS = {"until": ["\n", "question"], "max_gen_toks": 6, "do_sample": False}


def write_tasks(task_dir: Path, lm_eval_task: Callable[..., None]) -> Path:
    """tiny_mc, tiny_roll and tiny_gen: one local lm-eval task of each output type kvcal serves."""
    lm_eval_task(task_dir, "tiny_mc", "multiple_choice", MC_DOCS, ["acc", "acc_norm"])
    lm_eval_task(
        task_dir,
        "tiny_roll",
        "loglikelihood_rolling",
        ROLL_DOCS,
        ["word_perplexity", "byte_perplexity", "bits_per_byte"],
    )
    lm_eval_task(
        task_dir, "tiny_gen", "generate_until", GEN_DOCS, ["exact_match"], generation_kwargs=GEN_KWARGS
    )
    return task_dir


@pytest.fixture(scope="module")
def tiny(
    tmp_path_factory: pytest.TempPathFactory,
    tiny_lm_dir: Callable[..., Path],
    lm_eval_task: Callable[..., None],
) -> dict[str, Path]:
    """Tiny Llama and Gemma 3 (tests/conftest.py's `tiny_lm_dir`, tokenizer trained on CORPUS) and the tasks."""
    return {
        "llama": tiny_lm_dir("llama", CORPUS),
        "gemma3": tiny_lm_dir("gemma3", CORPUS),
        "tasks": write_tasks(tmp_path_factory.mktemp("tiny_eval") / "tasks", lm_eval_task),
    }


def _evaluate(model: str, model_args: str, task_dir: Path, tasks: list[str]) -> dict[str, Any]:
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    import kvcal.evaluate.adapter  # noqa: F401  (registers model "kvcal")

    return simple_evaluate(
        model=model,
        model_args=model_args,
        tasks=tasks,
        task_manager=TaskManager(include_path=str(task_dir), include_defaults=False),
        batch_size=2,
        device="cpu",
        log_samples=True,
        bootstrap_iters=0,
    )


@pytest.mark.parametrize("kind", ["llama", "gemma3"])
def test_auto_parity_with_lm_eval_hf(
    tiny: dict[str, Path], kind: str, same_loglikelihoods: Callable[..., None]
) -> None:
    """scoring=full (the default) is lm-eval's own path: every sample and every metric exactly HFLM's.
    scoring=continuation (continuation-only scoring, kvcal.evaluate.scoring) is per sample HFLM's log-likelihood to float32 rounding
    with is_greedy identical; generations are exactly HFLM's."""
    tasks = ["tiny_mc", "tiny_roll", "tiny_gen"]
    args = f"pretrained={tiny[kind]},dtype=float32"
    ref = _evaluate("hf", args, tiny["tasks"], tasks)
    full = _evaluate("kvcal", args + ",kv_format=auto,scoring=full", tiny["tasks"], tasks)
    ours = _evaluate("kvcal", args + ",kv_format=auto,scoring=continuation", tiny["tasks"], tasks)
    assert ref["results"] == full["results"]
    for task in tasks:
        r = [(s["resps"], s["filtered_resps"]) for s in ref["samples"][task]]
        assert r == [(s["resps"], s["filtered_resps"]) for s in full["samples"][task]]
    gen = [s["resps"] for s in ref["samples"]["tiny_gen"]]
    assert gen == [s["resps"] for s in ours["samples"]["tiny_gen"]]
    for task in ("tiny_mc", "tiny_roll"):
        same_loglikelihoods(ref["samples"][task], ours["samples"][task])
    # not vacuous: the rolling task produced a finite perplexity and the generation produced text
    assert ref["results"]["tiny_roll"]["word_perplexity,none"] > 1.0
    assert any(s["resps"][0][0] for s in ref["samples"]["tiny_gen"])


def test_adapter_is_registered_with_lm_eval() -> None:
    from lm_eval.api.registry import get_model

    from kvcal.evaluate.adapter import KvcalLM

    assert get_model("kvcal") is KvcalLM


# ---- kvcal eval's run directory, through a quantized cache -----------------------------------------------------


def _config(tiny: dict[str, Path], out: Path, **kw: Any) -> Any:
    from kvcal.evaluate.run import EvalConfig

    base = dict(
        model=str(tiny["gemma3"]),
        kv_format="fp8_e4m3",
        tasks=["tiny_mc,tiny_roll,tiny_gen,kl"],
        include_path=str(tiny["tasks"]),
        limit=2,
        kl_seq_len=16,
        output=str(out),
        batch_size=2,
    )
    base.update(kw)
    return EvalConfig(**base)


@pytest.fixture(scope="module")
def fp8_run(tiny: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    from kvcal.evaluate.run import run_eval
    from kvcal.evaluate.spec import eval_spec

    # A fresh kvcal cache from here to the end of this module (the KL baseline-cache counts below start from it);
    # restored afterwards so later modules keep the session's cache.
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("KVCAL_CACHE", str(tmp_path_factory.mktemp("kvcal_cache")))
        yield run_eval(eval_spec(_config(tiny, tmp_path_factory.mktemp("runs") / "fp8")))


def test_quantized_run_end_to_end(fp8_run: Path) -> None:
    names = {p.name for p in fp8_run.iterdir()}
    assert {"config.yaml", "env.json", "results.json", "metrics.json", "COMPLETE"} <= names
    assert {f"samples_{t}.jsonl" for t in ("tiny_mc", "tiny_roll", "tiny_gen", "kl")} <= names
    results = json.loads((fp8_run / "results.json").read_text())
    assert set(results["results"]) == {"tiny_mc", "tiny_roll", "tiny_gen", "kl"}
    assert {"configs", "versions", "n-shot", "n-samples"} <= set(results)
    runtime = results["kvcal"]["runtime"]
    assert runtime["kv_format"] == "fp8_e4m3" and runtime["attn_implementation"] == "kvcal"
    kl = results["results"]["kl"]
    assert kl["kl,none"] > 0 and 0 <= kl["top1_agree,none"] <= 1 and kl["ppl,none"] > 1
    recs = [json.loads(line) for line in (fp8_run / "samples_kl.jsonl").read_text().splitlines()]
    assert len(recs) == 2 and set(recs[0]) == {"doc_id", "kl", "top1_agree", "nll", "n_tokens"}
    metrics = json.loads((fp8_run / "metrics.json").read_text())
    assert metrics["capacity_multiplier_vs_bf16"] == pytest.approx(2.0) and metrics["tokens_per_s"] > 0
    roll = [json.loads(line) for line in (fp8_run / "samples_tiny_roll.jsonl").read_text().splitlines()]
    assert len(roll) == 2 and "word_perplexity" in roll[0]


def test_quantized_logits_differ_from_auto(tiny: dict[str, Path]) -> None:
    from kvcal.evaluate.adapter import KvcalLM

    ids = torch.tensor([[1, 5, 9, 12, 7, 30, 44, 2, 8, 19, 23]])
    auto = KvcalLM(pretrained=str(tiny["gemma3"]), kv_format="auto", dtype="float32", device="cpu")
    nv = KvcalLM(pretrained=str(tiny["gemma3"]), kv_format="nvfp4", dtype="float32", device="cpu")
    a, q = auto._model_call(ids), nv._model_call(ids)
    assert a.shape == q.shape and not torch.equal(a, q)
    assert (a - q).abs().max() < 5.0  # quantization noise, not garbage


def test_rerun_skips_resume_redoes_only_missing(tiny: dict[str, Path], fp8_run: Path) -> None:
    from kvcal.evaluate.run import run_eval
    from kvcal.evaluate.spec import eval_spec

    stamps = {p.name: p.stat().st_mtime_ns for p in fp8_run.rglob("*") if p.is_file()}
    assert run_eval(eval_spec(_config(tiny, fp8_run))) == fp8_run
    assert {p.name: p.stat().st_mtime_ns for p in fp8_run.rglob("*") if p.is_file()} == stamps
    # interrupted: no marker, one task unfinished
    (fp8_run / "COMPLETE").unlink()
    (fp8_run / "tasks" / "tiny_gen.json").unlink()
    run_eval(eval_spec(_config(tiny, fp8_run)))
    assert (fp8_run / "COMPLETE").is_file()
    assert (fp8_run / "tasks" / "tiny_mc.json").stat().st_mtime_ns == stamps["tiny_mc.json"]
    assert (fp8_run / "tasks" / "tiny_gen.json").stat().st_mtime_ns != stamps["tiny_gen.json"]


def test_bad_input_leaves_the_run_untouched(tiny: dict[str, Path], fp8_run: Path) -> None:
    from kvcal.errors import KvcalError, UsageError
    from kvcal.evaluate.run import run_eval
    from kvcal.evaluate.spec import eval_spec

    stamps = {p.name: p.stat().st_mtime_ns for p in fp8_run.rglob("*") if p.is_file()}
    with pytest.raises(KvcalError, match="different configuration"):
        run_eval(eval_spec(_config(tiny, fp8_run, kv_format="nvfp4")))
    with pytest.raises(UsageError, match="--limit"):
        run_eval(eval_spec(_config(tiny, fp8_run, limit=0)))
    with pytest.raises(UsageError, match="did you mean"):
        run_eval(eval_spec(_config(tiny, fp8_run, tasks=["tiny_mcc"])))
    with pytest.raises(UsageError, match="quantized --kv-format"):
        run_eval(eval_spec(_config(tiny, fp8_run, kv_format="auto", skip_layers="sliding_window")))
    assert {p.name: p.stat().st_mtime_ns for p in fp8_run.rglob("*") if p.is_file()} == stamps


def test_kl_of_identical_runs_is_zero_and_baseline_is_cached(
    tiny: dict[str, Path], fp8_run: Path, tmp_path: Path
) -> None:
    from kvcal.evaluate.run import run_eval
    from kvcal.evaluate.spec import eval_spec

    out = run_eval(eval_spec(_config(tiny, tmp_path / "bf16", kv_format="bf16", tasks=["kl"], limit=3)))
    res = json.loads((out / "results.json").read_text())
    kl = res["results"]["kl"]
    assert kl["kl,none"] == 0.0 and kl["top1_agree,none"] == 1.0
    # the fp8 run already cached windows 0-1 of this model's BF16 baseline; window 2 is new
    assert res["configs"]["kl"]["baseline_cache_hits"] == 2


def test_scales_bound_to_another_checkpoint(tiny: dict[str, Path], fp8_run: Path, tmp_path: Path) -> None:
    import shutil

    from kvcal.errors import KvcalError
    from kvcal.evaluate.run import run_eval
    from kvcal.evaluate.spec import eval_spec
    from kvcal.models.config import load_config
    from kvcal.models.geometry import kv_spec
    from kvcal.scales import compute_binding, make_scale_set, save_scale_file

    kv = kv_spec(load_config(tiny["gemma3"]))
    # a second checkpoint of the same geometry: same config and tokenizer, perturbed weights
    other = tmp_path / "gemma3_other"
    shutil.copytree(tiny["gemma3"], other)
    from safetensors.torch import load_file, save_file

    weights = load_file(str(other / "model.safetensors"))
    first = sorted(weights)[0]
    weights[first] = weights[first] + 0.01
    save_file(weights, str(other / "model.safetensors"), metadata={"format": "pt"})
    binding = compute_binding(str(other), other, kv)
    n = kv.num_layers
    scales = tmp_path / "fp8.safetensors"
    save_scale_file(
        scales,
        make_scale_set("fp8_e4m3", "tensor", [0.01] * n, [0.01] * n, observer="minmax", binding=binding),
    )

    cfg = dict(kv_format="fp8_e4m3", tasks=["kl"], limit=1, scales=str(scales))
    with pytest.raises(KvcalError, match="--force|force"):
        run_eval(eval_spec(_config(tiny, tmp_path / "refused", **cfg)))
    assert not (tmp_path / "refused").exists()
    with pytest.raises(KvcalError, match="nvfp4"):
        run_eval(eval_spec(_config(tiny, tmp_path / "fmt", **{**cfg, "kv_format": "nvfp4"})))
    out = run_eval(eval_spec(_config(tiny, tmp_path / "forced", force_scales=True, **cfg)))
    import yaml

    recorded = yaml.safe_load((out / "config.yaml").read_text())
    assert recorded["force_scales"] is True and recorded["scales"]["binding_differences"]
    assert "WARNING" in recorded["scales"] and recorded["scales"]["granularity"] == "tensor"
    # bound to its own checkpoint: accepted without force, and the run reads the static scales
    out2 = run_eval(eval_spec(_config(tiny, tmp_path / "bound", **{**cfg, "model": str(other)})))
    res = json.loads((out2 / "results.json").read_text())
    assert res["kvcal"]["runtime"]["scale_source"].startswith("scale file")
