"""The scale file: round trip, every refusal, checkpoint binding (verify), the hash cache, and the CLI."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from kvcal.errors import KvcalError, UsageError
from kvcal.filecache import hash_cache_path
from kvcal.models.config import load_config
from kvcal.models.geometry import kv_spec
from kvcal.scales import (
    CHECKSUM_KEY,
    K_NAME,
    MANIFEST_KEY,
    V_NAME,
    ScaleSet,
    _checksum,
    binding_differences,
    compute_binding,
    load_scale_file,
    load_scales_for_model,
    make_scale_set,
    save_scale_file,
)

NUM_LAYERS, KV_HEADS = 2, 2  # the geometry of tests/conftest.py's `word_llama_dir`
WordLlama = Callable[..., Path]  # the `word_llama` fixture: (num_layers=2) -> folder
Invoke = Callable[[list[str]], tuple[int, str, str]]  # the `invoke` fixture


def spec(model_dir: Path):
    return kv_spec(load_config(model_dir))


def random_scale_set(
    model_dir: Path, granularity: str = "tensor", kv_format: str = "fp8_e4m3", seed: int = 0
):
    kv = spec(model_dir)
    g = torch.Generator().manual_seed(seed)
    shape = (1,) if granularity == "tensor" else (KV_HEADS,)
    ks = [torch.rand(shape, generator=g) * 0.1 + 0.01 for _ in range(kv.num_layers)]
    vs = [torch.rand(shape, generator=g) * 0.1 + 0.01 for _ in range(kv.num_layers)]
    stats = [
        {
            "layer": i,
            "k_amax": float(ks[i].max() * 448),
            "v_amax": float(vs[i].max() * 448),
            "k_clipped_fraction": 0.0,
            "v_clipped_fraction": 0.001,
            "k_sqnr_db": 31.5,
            "v_sqnr_db": 30.25,
        }
        for i in range(kv.num_layers)
    ]
    return make_scale_set(
        kv_format,
        granularity,
        ks,
        vs,
        observer="minmax",
        observer_params={},
        binding=compute_binding(str(model_dir), model_dir, kv),
        calibration={
            "source": "test",
            "num_samples": 4,
            "seq_len": 32,
            "seed": 0,
            "token_ids_sha256": "ab" * 32,
        },
        layer_stats=stats,
    )


def write_raw(
    path: Path, tensors: dict[str, torch.Tensor], manifest_str: str, checksum: str | None = None
) -> None:
    """A file as another (buggy) writer would produce it: no validation, a consistent checksum."""
    from safetensors.torch import save_file

    meta = {MANIFEST_KEY: manifest_str, CHECKSUM_KEY: checksum or _checksum(manifest_str, tensors)}
    save_file(tensors, str(path), metadata=meta)


# --------------------------------------------------------------------------------------------- round trip


@pytest.mark.parametrize("granularity", ["tensor", "head"])
def test_round_trip(word_llama_dir: Path, tmp_path: Path, granularity: str) -> None:
    ss = random_scale_set(word_llama_dir, granularity)
    path = save_scale_file(tmp_path / "s.safetensors", ss)
    assert [p.name for p in tmp_path.iterdir()] == ["s.safetensors"]  # no temp file left
    umask = os.umask(0)
    os.umask(umask)
    assert path.stat().st_mode & 0o777 == 0o666 & ~umask  # not mkstemp's 0600
    back = load_scale_file(path)
    assert back.kv_format == "fp8_e4m3" and back.granularity == granularity
    assert back.manifest == ss.manifest
    for a, b in zip(ss.k_scales + ss.v_scales, back.k_scales + back.v_scales, strict=True):
        assert a.dtype == b.dtype == torch.float32 and torch.equal(a, b)
    assert back.k_scales[0].shape == ((1,) if granularity == "tensor" else (KV_HEADS,))
    # engine names on disk
    from safetensors import safe_open

    with safe_open(str(path), "pt") as fh:
        assert set(fh.keys()) == {K_NAME.format(i=i) for i in range(NUM_LAYERS)} | {
            V_NAME.format(i=i) for i in range(NUM_LAYERS)
        }
    m = back.manifest
    assert m["binding"]["num_layers"] == NUM_LAYERS and m["binding"]["num_kv_heads"] == KV_HEADS
    assert m["binding"]["layer_types"] == ["full_attention"] * NUM_LAYERS
    assert set(m["binding"]["tokenizer_files"]) >= {"tokenizer.json", "tokenizer_config.json"}
    assert set(m["binding"]["weight_files"]) == {"model.safetensors"}
    assert m["calibration"]["seq_len"] == 32 and m["observer"]["name"] == "minmax"
    assert len(m["layer_stats"]) == NUM_LAYERS


def test_format_alias_and_non_calibratable(word_llama_dir: Path) -> None:
    kv = spec(word_llama_dir)
    binding = compute_binding("m", word_llama_dir, kv)
    ss = make_scale_set(
        "fp8", "tensor", [0.1] * NUM_LAYERS, [0.2] * NUM_LAYERS, observer="minmax", binding=binding
    )
    assert ss.kv_format == "fp8_e4m3" and ss.k_scales[0].shape == (1,)
    for fmt in ("fp4_e2m1", "mxfp4", "int8_per_token_head", "bf16"):
        with pytest.raises(UsageError, match="no static scales"):
            make_scale_set(
                fmt, "tensor", [0.1] * NUM_LAYERS, [0.1] * NUM_LAYERS, observer="minmax", binding=binding
            )
    with pytest.raises(UsageError, match="unknown KV format"):
        make_scale_set("fp7", "tensor", [0.1] * 2, [0.1] * 2, observer="minmax", binding=binding)
    with pytest.raises(UsageError, match="granularity"):
        make_scale_set("fp8", "channel", [0.1] * 2, [0.1] * 2, observer="minmax", binding=binding)


# --------------------------------------------------------------------------------------------- refusals


BAD_VALUES = {
    "nan": (float("nan"), "not finite"),
    "inf": (float("inf"), "not finite"),
    "zero": (0.0, "zero or negative"),
    "negative": (-0.5, "zero or negative"),
}


@pytest.mark.parametrize("case", list(BAD_VALUES))
def test_bad_scale_values_refused_on_build_save_and_load(
    word_llama_dir: Path, tmp_path: Path, case: str
) -> None:
    value, message = BAD_VALUES[case]
    good = random_scale_set(word_llama_dir)
    ks = [t.clone() for t in good.k_scales]
    ks[1] = torch.tensor([value])
    with pytest.raises(KvcalError, match=f"layer 1 k_scale .*{message}"):
        make_scale_set("fp8_e4m3", "tensor", ks, good.v_scales, observer="minmax", binding=good.binding)
    bad = ScaleSet("fp8_e4m3", "tensor", ks, good.v_scales, good.manifest)
    target = tmp_path / "out" / "s.safetensors"
    with pytest.raises(KvcalError, match=message):
        save_scale_file(target, bad)
    assert not target.exists() and list((tmp_path).rglob("*.tmp")) == []
    # a file with the bad value written by someone else (consistent checksum) is refused on load
    raw = tmp_path / "raw.safetensors"
    manifest_str = json.dumps(good.manifest)
    write_raw(raw, bad.tensors(), manifest_str)
    with pytest.raises(KvcalError, match=rf"raw\.safetensors.*layer 1 k_scale.*{message}.*kvcal calibrate"):
        load_scale_file(raw)


def test_wrong_shape_and_layer_count_refused(word_llama_dir: Path, tmp_path: Path) -> None:
    good = random_scale_set(word_llama_dir)
    manifest_str = json.dumps(good.manifest)
    tensors = good.tensors()
    # per-tensor file holding a (2,) scale
    t2 = dict(tensors)
    t2[V_NAME.format(i=0)] = torch.tensor([0.1, 0.2])
    write_raw(tmp_path / "shape.safetensors", t2, manifest_str)
    with pytest.raises(KvcalError, match=r"layer 0 v_scale has shape \(2,\), expected \(1,\)"):
        load_scale_file(tmp_path / "shape.safetensors")
    # per-head manifest with per-tensor shapes
    m = dict(good.manifest, granularity="head")
    write_raw(tmp_path / "head.safetensors", tensors, json.dumps(m))
    with pytest.raises(KvcalError, match=r"expected \(2,\) for granularity 'head'"):
        load_scale_file(tmp_path / "head.safetensors")
    # a layer missing
    t3 = {k: v for k, v in tensors.items() if ".1." not in k}
    write_raw(tmp_path / "layers.safetensors", t3, manifest_str)
    with pytest.raises(KvcalError, match="exactly the K/V scales of 2 layers"):
        load_scale_file(tmp_path / "layers.safetensors")
    # a float16 scale
    t4 = dict(tensors)
    for dtype in (torch.float16, torch.bfloat16, torch.float64):
        t4[K_NAME.format(i=0)] = tensors[K_NAME.format(i=0)].to(dtype)
        write_raw(tmp_path / "dtype.safetensors", t4, manifest_str)
        with pytest.raises(KvcalError, match="not a float32 tensor"):
            load_scale_file(tmp_path / "dtype.safetensors")
    # building with the wrong number of layers
    with pytest.raises(KvcalError, match="1 K and 1 V scale tensors for a model of 2 layers"):
        make_scale_set("fp8", "tensor", [0.1], [0.1], observer="minmax", binding=good.binding)


def test_manifest_refusals(word_llama_dir: Path, tmp_path: Path) -> None:
    good = random_scale_set(word_llama_dir)
    tensors = good.tensors()
    write_raw(tmp_path / "garbled.safetensors", tensors, '{"schema": "kvcal.scales", ')
    with pytest.raises(KvcalError, match="garbled manifest"):
        load_scale_file(tmp_path / "garbled.safetensors")
    from safetensors.torch import save_file

    save_file(tensors, str(tmp_path / "plain.safetensors"))
    with pytest.raises(KvcalError, match="not a kvcal scale file"):
        load_scale_file(tmp_path / "plain.safetensors")
    for key, value, message in (
        ("kv_format", "fp4_e2m1", "no static scales"),
        ("kv_format", "fp9", "unknown KV format"),
        ("schema_version", 99, "upgrade kvcal"),
        ("schema", "other", "no kvcal manifest"),
    ):
        write_raw(tmp_path / "m.safetensors", tensors, json.dumps(dict(good.manifest, **{key: value})))
        with pytest.raises(KvcalError, match=message):
            load_scale_file(tmp_path / "m.safetensors")
    with pytest.raises(UsageError, match="does not exist"):
        load_scale_file(tmp_path / "missing.safetensors")
    with pytest.raises(UsageError, match="is a folder"):
        load_scale_file(tmp_path)


def test_truncated_and_tampered_files_refused(word_llama_dir: Path, tmp_path: Path) -> None:
    path = save_scale_file(tmp_path / "s.safetensors", random_scale_set(word_llama_dir))
    data = path.read_bytes()
    bad = tmp_path / "bad.safetensors"
    for cut in (0, 4, 8, 100, len(data) // 2, len(data) - 1):
        bad.write_bytes(data[:cut])
        with pytest.raises(KvcalError, match="truncated or corrupted"):
            load_scale_file(bad)
    # flipped bytes are refused wherever they sit: header, manifest, checksum and tensor data alike
    # (every 5th byte of the header, every byte of the tensor data at the end)
    for pos in sorted(set(range(0, len(data), 5)) | set(range(len(data) - 4 * 2 * NUM_LAYERS, len(data)))):
        flipped = bytearray(data)
        flipped[pos] ^= 0x01
        bad.write_bytes(bytes(flipped))
        with pytest.raises(KvcalError):
            load_scale_file(bad)


def test_unwritable_output_leaves_nothing(word_llama_dir: Path, tmp_path: Path) -> None:
    blocker = tmp_path / "file.txt"
    blocker.write_text("x")
    with pytest.raises(KvcalError, match="cannot write scale file"):
        save_scale_file(blocker / "s.safetensors", random_scale_set(word_llama_dir))
    with pytest.raises(UsageError, match="is a folder"):
        save_scale_file(tmp_path, random_scale_set(word_llama_dir))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file.txt"]


# --------------------------------------------------------------------------------------------- binding


def test_verify_detects_weight_config_tokenizer_and_layer_changes(
    word_llama_dir: Path, word_llama: WordLlama, tmp_path: Path
) -> None:
    ss = random_scale_set(word_llama_dir)
    kv = spec(word_llama_dir)
    assert binding_differences(ss, "tiny", word_llama_dir, kv) == []
    # a copy elsewhere is the same checkpoint
    copy = tmp_path / "copy"
    shutil.copytree(word_llama_dir, copy)
    assert binding_differences(ss, str(copy), copy, kv) == []
    # one weight value changes
    from safetensors.torch import load_file, save_file

    weights = load_file(str(copy / "model.safetensors"))
    name = "model.layers.1.mlp.down_proj.weight"
    weights[name][3, 5] += 1e-3
    save_file(weights, str(copy / "model.safetensors"), metadata={"format": "pt"})
    assert binding_differences(ss, str(copy), copy, kv) == ["weights changed (model.safetensors)"]
    # config.json changes too
    cfg = json.loads((copy / "config.json").read_text())
    cfg["rope_theta"] = 20000.0
    (copy / "config.json").write_text(json.dumps(cfg))
    assert binding_differences(ss, str(copy), copy, spec(copy)) == [
        "config.json changed",
        "weights changed (model.safetensors)",
    ]
    # the tokenizer
    copy2 = tmp_path / "copy2"
    shutil.copytree(word_llama_dir, copy2)
    tok = json.loads((copy2 / "tokenizer.json").read_text())
    tok["model"]["vocab"]["t255"], tok["model"]["vocab"]["t254"] = 254, 255
    (copy2 / "tokenizer.json").write_text(json.dumps(tok))
    assert binding_differences(ss, str(copy2), copy2, kv) == ["tokenizer changed (tokenizer.json)"]
    # another architecture
    other = word_llama(3)
    diffs = binding_differences(ss, str(other), other, spec(other))
    assert diffs[0] == "layer count 2 != 3" and "config.json changed" in diffs


def test_hash_cache_is_used_and_invalidated_by_mtime(word_llama_dir: Path, tmp_path: Path) -> None:
    model = tmp_path / "m"
    shutil.copytree(word_llama_dir, model)
    kv = spec(model)
    ss = random_scale_set(model)  # hashes the weights once, filling the cache
    key = str((model / "model.safetensors").resolve())
    cache = json.loads(hash_cache_path().read_text())
    st = (model / "model.safetensors").stat()
    assert cache[key]["size"] == st.st_size and cache[key]["mtime_ns"] == st.st_mtime_ns
    assert cache[key]["sha256"] == ss.binding["weight_files"]["model.safetensors"]
    # Prove the second verify does not re-read the weights: poison the cached digest (size + mtime unchanged);
    # a re-read would find the true digest and report "bound".
    cache[key]["sha256"] = "0" * 64
    hash_cache_path().write_text(json.dumps(cache))
    assert binding_differences(ss, "m", model, kv) == ["weights changed (model.safetensors)"]
    # a new mtime invalidates the entry: the file is hashed again and the cache repaired
    os.utime(model / "model.safetensors", ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))
    assert binding_differences(ss, "m", model, kv) == []
    assert (
        json.loads(hash_cache_path().read_text())[key]["sha256"]
        == ss.binding["weight_files"]["model.safetensors"]
    )


def test_load_scales_for_model(word_llama_dir: Path, word_llama: WordLlama, tmp_path: Path) -> None:
    path = save_scale_file(tmp_path / "s.safetensors", random_scale_set(word_llama_dir))
    kv = spec(word_llama_dir)
    assert load_scales_for_model(path, "tiny", word_llama_dir, kv, kv_format="fp8").binding_warnings == []
    with pytest.raises(KvcalError, match="holds fp8_e4m3 scales but the KV format is fp8_e5m2"):
        load_scales_for_model(path, "tiny", word_llama_dir, kv, kv_format="fp8_e5m2")
    copy = tmp_path / "copy"
    shutil.copytree(word_llama_dir, copy)
    cfg = json.loads((copy / "config.json").read_text())
    cfg["rms_norm_eps"] = 1e-5
    (copy / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(KvcalError, match="stale .*config.json changed"):
        load_scales_for_model(path, "copy", copy, spec(copy))
    forced = load_scales_for_model(path, "copy", copy, spec(copy), force=True)
    assert len(forced.binding_warnings) == 1 and "config.json changed" in forced.binding_warnings[0]
    other = word_llama(3)
    with pytest.raises(KvcalError, match="layer count 2 != 3"):  # force never overrides geometry
        load_scales_for_model(path, "three", other, spec(other), force=True)


# --------------------------------------------------------------------------------------------- CLI


def test_cli_show_verify(word_llama_dir: Path, tmp_path: Path, invoke: Invoke) -> None:
    path = save_scale_file(tmp_path / "s.safetensors", random_scale_set(word_llama_dir, "head"))
    code, out, err = invoke(["show", str(path)])
    assert code == 0, err
    assert "fp8_e4m3" in out and "minmax" in out and "SQNR" in out and "31.5" in out
    code, out, _ = invoke(["show", str(path), "--json"])
    doc = json.loads(out)
    assert code == 0 and doc["granularity"] == "head" and len(doc["k_scales"][0]) == KV_HEADS
    assert doc["manifest"]["layer_stats"][1]["layer"] == 1

    code, out, err = invoke(["verify", str(path), str(word_llama_dir)])
    assert code == 0 and "bound" in out, err
    copy = tmp_path / "copy"
    shutil.copytree(word_llama_dir, copy)
    (copy / "config.json").write_text((copy / "config.json").read_text() + "\n")
    code, out, err = invoke(["verify", str(path), str(copy)])
    assert code == 1
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: ") and "config.json changed" in lines[0]
    code, out, _ = invoke(["verify", str(path), str(copy), "--json"])
    assert code == 1 and json.loads(out) == {
        "scales": str(path),
        "model": str(copy),
        "bound": False,
        "differences": ["config.json changed"],
    }
    # bad input: one Error line each, exit 2 (usage) / 1 (bad data)
    code, _, err = invoke(["show", str(tmp_path / "nope.safetensors")])
    assert code == 2 and err.startswith("Error: ") and "does not exist" in err
    (tmp_path / "trunc.safetensors").write_bytes(path.read_bytes()[:50])
    code, _, err = invoke(["verify", str(tmp_path / "trunc.safetensors"), str(word_llama_dir)])
    assert code == 1 and err.startswith("Error: ") and "truncated or corrupted" in err
    code, _, err = invoke(["verify", str(path), str(tmp_path / "no-model")])
    assert code == 2 and err.startswith("Error: ")
