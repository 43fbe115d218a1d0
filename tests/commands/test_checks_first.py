"""Checks before work (issue 43, item 1): what a run will refuse is refused before a model loads or an output folder
or run directory records anything, so the corrected rerun is the same configuration, not "a different one"."""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.usefixtures("one_thread")

Invoke = Callable[[list[str]], tuple[int, str, str]]
DOCS = [{"q": "the cat sat on the", "choices": [" mat", " log"], "label": 0},
        {"q": "one two three", "choices": [" four", " cat"], "label": 0}]  # fmt: skip


@pytest.fixture
def loads(monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, int]]:
    """Counts HFLM model loads (lm-eval's, which kvcal eval's model is) through the real class."""
    from lm_eval.models.huggingface import HFLM

    seen = {"n": 0}
    real = HFLM.__init__

    @functools.wraps(real)
    def counted(self: Any, *args: Any, **kwargs: Any) -> None:
        seen["n"] += 1
        real(self, *args, **kwargs)

    monkeypatch.setattr(HFLM, "__init__", counted)
    yield seen


def test_repeats_on_a_loglikelihood_task_is_refused_before_the_run_directory(
    tiny_llama_dir: Path, tmp_path: Path, invoke: Invoke, lm_eval_task: Callable[..., None], loads: dict[str, int]
) -> None:
    """Before: the model loaded, config.yaml recorded repeats 4, then the task refused it — and the rerun without
    --repeats was refused as another configuration of that run directory."""
    tasks = tmp_path / "tasks"
    lm_eval_task(tasks, "first_mc", "multiple_choice", DOCS, ["acc"])
    run = tmp_path / "out" / "run"
    base = ["eval", str(tiny_llama_dir), "-f", "fp8", "--tasks", "first_mc", "--include-path", str(tasks),
            "-o", str(run)]  # fmt: skip
    code, _, err = invoke([*base, "--repeats", "4"])
    assert code == 2 and err.count("Error:") == 1 and "--repeats applies to generative tasks" in err, err
    assert loads["n"] == 0 and not (tmp_path / "out").exists()
    code, _, err = invoke(base)  # the corrected rerun runs
    assert code == 0, err
    assert (run / "COMPLETE").exists() or any(run.iterdir())


@pytest.mark.parametrize(
    "args",
    [
        ["eval", "{missing}", "-f", "fp8", "--tasks", "kl", "-o", "{out}/run"],
        ["calibrate", "{missing}", "-f", "fp8", "-o", "{out}/s.safetensors"],
        ["export", "{scales}", "{missing}", "--to", "vllm", "-o", "{out}/vllm"],
        ["plan", "{missing}", "--capacity", "1.5x", "-o", "{out}/p.json"],
        ["release", "{missing}", "-c", "{yaml}", "-o", "{out}/release"],
    ],
    ids=lambda a: a[0],
)
def test_a_missing_model_creates_no_output_folder(args: list[str], tmp_path: Path, invoke: Invoke) -> None:
    (tmp_path / "r.yaml").write_text("ship: {kv_format: fp8_e4m3}\n")
    (tmp_path / "s.safetensors").write_bytes(b"")
    fill = {"missing": str(tmp_path / "no-such-model"), "out": str(tmp_path / "out"),
            "scales": str(tmp_path / "s.safetensors"), "yaml": str(tmp_path / "r.yaml")}  # fmt: skip
    code, _, err = invoke([a.format(**fill) for a in args])
    assert code in (1, 2) and err.count("Error:") == 1, err
    assert not (tmp_path / "out").exists()
