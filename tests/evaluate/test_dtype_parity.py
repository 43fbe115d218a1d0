"""`kvcal eval --kv-format auto` at its defaults equals plain lm-eval (`--model hf`) at its defaults.

lm-eval's HFLM loads a checkpoint in its own dtype (dtype="auto"); so must kvcal. The check runs on a tiny
checkpoint SAVED in bfloat16 (where a float32 default would change every log-likelihood): results and per-sample
responses are identical, and config.yaml records the dtype that was resolved.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

CORPUS = [
    "the cat sat on the mat and the dog sat on the log",
    "one two three four five six seven eight nine ten",
    "paris is the capital of france and rome is the capital of italy",
]
MC_DOCS = [
    {"q": "the cat sat on the", "choices": ["mat", "dog", "river"], "label": 0},
    {"q": "paris is the capital of", "choices": ["italy", "france"], "label": 1},
]
ROLL_DOCS = [{"text": t} for t in CORPUS]
# name -> (output type, docs, metrics) of the two local lm-eval tasks.
TASKS = {
    "bf16_mc": ("multiple_choice", MC_DOCS, ["acc"]),
    "bf16_roll": ("loglikelihood_rolling", ROLL_DOCS, ["word_perplexity"]),
}


@pytest.fixture(scope="module")
def bf16_model(tiny_lm_dir: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Llama re-saved in bfloat16 (config.json says bfloat16, the safetensors hold BF16)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src = tiny_lm_dir("llama", CORPUS)
    out = tmp_path_factory.mktemp("bf16-llama")
    AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.bfloat16).save_pretrained(str(out))
    AutoTokenizer.from_pretrained(str(src)).save_pretrained(str(out))
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    return out


@pytest.fixture(scope="module")
def task_dir(tmp_path_factory: pytest.TempPathFactory, lm_eval_task: Callable[..., None]) -> Path:
    d = tmp_path_factory.mktemp("bf16-tasks")
    for name, (output_type, docs, metrics) in TASKS.items():
        lm_eval_task(d, name, output_type, docs, metrics)
    return d


def _plain_lm_eval(model: Path, task_dir: Path) -> dict[str, Any]:
    """`lm_eval --model hf --model_args pretrained=MODEL --include_path TASKS --tasks ... --device cpu`."""
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    return simple_evaluate(
        model="hf",
        model_args=f"pretrained={model}",
        tasks=list(TASKS),
        task_manager=TaskManager(include_path=str(task_dir), include_defaults=False),
        device="cpu",
        log_samples=True,
    )


def test_auto_at_defaults_equals_plain_lm_eval_on_a_bf16_checkpoint(
    bf16_model: Path, task_dir: Path, tmp_path: Path
) -> None:
    from kvcal.evaluate.run import EvalConfig, run_eval
    from kvcal.evaluate.spec import eval_spec

    ref = json.loads(json.dumps(_plain_lm_eval(bf16_model, task_dir), default=str))
    run = run_eval(eval_spec(
        EvalConfig(
            model=str(bf16_model),
            tasks=[",".join(TASKS)],
            include_path=str(task_dir),
            output=str(tmp_path / "run"),
        )
    ))
    ours = json.loads((run / "results.json").read_text())
    assert yaml.safe_load((run / "config.yaml").read_text())["dtype"] == "bfloat16"
    assert ours["config"]["dtype"] == "bfloat16"
    for task in TASKS:
        assert ours["results"][task] == ref["results"][task]
        mine = [json.loads(line) for line in (run / f"samples_{task}.jsonl").read_text().splitlines()]
        assert [(s["resps"], s["filtered_resps"]) for s in mine] == [
            (s["resps"], s["filtered_resps"]) for s in ref["samples"][task]
        ]
    # not vacuous: real log-likelihoods came out
    assert ref["results"]["bf16_roll"]["word_perplexity,none"] > 1.0


def test_dtype_auto_resolves_like_transformers(
    bf16_model: Path, tiny_lm_dir: Callable[..., Path], tmp_path: Path
) -> None:
    from kvcal.errors import UsageError
    from kvcal.models.config import load_config
    from kvcal.models.loading import resolve_dtype

    tiny = tiny_lm_dir("llama", CORPUS)
    assert resolve_dtype("auto", bf16_model, load_config(bf16_model)) == "bfloat16"
    assert resolve_dtype("auto", tiny, load_config(tiny)) == "float32"
    assert resolve_dtype("float32", bf16_model) == "float32"
    # no dtype in config.json: the first floating tensor of the safetensors files decides, as in transformers
    bare = tmp_path / "bare"
    shutil.copytree(bf16_model, bare)
    cfg = json.loads((bare / "config.json").read_text())
    (bare / "config.json").write_text(json.dumps({k: v for k, v in cfg.items() if k != "dtype"}))
    assert resolve_dtype("auto", bare, load_config(bare)) == "bfloat16"
    with pytest.raises(UsageError, match="unknown dtype"):
        resolve_dtype("float8", bf16_model)
