"""scripts/plan_study.py on a real `kvcal plan --json` report of a tiny model: the page holds the report's numbers
(the paired plan - uniform interval recomputed from the per-window KL), names each run's command, and a missing
report is one `Error:` line."""

from __future__ import annotations

import importlib.util
import json
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import pytest

from kvcal.pipeline.plan import interval

REPO = Path(__file__).resolve().parents[2]
Invoke = Callable[[list[str]], tuple[int, str, str]]
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def plan_study() -> ModuleType:
    spec = importlib.util.spec_from_file_location("kvcal_scripts_plan_study", REPO / "scripts" / "plan_study.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def test_page_from_a_real_plan_report(
    plan_study: ModuleType, tiny_llama_dir: Path, tmp_path: Path, invoke: Invoke, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    argv = ["plan", str(tiny_llama_dir), "--candidates", "bf16,fp8_e4m3,nvfp4", "--capacity", "2.0x",
            "--num-samples", "2", "--seq-len", "16", "--heldout-windows", "3", "--heldout-seq-len", "16",
            "--frontier", "--frontier-step", "0.5", "--compare-uniform", "--json"]  # fmt: skip
    code, stdout, err = invoke(argv)
    assert code == 0, err
    report = json.loads(stdout)
    root = tmp_path / "reports"
    study = {"title": "Tiny", "about": "A tiny model.", "root": str(root), "runs": {"4k": argv}}
    monkeypatch.setitem(plan_study.STUDIES, "plan-tiny", study)

    out = tmp_path / "page.md"
    assert plan_study.main(["plan-tiny", "-o", str(out)]) == 1  # no report yet
    assert capsys.readouterr().err.startswith("Error: no report for run(s) ['4k']")

    root.mkdir()
    (root / "4k.json").write_text(stdout)
    assert plan_study.main(["plan-tiny", "-o", str(out)]) == 0
    page = out.read_text()
    assert "kvcal " + " ".join(argv) in page
    # the 2.0x row: the frontier's plan at 2.0x against the best uniform configuration reaching 2.0x
    plan = plan_study._at(report["frontier"], 2.0)
    meeting = [u for u in report["uniform"] if u["capacity"]["multiplier_vs_bf16"] >= 2.0]
    best = min(meeting, key=lambda u: u["measured"]["kl"]["mean"])
    d = interval([a - b for a, b in zip(plan["measured"]["kl_per_window"], best["measured"]["kl_per_window"],
                                        strict=True)])  # fmt: skip
    [row] = [line for line in page.splitlines() if line.startswith("| 2.0x |")]
    assert f"{plan['capacity']:.3f}" in row and f"{best['config']} (" in row
    assert plan_study.signed_ci(d) in row
    assert "| 4k | 2.0x |" in page  # the summary
