"""`kvcal drift` on the very text a scale file was calibrated on says "fits" with nothing clipped beyond what the
file's own observer clips — for every format with static scales, both granularities and both K/V input dtypes —
because drift observes K/V through calibrate's one path (kvcal/calibrate/observation.py), as the manifest says.

Before that path was shared, drift observed K/V unrounded while calibrate (default --kv-input-dtype bfloat16)
measured them rounded to bf16, and a tiny Llama on one 8-token text read "drifted: 9.77e-04 of the elements exceed
the calibrated clip" (issue 21). `test_unrounded_kv_exceed_bf16_scales` shows this test data would catch that.
Calibrate's scales are checked against an independent plain path (a transformers DynamicCache, K/V rounded by
hand), so the shared path did not change them."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from kvcal.calibrate.drift import FITS, check_drift
from kvcal.calibrate.observation import ObserveOptions
from kvcal.calibrate.observers import format_range, get_observer
from kvcal.calibrate.run import StatsCollector, calibrate, observed_scales
from kvcal.formats import FORMATS, KV_INPUT_DTYPES, get_format
from kvcal.models.geometry import kv_spec
from kvcal.models.loading import load_model
from kvcal.scales import load_scale_file

Invoke = Callable[[list[str]], tuple[int, str, str]]
N, L = 3, 16  # calibration = traffic: kvcal's generated corpus
STATIC = ("fp8_e4m3", "fp8_e4m3_cpu", "fp8_e5m2", "int8_per_tensor", "nvfp4", "nvfp4_4over6", "fp8_e5m2_cpu")
KV_IN = ("bfloat16", "float32")

pytestmark = pytest.mark.usefixtures("one_thread")


def test_static_formats_are_the_calibratable_ones() -> None:
    # the matrix below covers every format that has static scales (kvcal/formats.py `calibratable`)
    assert {n for n, f in FORMATS.items() if f.calibratable} == set(STATIC)


def _assert_fits_exactly(report: object, observer: str) -> None:
    """Nothing clipped beyond the file's observer (exactly 0), no SQNR lost against fresh scales (exactly 0)."""
    assert report.verdict == FITS and report.reasons == [], report.reasons
    assert report.traffic["calibration_text"] is True  # the very token ids of the calibration
    recs = [h for rec in report.layers for h in [rec, *rec.get("heads", [])]]
    for rec in recs:
        for k in ("k", "v"):
            assert rec[f"{k}_excess_clip_fraction"] == 0.0
            assert rec[f"{k}_clip_fraction"] == rec[f"{k}_fresh_clip_fraction"]
            if observer == "minmax":
                assert rec[f"{k}_clip_fraction"] == 0.0
                assert rec[f"{k}_amax"] == rec[f"{k}_calibrated_amax"]
            assert rec[f"{k}_sqnr_loss_db"] in (0.0, None)
            assert rec[f"{k}_sqnr_db"] == rec[f"{k}_sqnr_fresh_db"]


@pytest.mark.parametrize("kv_input_dtype", KV_IN)
@pytest.mark.parametrize("granularity", ["tensor", "head"])
@pytest.mark.parametrize("kv_format", STATIC)
def test_drift_on_the_calibration_text_fits_minmax(
    kv_format: str, granularity: str, kv_input_dtype: str, tiny_llama_dir: Path, tmp_path: Path
) -> None:
    out = tmp_path / "s.safetensors"
    calibrate(str(tiny_llama_dir), kv_format, granularity=granularity, num_samples=N, seq_len=L,
              kv_input_dtype=kv_input_dtype, output=out)  # fmt: skip
    # --max-clip 0 --max-sqnr-loss-db 0: any clipped element or lost dB would be "drifted"
    report = check_drift(out, str(tiny_llama_dir), dataset=None, num_samples=N, max_clip=0.0,
                         max_sqnr_loss_db=0.0)  # fmt: skip
    assert report.traffic["kv_input_dtype"] == kv_input_dtype and report.traffic["seq_len"] == L
    _assert_fits_exactly(report, "minmax")


