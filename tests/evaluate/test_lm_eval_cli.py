"""`kvcal-lm-eval --data-dir` (issue 27, item 3): lm-eval's own CLI reaches kvcal's offline task data with no
network, exactly as `kvcal eval --data-dir` does — the same task config, the same documents, the same numbers —
and kvcal's own options are refused with one `Error:` line where they cannot work."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from kvcal.errors import UsageError
from kvcal.evaluate.lm_eval_cli import OfflineData, split_argv

REPO = Path(__file__).resolve().parents[2]
CORPUS = ["the cat sat on the mat and the dog sat on the log", "one two three four five six seven eight nine"]
ROWS = [
    " = Cats = ",
    "",
    " the cat sat on the mat and the dog sat on the log . ",
    "",
    " = = History = = ",
    " one two three four five six seven eight nine ten . ",
    " = Dogs = ",
    "",
    " the dog sat on the log and the cat sat on the mat . ",
    " = Numbers = ",
    " nine eight seven six five four three two one . ",
]


def _cli(args: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "PYTHONPATH": str(REPO)}
    env.pop("KVCAL_DEBUG", None)
    return subprocess.run(
        [sys.executable, "-m", "kvcal.evaluate.lm_eval_cli", *args],
        cwd=cwd, env=env, capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A --data-dir laid out like ../shared/data holding only WikiText-2's test rows (HF `wikitext` rows)."""
    root = tmp_path_factory.mktemp("offline-data")
    (root / "wikitext2").mkdir()
    lines = [json.dumps({"text": row + "\n" if row else ""}) for row in ROWS]
    (root / "wikitext2" / "test.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
    return root


def test_split_argv_takes_kvcal_options_out_in_order() -> None:
    data, rest = split_argv(
        ["--model", "kvcal", "--data-dir", "D", "--tasks", "wikitext", "--gpqa-password=p"]
    )
    assert data == OfflineData("D", "p") and rest == ["--model", "kvcal", "--tasks", "wikitext"]
    assert split_argv(["--tasks", "wikitext"]) == (OfflineData(), ["--tasks", "wikitext"])
    with pytest.raises(UsageError, match="--gpqa-password reads GPQA from --data-dir"):
        split_argv(["--gpqa-password", "p"])


@pytest.mark.slow
def test_offline_wikitext_equals_kvcal_eval(
    tmp_path: Path,
    data_dir: Path,
    tiny_lm_dir: Callable[..., Path],
    invoke: Callable[[list[str]], tuple[int, str, str]],
) -> None:
    """No network (HF_DATASETS_OFFLINE=1): without --data-dir lm-eval would have to reach the hub's
    EleutherAI/wikitext_document_level; with it, each document's log-likelihood equals kvcal eval's bit for bit."""
    model = tiny_lm_dir("llama", CORPUS)
    # kv_input_dtype given as kvcal eval's default (bfloat16): what both doors take when it is not given
    out = tmp_path / "lm_eval_out"
    args = ["--model", "kvcal", "--model_args", f"pretrained={model},dtype=float32,kv_format=fp8_e4m3,kv_input_dtype=bfloat16",
            "--tasks", "wikitext", "--data-dir", str(data_dir), "--limit", "3", "--device", "cpu",
            "--log_samples", "--output_path", str(out)]  # fmt: skip
    proc = _cli(args, tmp_path)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    (samples,) = out.glob("*/samples_wikitext_*.jsonl")
    ours = [json.loads(line) for line in samples.read_text(encoding="utf-8").splitlines()]
    run = tmp_path / "run"
    rc, _, err = invoke(["eval", str(model), "--kv-format", "fp8_e4m3", "--dtype", "float32", "--tasks",
                         "wikitext", "--data-dir", str(data_dir), "--limit", "3", "-o", str(run)])  # fmt: skip
    assert rc == 0, err
    theirs = [json.loads(line) for line in (run / "samples_wikitext.jsonl").read_text().splitlines()]
    assert len(ours) == len(theirs) == 3
    assert [s["doc"]["page"] for s in ours] == [s["doc"]["page"] for s in theirs]
    # lm-eval's samples file writes the log-likelihood as a string, kvcal's as a number: the same float32
    assert [float(s["resps"][0][0]) for s in ours] == [float(s["resps"][0][0]) for s in theirs]


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (
            ["--tasks", "wikitext", "--data-dir", "no/such/folder"],
            "--data-dir 'no/such/folder' is not a folder",
        ),
        (["--tasks", "kl"], "task(s) kl are kvcal's own, not lm-eval tasks; run them with `kvcal eval"),
        (["--tasks", "wikitextt"], "wikitext"),  # an unknown name: kvcal's close-match message
    ],
)
def test_bad_input_is_one_error_line(
    tmp_path: Path, data_dir: Path, tiny_lm_dir: Callable[..., Path], extra: list[str], message: str
) -> None:
    model = tiny_lm_dir("llama", CORPUS)
    if "--data-dir" not in extra:
        extra = [*extra, "--data-dir", str(data_dir)]
    proc = _cli(["--model", "kvcal", "--model_args", f"pretrained={model}", *extra], tmp_path)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert lines[-1].startswith("Error: ") and message in lines[-1], proc.stderr[-3000:]
    assert not any("Traceback" in line for line in lines)
