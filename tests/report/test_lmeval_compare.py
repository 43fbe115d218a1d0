"""lm-eval's own output in kvcal compare (issue 23, item 1), made by running lm-eval's CLI here on a tiny model:
`lm_eval --model hf ... --log_samples --output_path` and `kvcal-lm-eval --model kvcal ... kv_format=fp8_e4m3`
(both into one folder: two results files), against `kvcal eval`'s run directories of the same configurations.
The paired differences, intervals and gate verdicts are the same either way, and mixed; a different n-shot is
a different --limit are refused naming them."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from kvcal.errors import UsageError
from kvcal.report.compare import Comparison, compare_runs
from kvcal.report.lmeval_runs import RESULTS_PREFIX, date_id_of

pytestmark = pytest.mark.slow  # six lm-eval / kvcal eval processes on a tiny model

CORPUS = [
    "the cat sat on the mat and the dog sat on the log",
    "question : what is two plus two ? answer : four",
    "one two three four five six seven eight nine ten",
]
MC_DOCS = [{"q": f"the cat sat on the {w}", "choices": ["mat", "dog", "log"], "label": i % 3}
           for i, w in enumerate("one two three four five six seven eight nine ten cat dog".split())]  # fmt: skip
GEN_DOCS = [{"q": f"what is {w} plus two ?", "a": "four"}
            for w in "one two three four five six seven eight nine ten cat dog".split()]  # fmt: skip
GEN_KWARGS = {"until": ["\n"], "max_gen_toks": 4, "do_sample": False}
TASKS = "tiny_mc,tiny_gen"


def _run(args: list[str], cwd: Path) -> None:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
           "PYTHONPATH": str(Path(__file__).resolve().parents[2])}  # fmt: skip
    proc = subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]


@pytest.fixture(scope="module")
def outputs(
    tmp_path_factory: pytest.TempPathFactory, tiny_lm_dir: Callable[..., Path], lm_eval_task: Callable[..., None]
) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("lmeval_compare")
    model = tiny_lm_dir("llama", CORPUS, k_gain=8.0)  # larger K: FP8's error shows in a random model's outputs
    tasks = root / "tasks"
    lm_eval_task(tasks, "tiny_mc", "multiple_choice", MC_DOCS, ["acc", "acc_norm"])
    lm_eval_task(tasks, "tiny_gen", "generate_until", GEN_DOCS, ["exact_match"], generation_kwargs=GEN_KWARGS)
    common = ["--include_path", str(tasks), "--log_samples", "--device", "cpu", "--batch_size", "2"]
    both = root / "lm_eval_out"
    # lm-eval's own CLI, its hf backend; then kvcal's model through lm-eval's CLI into the same --output_path
    _run(["-m", "lm_eval", "--model", "hf", "--model_args", f"pretrained={model},dtype=float32",
          "--tasks", TASKS, "--output_path", str(both), *common], root)  # fmt: skip
    _run(["-m", "kvcal.evaluate.lm_eval_cli", "--model", "kvcal", "--model_args",
          f"pretrained={model},dtype=float32,kv_format=fp8_e4m3", "--tasks", TASKS, "--output_path", str(both),
          *common], root)  # fmt: skip
    shot = root / "one_shot"
    _run(["-m", "lm_eval", "--model", "hf", "--model_args", f"pretrained={model},dtype=float32",
          "--tasks", "tiny_gen", "--num_fewshot", "1", "--output_path", str(shot), *common], root)  # fmt: skip
    six = root / "limit_six"
    _run(["-m", "lm_eval", "--model", "hf", "--model_args", f"pretrained={model},dtype=float32",
          "--tasks", TASKS, "--limit", "6", "--output_path", str(six), *common], root)  # fmt: skip
    runs = root / "runs"
    for fmt in ("auto", "fp8_e4m3"):
        _run(["-m", "kvcal.cli", "eval", str(model), "--kv-format", fmt, "--tasks", TASKS,
              "--include-path", str(tasks), "--batch-size", "2", "-o", str(runs / fmt)], root)  # fmt: skip
    (folder,) = [d for d in both.iterdir() if d.is_dir()]
    first, last = sorted(date_id_of(f) for f in folder.glob(f"{RESULTS_PREFIX}*.json"))
    return {"both": both, "first": Path(f"{both}@{first}"), "last": Path(f"{both}@{last}"), "shot": shot, "six": six,
            "auto": runs / "auto", "fp8": runs / "fp8_e4m3"}  # fmt: skip


def _numbers(c: Comparison) -> list[tuple]:
    return sorted(
        (r.task, r.label, r.n, r.base, r.score, r.diff, r.ci_low, r.ci_high, r.p_value, r.status, r.gate_fail)
        for r in c.results
    )


def test_lm_eval_folders_compare_like_run_directories(outputs: dict[str, Path]) -> None:
    labels = [f"auto={outputs['first']}", f"fp8={outputs['both']}"]
    lm = compare_runs([outputs["first"], outputs["both"]], labels=labels, n_boot=500)
    kv = compare_runs([outputs["auto"], outputs["fp8"]], baseline="auto", n_boot=500)
    mixed = compare_runs([outputs["auto"], outputs["both"]], baseline="auto", n_boot=500)
    assert {r.task for r in lm.results} == {"tiny_mc", "tiny_gen"}  # generative and multiple choice
    assert lm.baseline == "auto" and lm.config("fp8").kv_format == "fp8_e4m3"
    assert all(r.n == 12 for r in lm.results)
    assert _numbers(lm) == _numbers(kv) == _numbers(mixed)
    assert lm.config_gate("fp8") == kv.config_gate("fp8_e4m3") == mixed.config_gate(mixed.configs[1].label)
    # the latest results file is the default: the folder alone is the FP8 run
    assert compare_runs([outputs["first"], outputs["last"]], n_boot=500).results[0].diff == lm.results[0].diff


def test_mismatched_n_shot_is_refused(outputs: dict[str, Path]) -> None:
    with pytest.raises(UsageError, match=r"tiny_gen: .* different task settings \(num_fewshot 1 vs 0"):
        compare_runs([outputs["first"], outputs["shot"]], baseline="lm_eval_out", n_boot=200)


def test_mismatched_limit_is_refused(outputs: dict[str, Path]) -> None:
    """`lm_eval --limit 6` against all 12 documents: an lm-eval folder, and a kvcal run directory, each refused."""
    want = r"tiny_(mc|gen): limit_six and the baseline \S+ ran different --limit \(6 \(6 documents\) vs none \(12 documents\)"
    with pytest.raises(UsageError, match=want):
        compare_runs([outputs["first"], outputs["six"]], baseline="lm_eval_out", n_boot=200)
    with pytest.raises(UsageError, match=want):
        compare_runs([outputs["auto"], outputs["six"]], baseline="auto", n_boot=200)
