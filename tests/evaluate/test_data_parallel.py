"""`kvcal eval --num-processes 2` (torchrun, gloo on CPU, for real): lm-eval splits the requests over the ranks,
kvcal's kl splits its windows, rank 0 writes the one run directory — with the same results and samples as one
process. A rank killed mid-run (KVCAL_FAULT: SIGKILL at a fault point) stops the run with one Error line and
leaves the directory resumable; the rerun completes it."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from kvcal import parallel

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
    {"q": "a quick brown", "choices": ["fox", "dog"], "label": 0},
    {"q": "the dog sat on the", "choices": ["log", "mat"], "label": 0},
]
GEN_DOCS = [  # 3 documents over 2 ranks: lm-eval pads rank 1 with a copy of its last request
    {"q": "what is two plus two ?", "a": "four"},
    {"q": "the quick brown", "a": "fox"},
    {"q": "one two", "a": "three"},
]
GEN_KWARGS = {"until": ["\n"], "max_gen_toks": 5, "do_sample": False}


@pytest.fixture(scope="module")
def setup(
    tmp_path_factory: pytest.TempPathFactory,
    tiny_lm_dir: Callable[..., Path],
    lm_eval_task: Callable[..., None],
) -> dict[str, Path]:
    tasks = tmp_path_factory.mktemp("dp_tasks")
    lm_eval_task(tasks, "dp_mc", "multiple_choice", MC_DOCS, ["acc", "acc_norm"])
    lm_eval_task(tasks, "dp_gen", "generate_until", GEN_DOCS, ["exact_match"], generation_kwargs=GEN_KWARGS)
    return {"model": tiny_lm_dir("llama", CORPUS), "tasks": tasks, "root": tmp_path_factory.mktemp("dp")}


def _args(setup: dict[str, Path], out: Path, *extra: str) -> list[str]:
    return [
        "eval", str(setup["model"]), "-f", "fp8_e4m3", "--tasks", "dp_mc,dp_gen,kl",
        "--include-path", str(setup["tasks"]), "--limit", "5", "--kl-seq-len", "16", "--batch-size", "2",
        "-o", str(out), *extra,
    ]  # fmt: skip


def _results(run: Path) -> dict[str, Any]:
    res = json.loads((run / "results.json").read_text())
    res["configs"]["kl"].pop("baseline_cache_hits")  # how many kl baselines were cached already: not a result
    return {k: res[k] for k in ("results", "configs", "versions", "n-shot", "n-samples", "higher_is_better")}


@pytest.mark.slow
def test_two_processes_equal_one_and_a_lost_rank_leaves_the_run_resumable(
    setup: dict[str, Path],
    invoke: Callable[[list[str]], tuple[int, str, str]],
    monkeypatch: pytest.MonkeyPatch,
    capfd: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setenv("KVCAL_CACHE", str(setup["root"] / "cache"))
    monkeypatch.setenv(parallel.TIMEOUT_ENV, "120")
    one, two = setup["root"] / "one", setup["root"] / "two"
    code, _, err = invoke(_args(setup, one))
    assert code == 0, err

    # rank 1 dies (SIGKILL) after its first kl window: dp_mc and dp_gen are saved, kl is not
    monkeypatch.setenv(parallel.FAULT_ENV, "1:kl-window:1")
    code, _, _ = invoke(_args(setup, two, "--num-processes", "2"))
    errors = [line for line in capfd.readouterr().err.splitlines() if line.startswith("Error:")]
    assert code == 1
    assert len(errors) == 1 and "rank 1 was killed by SIGKILL" in errors[0] and "resume" in errors[0]
    assert not (two / "COMPLETE").exists() and not (two / "results.json").exists()
    assert sorted(p.name for p in (two / "tasks").iterdir()) == ["dp_gen.json", "dp_mc.json"]

    monkeypatch.delenv(parallel.FAULT_ENV)
    code, _, _ = invoke(_args(setup, two, "--num-processes", "2"))
    assert code == 0, capfd.readouterr().err[-3000:]
    assert (two / "COMPLETE").is_file()
    assert _results(two) == _results(one)
    for task in ("dp_mc", "dp_gen", "kl"):  # every sample record, in one process's order
        assert (two / f"samples_{task}.jsonl").read_bytes() == (one / f"samples_{task}.jsonl").read_bytes()
    assert (two / "config.yaml").read_text() == (one / "config.yaml").read_text()  # one run identity


def test_more_processes_than_samples_is_one_error_line(
    setup: dict[str, Path], invoke: Callable[[list[str]], tuple[int, str, str]]
) -> None:
    out = setup["root"] / "never"
    args = _args(setup, out, "--num-processes", "3")
    code, _, err = invoke([*args[: args.index("--limit") + 1], "2", *args[args.index("--limit") + 2 :]])
    assert code == 2 and err.strip().splitlines() == [
        "Error: 2 samples (--limit) cannot be split over 3 processes; use --num-processes 2 or fewer, or more "
        "samples (--limit)"
    ]
    code, _, err = invoke(_args(setup, out, "--num-processes", "0"))
    assert code == 2 and err.strip() == "Error: --num-processes must be at least 1, got 0"
    assert not out.exists()


def test_tensor_parallel_rank_holds_its_heads_scales(tiny_llama_dir: Path) -> None:
    """Under tp_plan, rank r's attention writes KV heads heads_of_rank(H_kv, r, N): its cache and its attention
    modules get those heads' scales (2 KV heads over 2 ranks: rank 1 keeps head 1's)."""
    from transformers import AutoModelForCausalLM

    from kvcal.kernels.runtime import KVRuntime, attention_modules, shard_by_head
    from kvcal.models.geometry import kv_spec
    from kvcal.scales import compute_binding, make_scale_set

    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32)
    kv = kv_spec(model.config)
    assert kv.layers[0].kv_heads == 2
    k = [torch.tensor([0.01 * (i + 1), 0.02 * (i + 1)]) for i in range(kv.num_layers)]
    v = [torch.tensor([0.03, 0.05]) for _ in range(kv.num_layers)]
    scales = make_scale_set(
        "fp8_e4m3",
        "head",
        k,
        v,
        observer="minmax",
        binding=compute_binding(str(tiny_llama_dir), tiny_llama_dir, kv),
    )
    rt = KVRuntime(model, "fp8_e4m3", scales=scales)
    shard_by_head(rt, parallel.Dist(rank=1, world_size=2))
    for i, plan in enumerate(rt.plans):
        assert torch.equal(plan.k_scale, k[i][1:]) and torch.equal(plan.v_scale, v[i][1:])
    mods = attention_modules(model)
    assert all(mods[i].kvcal_config.plan is rt.plans[i] for i in mods)
