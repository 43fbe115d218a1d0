"""`kvcal drift`: traffic observed through calibrate's path, judged against a scale file.

Same data as the calibration -> fits, with the numbers calibrate itself reported; traffic whose K/V exceed the
calibrated amax (scales calibrated on a few short texts, traffic of long varied ones) -> drifted, exit 1, with
clip fractions equal to an independent count over K/V from a plain DynamicCache; bad input -> one `Error:` line."""

from __future__ import annotations

import json
import math
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from kvcal.calibrate.drift import CLIP_RTOL, DRIFTED, FITS, check_drift
from kvcal.calibrate.run import calibrate
from kvcal.formats import fake_quantize, get_format
from kvcal.scales import load_scale_file

Invoke = Callable[[list[str]], tuple[int, str, str]]
N, L = 6, 24  # calibration samples (kvcal's generated corpus)
TRAFFIC_N, TRAFFIC_L = 6, 48  # traffic: longer sequences of the generated corpus
SHORT = (
    "the cat sat.\n\nthe dog ran.\n\na cat.\n"  # a few short plain texts: the calibration that will not hold
)

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def short_scales(
    tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Callable[[str, str], Path]:
    """(kv_format, granularity) -> a scale file calibrated on SHORT, 4 tokens per text (module-scoped)."""
    root = tmp_path_factory.mktemp("short-scales")
    (root / "short.txt").write_text(SHORT)
    made: dict[tuple[str, str], Path] = {}

    def get(kv_format: str, granularity: str = "tensor") -> Path:
        if (kv_format, granularity) not in made:
            out = root / f"{kv_format}-{granularity}.safetensors"
            calibrate(str(tiny_llama_dir), kv_format, granularity=granularity, dataset=str(root / "short.txt"),
                      num_samples=3, seq_len=4, output=out)  # fmt: skip
            made[(kv_format, granularity)] = out
        return made[(kv_format, granularity)]

    return get


def _sqnr(x: torch.Tensor, fmt: str, scale: torch.Tensor) -> float:
    x = x.double()
    err = fake_quantize(x.float(), fmt, scale=scale.reshape(()) if scale.numel() == 1 else scale).double() - x
    return 10 * math.log10(float((x * x).sum()) / float((err * err).sum()))


@pytest.mark.parametrize(
    ("kv_format", "granularity"), [("fp8_e4m3", "tensor"), ("fp8_e5m2", "head"), ("nvfp4", "tensor")]
)
def test_same_data_as_calibration_fits_with_calibrates_numbers(
    kv_format: str, granularity: str, tiny_llama_dir: Path, tmp_path: Path
) -> None:
    out = tmp_path / "s.safetensors"
    calibrate(str(tiny_llama_dir), kv_format, granularity=granularity, num_samples=N, seq_len=L, output=out)
    ss = load_scale_file(out)
    report = check_drift(out, str(tiny_llama_dir), dataset=None, num_samples=N, seq_len=L)
    assert report.verdict == FITS and report.reasons == []
    assert report.to_dict()["verdict"] == FITS and len(report.to_dict()["layers"]) == ss.num_layers
    for rec, cal in zip(report.layers, ss.layer_stats, strict=True):
        for k in ("k", "v"):
            assert rec[f"{k}_clip_fraction"] == 0.0
            assert rec[f"{k}_amax"] == rec[f"{k}_calibrated_amax"] == cal[f"{k}_amax"]
            # fresh minmax scales on the same data are the file's scales: identical SQNR, the one calibrate reported
            assert (
                rec[f"{k}_sqnr_db"]
                == rec[f"{k}_sqnr_fresh_db"]
                == pytest.approx(cal[f"{k}_sqnr_db"], abs=1e-9)
            )
            assert rec[f"{k}_sqnr_loss_db"] == 0.0
        if granularity == "head":
            assert [h["head"] for h in rec["heads"]] == [0, 1]
            assert [h["k_amax"] for h in rec["heads"]] == cal["k_amax_per_head"]
        else:
            assert "heads" not in rec


def test_traffic_beyond_the_calibrated_amax_drifts_with_exact_clip_counts(
    tiny_llama_dir: Path, short_scales: Callable[..., Path], plain_kv: Callable[..., dict]
) -> None:
    path = short_scales("fp8_e4m3")
    ss = load_scale_file(path)
    report = check_drift(path, str(tiny_llama_dir), dataset=None, num_samples=TRAFFIC_N, seq_len=TRAFFIC_L)
    assert report.verdict == DRIFTED and report.drifted
    ref = plain_kv(tiny_llama_dir, TRAFFIC_N, TRAFFIC_L)
    fmt = get_format("fp8_e4m3")
    for rec in report.layers:
        i = rec["layer"]
        for k, x, scale in (("k", ref[i][0], ss.k_scales[i]), ("v", ref[i][1], ss.v_scales[i])):
            clip = float(scale) * 448.0
            assert rec[f"{k}_amax"] == pytest.approx(float(x.abs().max()), rel=1e-6)
            assert (
                rec[f"{k}_amax"] > rec[f"{k}_calibrated_amax"]
            )  # the traffic really exceeds the calibration
            # the saturated fraction: an exact count over the reference K/V
            over = int((x.abs().float() > torch.tensor(clip) * (1 + CLIP_RTOL)).sum())
            assert rec[f"{k}_clip_fraction"] == over / x.numel() and over > 0
            # SQNR: the histogram's (calibrate's) computation vs fake quantization of the reference K/V
            fresh = x.abs().max().float().reshape(1) / float(fmt.max_value)
            assert rec[f"{k}_sqnr_db"] == pytest.approx(_sqnr(x, "fp8_e4m3", scale), abs=0.05)
            assert rec[f"{k}_sqnr_fresh_db"] == pytest.approx(_sqnr(x, "fp8_e4m3", fresh), abs=0.05)
            assert rec[f"{k}_sqnr_loss_db"] == pytest.approx(rec[f"{k}_sqnr_fresh_db"] - rec[f"{k}_sqnr_db"])
    assert any("exceed the calibrated clip" in r and "--max-clip" in r for r in report.reasons)
    # thresholds loose enough to accept this traffic: fits
    loose = check_drift(path, str(tiny_llama_dir), dataset=None, num_samples=TRAFFIC_N, seq_len=TRAFFIC_L,
                        max_clip=0.5, max_sqnr_loss_db=30.0)  # fmt: skip
    assert loose.verdict == FITS and loose.layers == report.layers


@pytest.mark.parametrize(("kv_format", "granularity"), [("nvfp4", "tensor"), ("fp8_e5m2", "head")])
def test_nvfp4_and_per_head_files_drift_too(
    kv_format: str, granularity: str, tiny_llama_dir: Path, short_scales: Callable[..., Path]
) -> None:
    report = check_drift(short_scales(kv_format, granularity), str(tiny_llama_dir), dataset=None,
                         num_samples=TRAFFIC_N, seq_len=TRAFFIC_L)  # fmt: skip
    assert report.verdict == DRIFTED and report.kv_format == kv_format
    assert any(rec["k_clip_fraction"] > 1e-4 for rec in report.layers)
    if granularity == "head":
        assert all(r.startswith("layer ") and " head " in r for r in report.reasons)
        for rec in report.layers:  # the layer's clip fraction is the heads' pooled one (equal sizes)
            heads = [h["k_clip_fraction"] for h in rec["heads"]]
            assert rec["k_clip_fraction"] == pytest.approx(sum(heads) / len(heads))
    else:  # nvfp4: current and fresh global scales measured on the data; clipping costs SQNR somewhere
        assert any(rec["v_sqnr_loss_db"] > 0 for rec in report.layers)


def test_cli_exit_codes_json_and_table(
    tiny_llama_dir: Path, short_scales: Callable[..., Path], tmp_path: Path, invoke: Invoke
) -> None:
    traffic = tmp_path / "traffic.jsonl"
    from kvcal.calibrate.default_corpus import generate_corpus

    traffic.write_text("".join(json.dumps({"text": t}) + "\n" for t in generate_corpus(20, seed=3)))
    args = ["drift", str(short_scales("fp8_e4m3")), str(tiny_llama_dir), "--dataset", str(traffic),
            "--num-samples", "4", "--seq-len", "48"]  # fmt: skip
    code, out, err = invoke([*args, "--json"])
    assert code == 1, err
    payload = json.loads(out)
    assert payload["verdict"] == DRIFTED and payload["reasons"]
    assert {"layer", "k_clip_fraction", "v_clip_fraction", "k_amax", "v_amax", "k_calibrated_amax",
            "v_calibrated_amax", "k_sqnr_db", "v_sqnr_db", "k_sqnr_fresh_db", "v_sqnr_fresh_db"} <= set(
        payload["layers"][0])  # fmt: skip
    assert payload["traffic"]["source"] == str(traffic) and payload["traffic"]["num_samples"] == 4
    code, out, err = invoke(args)
    assert code == 1 and "K clipped" in out and "SQNR/fresh" in out
    assert "drifted: worst clip fraction" in err and "kvcal calibrate MODEL --kv-format fp8_e4m3" in err
    code, out, err = invoke([*args, "--max-clip", "0.5", "--max-sqnr-loss-db", "40"])
    assert code == 0 and "fits: worst clip fraction" in out


def _one_error(result: tuple[int, str, str], code: int, *needles: str) -> None:
    got, out, err = result
    lines = err.strip().splitlines()
    assert got == code and len(lines) == 1 and lines[0].startswith("Error: "), err
    for n in needles:
        assert n in lines[0]


def test_bad_input_is_one_error_line(
    tiny_llama_dir: Path, short_scales: Callable[..., Path], tmp_path: Path, invoke: Invoke
) -> None:
    scales = str(short_scales("fp8_e4m3"))
    base = ["drift", scales, str(tiny_llama_dir), "--num-samples", "2", "--seq-len", "8"]
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    _one_error(invoke([*base, "--dataset", str(empty)]), 1, f"traffic file '{empty}' is empty")
    blank = tmp_path / "blank.txt"
    blank.write_text("\n \n\n")
    _one_error(invoke([*base, "--dataset", str(blank)]), 1, "is empty")
    latin = tmp_path / "latin1.txt"
    latin.write_bytes("caf\xe9 au lait\n".encode("latin-1"))
    _one_error(invoke([*base, "--dataset", str(latin)]), 1, "is not UTF-8")
    _one_error(invoke([*base, "--dataset", str(tmp_path / "nope.jsonl")]), 2, "does not exist")
    if os.geteuid() != 0:  # root reads a mode-000 file anyway
        locked = tmp_path / "locked.txt"
        locked.write_text("some text\n")
        locked.chmod(0)
        _one_error(invoke([*base, "--dataset", str(locked)]), 1, "cannot read traffic file")
    _one_error(invoke([*base, "--dataset", str(latin), "--max-clip", "2"]), 2, "--max-clip")
    _one_error(invoke([*base, "--dataset", str(latin), "--max-sqnr-loss-db", "-1"]), 2, "--max-sqnr-loss-db")
    short = tmp_path / "short.txt"
    short.write_text(SHORT)
    missing = tmp_path / "none.safetensors"
    _one_error(invoke(["drift", str(missing), str(tiny_llama_dir), "--dataset", str(short)]), 2,
               f"scale file '{missing}' does not exist")  # fmt: skip


def test_stale_scale_file_is_refused_unless_forced(
    tiny_llama_dir: Path, short_scales: Callable[..., Path], tmp_path: Path, invoke: Invoke
) -> None:
    from safetensors.torch import load_file, save_file

    copy = tmp_path / "changed"
    shutil.copytree(tiny_llama_dir, copy)
    weights = load_file(str(copy / "model.safetensors"))
    weights["model.layers.0.mlp.down_proj.weight"][0, 0] += 1e-3  # one changed weight
    save_file(weights, str(copy / "model.safetensors"), metadata={"format": "pt"})
    traffic = tmp_path / "t.txt"
    traffic.write_text(SHORT)
    args = ["drift", str(short_scales("fp8_e4m3")), str(copy), "--dataset", str(traffic), "--num-samples", "3",
            "--seq-len", "4"]  # fmt: skip
    _one_error(invoke(args), 1, "is stale", "weights changed (model.safetensors)")
    code, out, err = invoke([*args, "--force", "--json", "--max-clip", "0.5", "--max-sqnr-loss-db", "40"])
    assert code == 0 and json.loads(out)["verdict"] == FITS
    assert "calibrated on another checkpoint" in err
