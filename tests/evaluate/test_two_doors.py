"""One configuration, one answer (issue 43, item 4): `kvcal-lm-eval --model kvcal --model_args
pretrained=M,dtype=float32,kv_format=F` and `kvcal eval M -f F --dtype float32` resolve the cache through the same
spec with the same defaults, so every format gives the same per-sample log-likelihoods through both doors; and lm-eval's results record kvcal's whole resolved configuration, which `kvcal compare` reads.

Both doors run for real: lm-eval's own entry (`simple_evaluate` for every format; its command line,
kvcal.evaluate.lm_eval_cli.main in this process, for a few) and kvcal's (the Typer app), on a tiny random Llama with head_dim 32 whose K is scaled up so that the formats' rounding shows in the scores."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from kvcal.formats import FORMATS, TQ_PRESETS

pytestmark = pytest.mark.usefixtures("one_thread")

Invoke = Callable[[list[str]], tuple[int, str, str]]
CORPUS = ["the cat sat on the mat and the dog sat on the log", "one two three four five six seven eight nine"]
DOCS = [
    {"q": "the cat sat on the", "choices": [" mat", " log", " dog"], "label": 0},
    {"q": "one two three four", "choices": [" five", " nine", " cat"], "label": 0},
    {"q": "the dog sat on the", "choices": [" log", " mat", " one"], "label": 0},
    {"q": "six seven eight", "choices": [" nine", " two", " sat"], "label": 0},
]
ALL_FORMATS = [*FORMATS, *TQ_PRESETS]


def _head_dim_32_llama(path: Path, tokenizer_from: Path, k_gain: float) -> Path:
    """A random Llama (seed 0, float32) with the tiny models' tokenizer and head_dim 32, so that every block format
    fits (mxfp4's block is 32), and 6 layers, so that a TurboQuant preset quantizes some (2 boundary layers each
    side stay BF16). K scaled by `k_gain`: the formats' rounding shows in the scores of a random model."""
    import shutil

    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tok = AutoTokenizer.from_pretrained(str(tokenizer_from))
    torch.manual_seed(0)
    cfg = LlamaConfig(
        hidden_size=64, intermediate_size=64, num_hidden_layers=6, num_attention_heads=2, num_key_value_heads=1,
        head_dim=32, vocab_size=len(tok), max_position_embeddings=256, bos_token_id=1, eos_token_id=2,
        pad_token_id=0,
    )  # fmt: skip
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.k_proj.weight.mul_(k_gain)
    model.save_pretrained(str(path))
    for f in tokenizer_from.iterdir():
        if "token" in f.name or f.name == "special_tokens_map.json":
            shutil.copy(f, path / f.name)
    return path


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory, tiny_lm_dir: Callable[..., Path],
          lm_eval_task: Callable[..., None]) -> tuple[Path, Path]:  # fmt: skip
    tasks = tmp_path_factory.mktemp("doors-tasks")
    lm_eval_task(tasks, "doors_mc", "multiple_choice", DOCS, ["acc"])
    model = _head_dim_32_llama(tmp_path_factory.mktemp("doors-llama"), tiny_lm_dir("llama", CORPUS), k_gain=8.0)
    return model, tasks