@pytest.mark.parametrize(
    ("kv_format", "granularity", "observer", "params"),
    [
        ("fp8_e4m3", "tensor", "percentile", {"percentile": 99.0}),
        ("fp8_e4m3", "head", "percentile", {"percentile": 99.0}),
        ("fp8_e5m2", "tensor", "mse", None),
        ("nvfp4", "tensor", "percentile", {"percentile": 99.0}),
        ("nvfp4", "head", "mse", None),
    ],
)
def test_drift_on_the_calibration_text_fits_clipping_observers(
    kv_format: str, granularity: str, observer: str, params: dict | None, tiny_llama_dir: Path, tmp_path: Path
) -> None:
    """A clipping observer's file clips its own calibration text by design: "fits" means the traffic clips no
    more than fresh scales of that observer clip on it (drift's excess_clip_fraction), which is exactly 0 here."""
    out = tmp_path / "s.safetensors"
    calibrate(str(tiny_llama_dir), kv_format, granularity=granularity, observer=observer, observer_params=params,
              num_samples=N, seq_len=L, kv_input_dtype="bfloat16", output=out)  # fmt: skip
    report = check_drift(out, str(tiny_llama_dir), dataset=None, num_samples=N, max_clip=0.0,
                         max_sqnr_loss_db=0.0)  # fmt: skip
    _assert_fits_exactly(report, observer)
    if observer == "percentile":  # the criterion is not vacuous: the file's clip does saturate elements
        assert any(rec[f"{k}_clip_fraction"] > 0 for rec in report.layers for k in ("k", "v"))


def test_cli_drift_on_the_calibration_text_fits_and_refuses_another_rounding(
    tiny_llama_dir: Path, tmp_path: Path, invoke: Invoke
) -> None:
    """The issue's reproduction through the CLI: calibrate (default --kv-input-dtype bfloat16) on one text of 8
    tokens, drift on the same text with --max-clip 0: fits, exit 0."""
    text = tmp_path / "one.txt"
    text.write_text("The quick brown fox jumps over the lazy dog near the river bank today.\n")
    scales = tmp_path / "s.safetensors"
    data = ["--dataset", str(text), "--num-samples", "1", "--seq-len", "8"]
    code, _, err = invoke(["calibrate", str(tiny_llama_dir), "--kv-format", "fp8_e4m3", *data, "-o", str(scales)])
    assert code == 0, err
    code, out, err = invoke(["drift", str(scales), str(tiny_llama_dir), *data, "--max-clip", "0"])
    assert code == 0 and "fits: worst clip fraction 0.00e+00" in out, out + err
    code, out, err = invoke(["drift", str(scales), str(tiny_llama_dir), *data, "--kv-input-dtype", "float32"])
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("Error: --kv-input-dtype float32 contradicts")
    assert "observed in bfloat16" in lines[0] and "drop --kv-input-dtype" in lines[0]


def test_unrounded_kv_exceed_bf16_scales(tiny_llama_dir: Path, plain_kv: Callable[..., dict]) -> None:
    """The old drift path (K/V unrounded) against bf16-measured scales would clip on this very data."""
    kv = plain_kv(tiny_llama_dir, N, L)
    ss = calibrate(str(tiny_llama_dir), "fp8_e4m3", num_samples=N, seq_len=L, kv_input_dtype="bf16").scale_set
    assert any(float(k.abs().max()) > float(ss.k_scales[i]) * 448 * (1 + 1e-6) for i, (k, _) in kv.items())


@pytest.mark.parametrize("kv_input_dtype", [None, *KV_IN])
@pytest.mark.parametrize("granularity", ["tensor", "head"])
@pytest.mark.parametrize("kv_format", ["fp8_e4m3", "nvfp4"])
def test_calibrate_minmax_scales_equal_an_independent_plain_path(
    kv_format: str,
    granularity: str,
    kv_input_dtype: str | None,
    tiny_llama_dir: Path,
    plain_kv: Callable[..., dict],
) -> None:
    """minmax scale = amax of the (rounded) K/V per group / the format's range, bit for bit (fp32)."""
    fmt = get_format(kv_format)
    res = calibrate(str(tiny_llama_dir), kv_format, granularity=granularity, num_samples=N, seq_len=L,
                    kv_input_dtype=kv_input_dtype)  # fmt: skip
    for i, (k, v) in plain_kv(tiny_llama_dir, N, L).items():
        for x, got in ((k, res.scale_set.k_scales[i]), (v, res.scale_set.v_scales[i])):
            if kv_input_dtype is not None:
                x = x.to(KV_INPUT_DTYPES[kv_input_dtype]).float()
            amax = x.abs().amax(dim=(0, 2, 3)) if granularity == "head" else x.abs().amax().reshape(1)
            want = (amax.float() / format_range(fmt)).clamp(min=torch.finfo(torch.float32).tiny)
            assert torch.equal(got.reshape(-1), want), (i, got, want)


