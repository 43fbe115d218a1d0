"""`kvcal sensitivity` end to end on a tiny random-weight Llama (wiring only): its options reach
kvcal.pipeline.sensitivity by name, --json and the table render the same report."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

Invoke = Callable[[list[str]], tuple[int, str, str]]  # the `invoke` fixture of tests/conftest.py


def test_sensitivity_json_and_table(tiny_llama_dir: Path, tmp_path: Path, invoke: Invoke) -> None:
    out = tmp_path / "sens.json"
    args = ["sensitivity", str(tiny_llama_dir), "-f", "fp4_e2m1", "--num-samples", "2", "--seq-len", "16"]
    code, stdout, err = invoke([*args, "-o", str(out), "--json"])
    assert code == 0, err
    report = json.loads(stdout)
    assert report == json.loads(out.read_text())
    assert report["kv_format"] == "fp4_e2m1" and len(report["layers"]) == 3
    assert all(row["kl"] > 0 for row in report["layers"])

    code, stdout, err = invoke(args)
    assert code == 0, err
    assert "suggested --skip-layers" in stdout and f"{report['all_layers']['kl']:.3g}" in stdout


def test_sensitivity_bad_format_exits_2(tiny_llama_dir: Path, invoke: Invoke) -> None:
    code, _, err = invoke(["sensitivity", str(tiny_llama_dir), "-f", "fp9"])
    assert code == 2, err
    [line] = err.splitlines()  # one line: no progress bar was started for refused input
    assert line.startswith("Error: unknown KV format 'fp9'; valid formats:")
