"""`kvcal eval --scales first-batch` end to end on a tiny model: recorded in config.yaml and the run name, the
scales fixed by the first batch of the first task survive the kl task's BF16 baseline (which swaps the runtime)."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

pytestmark = pytest.mark.slow  # two lm-eval runs on a tiny model

CORPUS = [
    "the cat sat on the mat and the dog sat on the log",
    "one two three four five six seven eight nine ten",
    "paris is the capital of france and rome is the capital of italy",
]
MC_DOCS = [
    {"q": "the cat sat on the", "choices": ["mat", "dog", "river"], "label": 0},
    {"q": "paris is the capital of", "choices": ["italy", "france"], "label": 1},
]


def test_first_batch_run_records_and_keeps_its_scales(
    tmp_path: Path, tiny_lm_dir: Callable[..., Path], lm_eval_task: Callable[..., None]
) -> None:
    from kvcal.errors import UsageError
    from kvcal.evaluate.run import EvalConfig, run_dir_name, run_eval
    from kvcal.evaluate.spec import eval_spec

    model = tiny_lm_dir("gemma3", CORPUS)
    lm_eval_task(tmp_path / "tasks", "fb_mc", "multiple_choice", MC_DOCS, ["acc"])

    def config(out: str, tasks: list[str]) -> EvalConfig:
        return EvalConfig(
            model=str(model),
            kv_format="fp8_e4m3",
            scales="first-batch",
            tasks=tasks,
            include_path=str(tmp_path / "tasks"),
            limit=2,
            kl_seq_len=16,
            batch_size=2,
            output=str(tmp_path / out),
        )

    assert "__fp8_e4m3__first-batch__" in run_dir_name(config("x", ["fb_mc"]))
    alone = run_eval(eval_spec(config("alone", ["fb_mc"])))
    both = run_eval(eval_spec(config("both", ["fb_mc", "kl"])))
    recorded = yaml.safe_load((both / "config.yaml").read_text())
    assert recorded["scale_source"] == "first-batch" and recorded["scales_path"] is None
    assert recorded["kv_input_dtype"] == "bfloat16"
    fixed = [json.loads((d / "results.json").read_text())["kvcal"]["runtime"] for d in (alone, both)]
    assert fixed[0]["scale_source"].startswith("first-batch")
    scales = [f["first_batch_scales"] for f in fixed]
    assert all(s is not None for s in scales[0]["k"] + scales[0]["v"])
    assert scales[1] == scales[0]  # the kl task (and its baseline) did not recompute them
    with pytest.raises(UsageError, match="first-batch"):
        run_eval(eval_spec(EvalConfig(model=str(model), kv_format="mxfp4", scales="first-batch", tasks=["kl"])))