@pytest.mark.parametrize("kv_format", ["fp8_e4m3", "nvfp4"])
def test_shared_path_equals_calibrate_with_clipping_observer_and_batches(
    kv_format: str, tiny_llama_dir: Path
) -> None:
    """calibrate() and the shared path called directly (observed_scales over ObserveOptions, batch 1 and 2)
    choose bit-identical scales and statistics."""
    params = {"percentile": 99.5}
    res = calibrate(str(tiny_llama_dir), kv_format, observer="percentile", observer_params=params,
                    num_samples=N, seq_len=L, kv_input_dtype="bfloat16")  # fmt: skip
    lm = load_model(tiny_llama_dir)
    kv = kv_spec(lm.model.config)
    for batch in (1, 2):
        opts = ObserveOptions.parse(num_samples=N, seq_len=L, kv_input_dtype="bf16", batch_size=batch)
        data = opts.samples(lm)
        assert data.token_sha256 == res.scale_set.manifest["calibration"]["token_ids_sha256"]
        ks, vs, stats = observed_scales(lm.model, data.samples, kv, get_format(kv_format), "tensor",
                                        get_observer("percentile", params), opts)  # fmt: skip
        for a, b in zip([*ks, *vs], [*res.scale_set.k_scales, *res.scale_set.v_scales], strict=True):
            assert torch.equal(a, b)
        assert stats == res.scale_set.layer_stats


def test_options_are_validated_in_one_place() -> None:
    from kvcal.errors import UsageError

    for kwargs, flag in (({"num_samples": 0}, "--num-samples"), ({"seq_len": 0}, "--seq-len"),
                         ({"batch_size": 0}, "--batch-size"), ({"kv_input_dtype": "int8"}, "--kv-input-dtype")):  # fmt: skip
        with pytest.raises(UsageError, match=flag):
            ObserveOptions.parse(**kwargs)
    assert ObserveOptions.parse(kv_input_dtype="bf16").kv_input_dtype == "bfloat16"
    assert isinstance(StatsCollector(), StatsCollector)


# On SmolLM2's real K/V: every static format once, the four (granularity, K/V input) pairs in turn (each pair
# at least once); the whole product runs on the tiny model above (a real case costs ~16 s in CI).
_REAL_CASES = [(f, *[(g, d) for g in ("tensor", "head") for d in KV_IN][i % 4]) for i, f in enumerate(STATIC)]


@pytest.mark.slow
@pytest.mark.parametrize(("kv_format", "granularity", "kv_input_dtype"), _REAL_CASES)
def test_smollm2_drift_on_the_calibration_text_fits(
    kv_format: str, granularity: str, kv_input_dtype: str, real_model_path: Callable[[str], str],
    shared_data: Path, tmp_path: Path,
) -> None:  # fmt: skip
    """SmolLM2-135M, 4 C4 texts x 128 tokens: calibrate, then drift on those very tokens: exactly nothing clipped."""
    from kvcal.models.loading import load_model as load

    lm = _smollm2(real_model_path, load)
    c4 = str(shared_data / "c4_calib")
    out = tmp_path / "s.safetensors"
    calibrate(lm, kv_format, granularity=granularity, dataset=c4, num_samples=4, seq_len=128,
              kv_input_dtype=kv_input_dtype, output=out)  # fmt: skip
    report = check_drift(out, lm, dataset=c4, num_samples=4, max_clip=0.0, max_sqnr_loss_db=0.0)
    _assert_fits_exactly(report, "minmax")
    assert load_scale_file(out).kv_input_dtype == kv_input_dtype


_SMOLLM2: list = []


def _smollm2(real_model_path: Callable[[str], str], load: Callable[..., object]) -> object:
    """One float32 SmolLM2 for the whole module (loading it dominates a case)."""
    if not _SMOLLM2:
        _SMOLLM2.append(load(real_model_path("smollm2"), dtype="float32"))
    return _SMOLLM2[0]


def test_only_the_observation_module_runs_hooks_observe() -> None:
    """One observation path: every K/V pass of calibrate, drift and sensitivity goes through
    ObserveOptions.observe; no other library module imports hooks.observe (or rounds K/V itself: in_dtype)."""
    import ast

    import kvcal

    root = Path(kvcal.__file__).parent
    users = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and node.module in ("kvcal.calibrate.hooks", "kvcal.calibrate"):
                if any(a.name in ("observe", "in_dtype") for a in node.names):
                    users.append(path.relative_to(root).as_posix())
    assert users == ["calibrate/observation.py"]
