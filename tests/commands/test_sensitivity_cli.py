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


def test_marks_are_the_suggestion_and_the_scale_policy_is_evals(
    tiny_llama_dir: Path, tmp_path: Path, invoke: Invoke
) -> None:
    """◀ marks exactly the layers the suggested --skip-layers keeps in BF16 (a low --factor flags some), and
    without --scales nvfp4's global scale is 1.0 as in `kvcal eval`; `--scales minmax` observes them instead."""
    from kvcal.scales import compute_binding, make_scale_set, save_scale_file

    args = ["sensitivity", str(tiny_llama_dir), "-f", "nvfp4", "--num-samples", "2", "--seq-len", "16"]
    code, stdout, err = invoke([*args, "--factor", "1.0", "--json"])
    assert code == 0, err
    report = json.loads(stdout)
    advice = report["advice"]
    assert report["scales"] == "scale 1.0, as kvcal eval and vLLM without scales"
    assert advice["layers"] and advice["skip_layers"] == ",".join(map(str, advice["layers"]))
    code, table, err = invoke([*args, "--factor", "1.0"])
    assert code == 0, err
    rows = [line.replace("│", " ").split() for line in table.splitlines()]
    marked = [int(r[0]) for r in rows if r and r[0].isdigit() and "◀" in r]
    assert marked == advice["layers"]

    # a scale file of 1.0 everywhere is the default, exactly
    from kvcal.models.config import load_config
    from kvcal.models.geometry import kv_spec

    kv = kv_spec(load_config(tiny_llama_dir))
    ones = make_scale_set(
        "nvfp4", "tensor", [1.0] * kv.num_layers, [1.0] * kv.num_layers, observer="minmax",
        binding=compute_binding(str(tiny_llama_dir), tiny_llama_dir, kv),
    )  # fmt: skip
    path = save_scale_file(tmp_path / "ones.safetensors", ones)
    code, stdout, err = invoke([*args, "--factor", "1.0", "--scales", str(path), "--json"])
    assert code == 0, err
    assert json.loads(stdout)["layers"] == report["layers"]
    code, stdout, err = invoke([*args, "--scales", "minmax", "--json"])
    assert code == 0, err
    observed = json.loads(stdout)
    assert observed["scales"] == "minmax per tensor on the same samples"
    assert observed["layers"] != report["layers"]
