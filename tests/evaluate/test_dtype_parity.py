"""`kvcal eval --kv-format auto` equals plain lm-eval (`--model hf`) on the same settings.

lm-eval's HFLM loads a checkpoint in its own dtype (dtype="auto"); so must kvcal. The check runs on a tiny
checkpoint SAVED in bfloat16 (where a float32 default would change every log-likelihood): results and per-sample
responses are identical, and config.yaml records the dtype that was resolved. One setting differs by default
(issue 38): kvcal computes log-likelihoods' log-softmax and sums in float32 whatever the model's dtype, HFLM in the
model's dtype (softmax_dtype None). So kvcal at its defaults equals `lm_eval --model hf` given
`softmax_dtype=float32`, and `kvcal eval --logprob-dtype model` equals `lm_eval --model hf` at its defaults, each
also with the same `max_length` (the rolling window).
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


def _plain_lm_eval(model: Path, task_dir: Path, extra: str = "") -> dict[str, Any]:
    """`lm_eval --model hf --model_args pretrained=MODEL[,extra] --include_path TASKS --tasks ... --device cpu`."""
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    return simple_evaluate(
        model="hf",
        model_args=f"pretrained={model}" + (f",{extra}" if extra else ""),
        tasks=list(TASKS),
        task_manager=TaskManager(include_path=str(task_dir), include_defaults=False),
        device="cpu",
        log_samples=True,
    )


@pytest.mark.parametrize(
    ("ours", "theirs"),
    [({}, "softmax_dtype=float32"), ({"logprob_dtype": "model"}, ""),
     ({"max_length": 16}, "softmax_dtype=float32,max_length=16")],
    ids=["float32-default", "model-dtype-on-request", "max-length"],
)  # fmt: skip
def test_auto_equals_plain_lm_eval_on_a_bf16_checkpoint(
    bf16_model: Path, task_dir: Path, tmp_path: Path, ours: dict[str, Any], theirs: str
) -> None:
    from kvcal.evaluate.run import EvalConfig, run_eval
    from kvcal.evaluate.spec import eval_spec

    ref = json.loads(json.dumps(_plain_lm_eval(bf16_model, task_dir, theirs), default=str))
    run = run_eval(eval_spec(
        EvalConfig(
            model=str(bf16_model),
            tasks=[",".join(TASKS)],
            include_path=str(task_dir),
            output=str(tmp_path / "run"),
            **ours,
        )
    ))
    ours_res = json.loads((run / "results.json").read_text())
    cfg = yaml.safe_load((run / "config.yaml").read_text())
    assert cfg["dtype"] == "bfloat16" and ours_res["config"]["dtype"] == "bfloat16"
    # recorded: the log-prob dtype (a 16-bit model), the window given and the one used (as lm-eval records it)
    assert cfg["logprob_dtype"] == ours.get("logprob_dtype", "float32")
    assert cfg.get("max_length") == ours.get("max_length")
    assert ours_res["max_length"] == ref["max_length"] == ours.get("max_length", 256)
    for task in TASKS:
        assert ours_res["results"][task] == ref["results"][task]
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