def _lm_eval(args: list[str], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    from kvcal.evaluate.lm_eval_cli import main

    monkeypatch.setattr(sys, "argv", ["kvcal-lm-eval", *args])
    code = 0
    try:
        main(args)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    return code, capsys.readouterr().err


def _lls(rows: list[dict[str, Any]]) -> dict[int, list[float]]:
    """doc_id -> the per-choice log-likelihoods (lm-eval writes them as strings, kvcal as numbers)."""
    return {int(r["doc_id"]): [float(resp[0][0]) for resp in r["resps"]] for r in rows}


def _read(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def _lm_eval_api(model: Path, tasks: Path, fmt: str) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """lm-eval's `simple_evaluate` with the `--model_args` string its CLI passes on: the samples and the recorded
    configuration. Its TaskManager indexes only the include path (lm-eval's CLI parses its ~14k built-in task
    YAMLs first, ~10 s a run here, the same for every format: the CLI door below runs on a few)."""
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    import kvcal.evaluate.adapter  # noqa: F401 - registers `--model kvcal`, as kvcal-lm-eval does

    res = simple_evaluate(
        model="kvcal", model_args=f"pretrained={model},dtype=float32,kv_format={fmt}", tasks=["doors_mc"],
        task_manager=TaskManager(include_path=str(tasks), include_defaults=False), device="cpu", log_samples=True,
    )  # fmt: skip
    return res["samples"]["doors_mc"], res["config"]["kvcal"]


def _kvcal_eval(model: Path, tasks: Path, fmt: str, run: Path, invoke: Invoke) -> tuple[dict[int, list[float]], dict]:
    import yaml

    code_k, _, err_k = invoke(["eval", str(model), "-f", fmt, "--dtype", "float32", "--tasks", "doors_mc",
                               "--include-path", str(tasks), "-o", str(run)])  # fmt: skip
    assert code_k == 0, err_k  # every format runs on this model: no door may refuse it
    return _lls(_read(run / "samples_doors_mc.jsonl")), yaml.safe_load((run / "config.yaml").read_text())


CONFIG_KEYS = ("kv_format", "kv_input_dtype", "nvfp4_global", "attention", "impl", "tq_boundary_layers", "dtype",
               "skip_layer_indices")  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ALL_FORMATS)
def test_every_format_gives_one_answer_through_both_doors(
    fmt: str, setup: tuple[Path, Path], tmp_path: Path, invoke: Invoke
) -> None:
    """lm-eval's `--model kvcal` (its Python entry, the adapter its CLI builds) and `kvcal eval`: the same
    per-choice log-likelihoods bit for bit, and the same resolved configuration, for every format."""
    model, tasks = setup
    samples, recorded = _lm_eval_api(model, tasks, fmt)
    ours, conf = _kvcal_eval(model, tasks, fmt, tmp_path / "run", invoke)
    assert len(ours) == len(DOCS) and _lls(samples) == ours  # bit for bit, every choice of every document
    for key in CONFIG_KEYS:  # lm-eval's record holds kvcal's resolved configuration, defaults included
        assert recorded.get(key) == conf.get(key), key


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["auto", "fp8_e4m3", "nvfp4", "turboquant_k8v4"])
def test_lm_eval_command_line_gives_kvcal_eval_answer(
    fmt: str, setup: tuple[Path, Path], tmp_path: Path, invoke: Invoke,
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
) -> None:  # fmt: skip
    """`kvcal-lm-eval --model kvcal ... --log_samples --output_path` (lm-eval's own command line, in this process)
    and `kvcal eval`: same samples, and lm-eval's results file records kvcal's configuration, which compare reads."""
    model, tasks = setup
    out = tmp_path / "lm_eval_out"
    code_l, err_l = _lm_eval(
        ["--model", "kvcal", "--model_args", f"pretrained={model},dtype=float32,kv_format={fmt}",
         "--tasks", "doors_mc", "--include_path", str(tasks), "--device", "cpu", "--log_samples",
         "--output_path", str(out)],
        monkeypatch, capsys,
    )  # fmt: skip
    run = tmp_path / "run"
    ours, conf = _kvcal_eval(model, tasks, fmt, run, invoke)
    assert code_l == 0, err_l[-3000:]
    (samples,) = out.glob("*/samples_doors_mc_*.jsonl")
    assert len(ours) == len(DOCS) and _lls(_read(samples)) == ours
    (results,) = out.glob("*/results_*.json")
    recorded = json.loads(results.read_text())["config"]["kvcal"]
    for key in CONFIG_KEYS:
        assert recorded.get(key) == conf.get(key), key
    # and kvcal compare reads it: the lm-eval run's configuration is the kvcal run's
    from kvcal.report.lmeval_runs import Source, load_lm_eval_run
    from kvcal.report.runs import load_run

    a, b = load_lm_eval_run(Source(out)).config, load_run(run).config
    for key in ("kv_format", "kv_input_dtype", "nvfp4_global", "dtype", "skip_layer_indices", "tq_boundary_layers"):
        assert getattr(a, key) == getattr(b, key), key


def test_the_default_kv_input_dtype_is_one_for_both_doors(setup: tuple[Path, Path]) -> None:
    """The cause of the 3.43-nat gap: lm-eval's door quantized K/V as computed (float32 here), kvcal eval rounded
    them to bfloat16 first. Both now take EvalConfig's default; an explicit value is kept."""
    from kvcal.evaluate.adapter import bind_model_args
    from kvcal.evaluate.spec import EvalConfig, eval_spec
    from kvcal.formats import DEFAULT_KV_INPUT_DTYPE

    model, _ = setup
    lm_door = bind_model_args(str(model), kv_format="nvfp4", kv_input_dtype=None, nvfp4_global=None)
    cli_door = eval_spec(EvalConfig(model=str(model), kv_format="nvfp4", tasks=["kl"]))
    assert lm_door.spec.cache.kv_input_dtype == cli_door.cache.kv_input_dtype == DEFAULT_KV_INPUT_DTYPE
    assert lm_door.spec.cache.nvfp4_global == cli_door.cache.nvfp4_global == "one"
    kept = bind_model_args(str(model), kv_format="nvfp4", kv_input_dtype="float32")
    assert kept.spec.cache.kv_input_dtype == "float32"
