"""Conformance on real lm-eval output folders (issue 38, item 3), made here by lm-eval's own CLI on a tiny model.

`lm_eval --model hf` (its BF16 stand-in: the model's own cache) and `kvcal-lm-eval --model kvcal
kv_format=fp8_e4m3,kv_input_dtype=bfloat16` write the folders an engine's `lm_eval --model vllm ... --log_samples
--output_path P` writes (results_<date>.json, samples_<task>_<date>.jsonl); they stand in for an engine's FOLDER
FORMAT only (what is parsed: config.model_args, the results' max_length, the task configs) — neither is an engine.
(kv_input_dtype=bfloat16 is kvcal eval's default K/V input and the adapter's; kv_input_dtype=float32, K/V as
computed, moves this model's FP8 damage by ~1e-4 nats per word: a third folder, found "not equivalent" at a 1e-5
margin.) kvcal eval's run
directories are the emulation side. First the hf run is given other settings than the emulation (dtype bfloat16,
max_length 16 against float32 and the model's 256 positions): refused with one Error naming each. Then on the same
settings the verdict is computed: the two sides are one implementation here, so their BF16 runs agree on every
document (margin 0: not judged, --margin asked for) and with --margin their damage is equivalent."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from kvcal.errors import UsageError
from kvcal.report.compare import compare_runs
from kvcal.report.conformance import EQUIVALENT, NOT_EQUIVALENT, add_conformance, before_pairing

pytestmark = pytest.mark.slow  # six lm-eval / kvcal eval processes on a tiny model

CORPUS = [
    "the cat sat on the mat and the dog sat on the log while the bird sang",
    "one two three four five six seven eight nine ten eleven twelve",
    "paris is the capital of france and rome is the capital of italy",
]
DOCS = [{"text": f"{CORPUS[i % 3]} {w}"} for i, w in enumerate("a b c d e f g h i j k l".split())]


def _run(args: list[str], cwd: Path) -> None:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
           "PYTHONPATH": str(Path(__file__).resolve().parents[2])}  # fmt: skip
    proc = subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]


@pytest.fixture(scope="module")
def outputs(
    tmp_path_factory: pytest.TempPathFactory, tiny_lm_dir: Callable[..., Path], lm_eval_task: Callable[..., None]
) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("lmeval_conformance")
    model = tiny_lm_dir("llama", CORPUS, k_gain=8.0)  # larger K: FP8's error shows in a random model
    tasks = root / "tasks"
    lm_eval_task(tasks, "tiny_roll", "loglikelihood_rolling", DOCS, ["word_perplexity"])
    common = ["--include_path", str(tasks), "--tasks", "tiny_roll", "--log_samples", "--device", "cpu"]
    out = {}
    out["hf_unlike"] = root / "hf_unlike"
    _run(["-m", "lm_eval", "--model", "hf", "--model_args", f"pretrained={model},dtype=bfloat16,max_length=16",
          "--output_path", str(out["hf_unlike"]), *common], root)  # fmt: skip
    out["hf"] = root / "hf"
    _run(["-m", "lm_eval", "--model", "hf", "--model_args", f"pretrained={model},dtype=float32",
          "--output_path", str(out["hf"]), *common], root)  # fmt: skip
    out["kvcal_fp8"] = root / "kvcal_fp8"
    _run(["-m", "kvcal.evaluate.lm_eval_cli", "--model", "kvcal", "--model_args",
          f"pretrained={model},dtype=float32,kv_format=fp8_e4m3,kv_input_dtype=bfloat16", "--output_path", str(out["kvcal_fp8"]), *common],
         root)  # fmt: skip
    out["kvcal_fp8_as_computed"] = root / "kvcal_fp8_as_computed"  # K/V quantized as computed (float32 here)
    _run(["-m", "kvcal.evaluate.lm_eval_cli", "--model", "kvcal", "--model_args",
          f"pretrained={model},dtype=float32,kv_format=fp8_e4m3,kv_input_dtype=float32",
          "--output_path", str(out["kvcal_fp8_as_computed"]),
          *common], root)  # fmt: skip
    for fmt in ("auto", "fp8_e4m3"):  # auto: the model's own cache, as hf's (kvcal's bf16 rounds a float32 K/V)
        out[f"emu_{fmt}"] = root / "runs" / f"emu_{fmt}"
        _run(["-m", "kvcal.cli", "eval", str(model), "--kv-format", fmt, "--tasks", "tiny_roll",
              "--include-path", str(tasks), "-o", str(out[f"emu_{fmt}"])], root)  # fmt: skip
    return out


def _compare(paths: list[Path], pairs: list[str], refs: list[str], margin: float | None = None):  # noqa: ANN202
    c = compare_runs(paths, baseline="emu_auto", n_boot=200, min_samples=10,
                     before_pairing=before_pairing(pairs, refs, margin))  # fmt: skip
    add_conformance(c, pairs, references=refs, margin=margin)
    return c


def test_lm_eval_folders_parsed_and_unlike_settings_refused(outputs: dict[str, Path]) -> None:
    paths = [outputs["hf_unlike"], outputs["kvcal_fp8"], outputs["emu_auto"], outputs["emu_fp8_e4m3"]]
    with pytest.raises(UsageError) as exc:
        _compare(paths, ["kvcal_fp8=emu_fp8_e4m3"], ["hf_unlike=emu_auto"])
    msg = str(exc.value)
    # lm-eval's record of the hf run: model_args dtype, results' max_length (16 given, 256 the model's)
    runs = "kvcal_fp8 {}, emu_fp8_e4m3 {}, hf_unlike {}, emu_auto {}"
    assert "tiny_roll model dtype: " + runs.format(*["float32"] * 2, "bfloat16", "float32") in msg
    assert "tiny_roll max length: " + runs.format(256, 256, 16, 256) in msg
    assert "tiny_roll log-prob dtype: " + runs.format(*["float32"] * 2, "bfloat16", "float32") in msg  # HFLM's


def test_lm_eval_folders_damage_verdict(outputs: dict[str, Path]) -> None:
    paths = [outputs["hf"], outputs["kvcal_fp8"], outputs["emu_auto"], outputs["emu_fp8_e4m3"]]
    c = _compare(paths, ["kvcal_fp8=emu_fp8_e4m3"], ["hf=emu_auto"])
    (res,) = c.conformance
    (r,) = res.results
    assert r.n == len(DOCS) and r.unit == "nats per word" and r.margin == 0.0
    assert r.engine_damage > 0 and r.emulation_damage > 0  # fp8's damage shows on this model
    assert res.conforms is None and "pass --margin" in res.verdict  # identical BF16 runs: no margin of their own
    c = _compare(paths, ["kvcal_fp8=emu_fp8_e4m3"], ["hf=emu_auto"], margin=0.01)
    (r,) = c.conformance[0].results
    assert r.verdict == EQUIVALENT and abs(r.gap) < 1e-6  # one implementation through two doors


def test_lm_eval_folders_another_k_v_input_is_not_equivalent(outputs: dict[str, Path]) -> None:
    """The kvcal door with K/V quantized as computed (kv_input_dtype=float32) against kvcal eval's default (rounded
    to bf16 first): another cache, whose FP8 damage the test tells apart from the emulation's at --margin 0 ... 1e-5."""
    paths = [outputs["hf"], outputs["kvcal_fp8_as_computed"], outputs["emu_auto"], outputs["emu_fp8_e4m3"]]
    c = _compare(paths, ["kvcal_fp8_as_computed=emu_fp8_e4m3"], ["hf=emu_auto"], margin=1e-5)
    (res,) = c.conformance
    (r,) = res.results
    assert abs(r.gap) > 1e-5 and r.verdict == NOT_EQUIVALENT and res.conforms is False
    assert not c.gate_passed
