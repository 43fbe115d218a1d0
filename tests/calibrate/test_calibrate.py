"""End to end on tiny models: scales equal an independent computation, the file is written and bound,
llm-compressor agrees, and every bad input fails with one clear line and no partial file."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from transformers import DynamicCache

from kvcal.calibrate.data import build_samples, load_texts
from kvcal.calibrate.run import calibrate
from kvcal.errors import KvcalError, UsageError
from kvcal.formats import fake_quantize
from kvcal.models.loading import load_model
from kvcal.scales import load_scale_file

N, L = 6, 24


Invoke = Callable[[list[str]], tuple[int, str, str]]  # the `invoke` fixture of tests/conftest.py

pytestmark = pytest.mark.usefixtures("one_thread")


def _reference_kv(model_dir: Path) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """K/V of every layer over the same samples, from a plain DynamicCache (independent of kvcal's hooks)."""
    lm = load_model(model_dir)
    data = build_samples(load_texts(None), lm.tokenizer, N, L, seed=0)
    ks: dict[int, list[torch.Tensor]] = {}
    vs: dict[int, list[torch.Tensor]] = {}
    with torch.no_grad():
        for ids in data.samples:
            cache = DynamicCache()  # no config: every layer keeps everything
            lm.model(input_ids=ids[None], past_key_values=cache, use_cache=True)
            for i, layer in enumerate(cache.layers):
                ks.setdefault(i, []).append(layer.keys)
                vs.setdefault(i, []).append(layer.values)
    return {i: (torch.cat(ks[i], 2), torch.cat(vs[i], 2)) for i in ks}


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_minmax_scales_equal_amax_over_448_and_file_round_trips(
    arch: str, tiny_model_dir: Callable[[str], Path], tmp_path: Path
) -> None:
    model_dir = tiny_model_dir(arch)
    ref = _reference_kv(model_dir)
    out = tmp_path / "s.safetensors"
    seen: list[tuple[int, int, str]] = []
    res = calibrate(
        str(model_dir), "fp8", granularity="head", num_samples=N, seq_len=L, output=out,
        progress=lambda *a: seen.append(a),
    )  # fmt: skip
    assert ("observe" in {p for *_, p in seen}) and seen[-1][0] == seen[-1][1]
    ss = load_scale_file(out)
    assert ss.kv_format == "fp8_e4m3" and ss.granularity == "head" and ss.num_layers == len(ref)
    for i, (k, v) in ref.items():
        torch.testing.assert_close(ss.k_scales[i], k.abs().amax(dim=(0, 2, 3)) / 448, rtol=1e-7, atol=0)
        torch.testing.assert_close(ss.v_scales[i], v.abs().amax(dim=(0, 2, 3)) / 448, rtol=1e-7, atol=0)
        st = ss.layer_stats[i]
        assert st["k_clipped_fraction"] == 0.0 and st["v_clipped_fraction"] == 0.0
        err = fake_quantize(k, "fp8", scale=ss.k_scales[i]) - k
        direct_db = 10 * torch.log10((k.double() ** 2).sum() / (err.double() ** 2).sum())
        assert st["k_sqnr_db"] == pytest.approx(float(direct_db), abs=0.05)
    cal = ss.manifest["calibration"]
    assert (
        cal["num_samples"] == N
        and cal["seq_len"] == L
        and cal["token_ids_sha256"] == res.samples.token_sha256
    )
    assert ss.manifest["binding"]["model_type"] in ("llama", "gemma3_text")


def test_nvfp4_global_scale_and_tensor_granularity(tiny_llama_dir: Path) -> None:
    ref = _reference_kv(tiny_llama_dir)
    res = calibrate(str(tiny_llama_dir), "nvfp4", num_samples=N, seq_len=L)
    for i, (k, _v) in ref.items():
        torch.testing.assert_close(
            res.scale_set.k_scales[i], k.abs().amax().reshape(1) / (448 * 6), rtol=1e-7, atol=0
        )
        err = fake_quantize(k, "nvfp4", scale=res.scale_set.k_scales[i].reshape(())) - k
        direct_db = 10 * torch.log10((k.double() ** 2).sum() / (err.double() ** 2).sum())
        # per-sample fake quantization with the static global scale = one call on the concatenation
        assert res.scale_set.layer_stats[i]["k_sqnr_db"] == pytest.approx(float(direct_db), abs=1e-3)


@pytest.mark.parametrize("granularity", ["tensor", "head"])
def test_llmcompressor_static_minmax_agrees_with_native_minmax(
    tiny_llama_dir: Path, granularity: str
) -> None:
    lm = load_model(tiny_llama_dir)
    native = calibrate(lm, "fp8_e4m3", granularity=granularity, num_samples=N, seq_len=L)
    llmc = calibrate(load_model(tiny_llama_dir), "fp8_e4m3", granularity=granularity, num_samples=N, seq_len=L,
                     engine="llmcompressor")  # fmt: skip
    assert llmc.samples.token_sha256 == native.samples.token_sha256
    for a, b in zip(llmc.scale_set.k_scales + llmc.scale_set.v_scales, native.scale_set.k_scales + native.scale_set.v_scales, strict=True):  # fmt: skip
        assert a.shape == b.shape
        assert float(((a - b).abs() / b).max()) <= 1e-6
    assert llmc.scale_set.manifest["engine"] == "llmcompressor"
    assert llmc.scale_set.manifest["observer"]["name"] == "llmcompressor:static_minmax"
    # kvcal's statistics were gathered in llm-compressor's own forwards
    assert llmc.scale_set.layer_stats[0]["k_amax"] == pytest.approx(native.scale_set.layer_stats[0]["k_amax"])


def test_llmcompressor_default_observer_underestimates_and_show_reveals_it(tiny_llama_dir: Path) -> None:
    static = calibrate(load_model(tiny_llama_dir), "fp8_e4m3", num_samples=N, seq_len=L)
    moving = calibrate(load_model(tiny_llama_dir), "fp8_e4m3", num_samples=N, seq_len=L, engine="llmcompressor",
                       llmc_observer="minmax")  # fmt: skip
    ratios = [float(m / s) for m, s in zip(moving.scale_set.k_scales, static.scale_set.k_scales, strict=True)]
    assert max(ratios) <= 1 + 1e-6 and min(ratios) < 0.999
    clipped = [st["k_clipped_fraction"] for st in moving.scale_set.layer_stats]
    assert max(clipped) > 0  # the under-estimate is visible in the scale file's statistics


def test_cli_json_and_warning(tiny_llama_dir: Path, tmp_path: Path, invoke: Invoke) -> None:
    data = tmp_path / "few.jsonl"
    data.write_text("".join(json.dumps({"content": f"short text {i}"}) + "\n" for i in range(3)))
    out = tmp_path / "cli.safetensors"
    code, stdout, stderr = invoke(
        ["calibrate", str(tiny_llama_dir), "-f", "fp8_e5m2", "--observer", "percentile", "--dataset", str(data),
              "--num-samples", "5", "--seq-len", "16", "-o", str(out), "--json"],
    )  # fmt: skip
    assert code == 0, stderr
    payload = json.loads(stdout)
    assert payload["calibration"]["num_samples"] == 3 and payload["calibration"]["text_field"] == "content"
    assert "only 3 usable texts" in payload["warnings"][0]
    assert load_scale_file(out).kv_format == "fp8_e5m2"


def _cli_error(invoke: Invoke, args: list[str]) -> tuple[int, str]:
    code, _out, err = invoke(["calibrate", *args])
    lines = [ln for ln in err.splitlines() if ln.startswith("Error: ")]
    assert len(lines) == 1 and "Traceback" not in err, err
    return code, lines[0]


def test_bad_input_is_one_line_and_leaves_no_file(
    tiny_llama_dir: Path, tmp_path: Path, invoke: Invoke
) -> None:
    out = tmp_path / "o.safetensors"
    small = ["--num-samples", "2", "--seq-len", "8", "-o", str(out)]
    code, msg = _cli_error(invoke, [str(tiny_llama_dir), "-f", "mxfp4", *small])
    assert code == 2 and "nothing to calibrate" in msg
    code, msg = _cli_error(invoke, [str(tmp_path / "missing-model"), "-f", "fp8", *small])
    assert code == 2 and "does not exist" in msg
    code, msg = _cli_error(
        invoke, [str(tiny_llama_dir), "-f", "fp8", "--dataset", str(tmp_path / "none.jsonl"), *small]
    )
    assert code == 2 and "does not exist" in msg
    code, msg = _cli_error(
        invoke, [str(tiny_llama_dir), "-f", "fp8", "--num-samples", "2", "--seq-len", "65", "-o", str(out)]
    )
    assert code == 2 and "maximum of 64" in msg
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    code, msg = _cli_error(
        invoke, [str(tiny_llama_dir), "-f", "fp8", *small[:4], "-o", str(blocker / "s.safetensors")]
    )
    assert code == 2 and "not a folder" in msg
    if os.geteuid() != 0:  # root writes anywhere
        ro = tmp_path / "ro"
        ro.mkdir()
        ro.chmod(0o500)
        try:
            code, msg = _cli_error(
                invoke, [str(tiny_llama_dir), "-f", "fp8", *small[:4], "-o", str(ro / "s.safetensors")]
            )
            assert code == 2 and "not writable" in msg
        finally:
            ro.chmod(0o700)
    code, msg = _cli_error(
        invoke, [str(tiny_llama_dir), "-f", "fp8", "--engine", "llmcompressor", "--observer", "mse", *small]
    )
    assert code == 2 and "llm-compressor" in msg
    assert not out.exists() and not list(tmp_path.glob(".o.safetensors*"))


def test_non_finite_activations_name_the_layer(
    tmp_path: Path, tiny_model: Callable[[str], torch.nn.Module], tiny_llama_dir: Path
) -> None:
    model = tiny_model("llama")
    lm = load_model(tiny_llama_dir)  # a copy: the shared model stays intact
    with torch.no_grad():
        lm.model.model.layers[1].self_attn.v_proj.weight[0, 0] = float("nan")
    out = tmp_path / "nan.safetensors"
    with pytest.raises(KvcalError, match="non-finite activations \\(NaN\\) in values of layer 1") as info:
        calibrate(lm, "fp8", num_samples=2, seq_len=8, output=out)
    assert not isinstance(info.value, UsageError) and info.value.exit_code == 1
    assert not out.exists()
    assert not torch.isnan(
        model.model.layers[1].self_attn.v_proj.weight
    ).any()  # the shared fixture is intact


def test_sensitivity_isolates_one_layer(tiny_llama_dir: Path, tmp_path: Path) -> None:
    from kvcal.formats import get_format
    from kvcal.models.geometry import kv_spec
    from kvcal.pipeline.sensitivity import layer_sensitivity, sensitivity

    lm = load_model(tiny_llama_dir)
    good = calibrate(lm, "fp8", num_samples=3, seq_len=16)
    data, kv, fmt = good.samples.samples, kv_spec(lm.model.config), get_format("fp8")
    ks, vs = good.scale_set.k_scales, good.scale_set.v_scales
    base = layer_sensitivity(lm.model, data, kv, fmt, ks, vs)
    broken_vs = [v.clone() for v in vs]
    broken_vs[1] = broken_vs[1] * 1e-3  # layer 1's values saturate at 0.1 % of their range
    broken = layer_sensitivity(lm.model, data, kv, fmt, ks, broken_vs)
    assert broken["layers"][1]["kl"] > 10 * base["layers"][1]["kl"] > 0
    for i in (0, 2):  # quantizing one layer leaves the others' measurements untouched
        assert broken["layers"][i]["kl"] == pytest.approx(base["layers"][i]["kl"], rel=1e-9)
    assert broken["worst"][0] == 1 and "1" in (broken["advice"]["skip_layers"] or "")
    out = tmp_path / "sens.json"
    full = sensitivity(lm, "fp4_e2m1", num_samples=2, seq_len=16, output=str(out))
    assert json.loads(out.read_text())["kv_format"] == "fp4_e2m1" and len(full["layers"]) == kv.num_layers
    assert all(r["kl"] > 0 for r in full["layers"]) and full["all_layers"]["kl"] > 0
