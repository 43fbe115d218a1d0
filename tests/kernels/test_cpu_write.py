"""The fused CPU cache write (kvcal/kernels/cpu_write.c) against its torch reference (`decode_write_ref` of
`kvcal.kernels.testing`: the cache's torch write with the plain `formats.quantize` and `formats.dequantize`), bit for bit: stored codes and block scales byte-exact
(NaN codes included), float32 values exact (NaN where the reference has NaN), non-finite counts equal. Over random
K/V with NaN, +-Inf, huge / tiny / subnormal values, all-zero tokens and padding, every scale shape, both input
dtypes and the bf16 rounding of the K/V input dtype; raw float32 bit patterns by hypothesis; every float32 near an
FP8 rounding boundary; fp4_e2m1's exponent near every power of two; and inside the cache: a model's decode with the
kernel equals its decode without. And the build is honest: a failed build or a library whose ABI differs from
cpu_write.py's warns and is refused (tests that build their own library use a fresh KVCAL_CACHE)."""

from __future__ import annotations

import ctypes
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcal import formats
from kvcal.kernels import cpu_write
from kvcal.kernels.runtime import KVRuntime
from kvcal.kernels.testing import decode_write_ref

pytestmark = pytest.mark.skipif(
    cpu_write.library() is None,
    reason=f"fused CPU write {cpu_write.status()}: the cache writes with torch ops",
)


FORMATS = list(cpu_write.FORMATS)


def _bits(t: torch.Tensor | None) -> torch.Tensor | None:
    if t is None:
        return None
    return (
        t.view(torch.uint8)
        if t.element_size() == 1
        else t.view(torch.int16 if t.element_size() == 2 else torch.int32)
    )


def _same_bits(r: torch.Tensor, g: torch.Tensor) -> None:
    """Bit-identical codes, except that a NaN may be any NaN: torch's scalar (ATEN_CPU_CAPABILITY=default) cast
    writes NaN as the positive canonical NaN (bf16 0x7FC0, e4m3 0x7F) where its vectorised kernels and the C write
    keep the sign (0xFFFF, 0xFF), so the reference's NaN bytes depend on the CPU. Every other code is exact."""
    assert r.dtype == g.dtype and r.shape == g.shape
    if r.is_floating_point():  # float codes (bf16, fp8): NaN where the reference has NaN, the rest bit for bit
        nan = r.float().isnan()
        assert torch.equal(nan, g.float().isnan())
        assert torch.equal(_bits(r)[~nan], _bits(g)[~nan])
    else:
        assert torch.equal(_bits(r), _bits(g))


def _check(ref: tuple, got: tuple) -> None:
    for r, g in zip(ref[:2], got[:2], strict=True):
        _same_bits(r.codes, g.codes)
        if r.block_scales is None:
            assert g.block_scales is None
        else:
            _same_bits(r.block_scales, g.block_scales)
    for r, g in zip(ref[2:4], got[2:4], strict=True):
        assert r.dtype == g.dtype == torch.float32 and r.shape == g.shape
        assert torch.equal(r.isnan(), g.isnan()) and torch.equal(r.nan_to_num(), g.nan_to_num())
    assert ref[4] == got[4]


def _scale(fmt: str, kind: str, heads: int, batch: int, g: torch.Generator) -> torch.Tensor | None:
    """A validated scale of `kind` (formats.static_scale's shapes), or None for formats without one."""
    f = formats.get_format(fmt)
    if not f.calibratable:
        return None
    if kind == "one":
        s = torch.tensor(1.0)
    elif kind == "scalar":
        s = torch.exp(torch.randn((), generator=g) * 4)
    elif kind == "heads":
        s = torch.exp(torch.randn(heads, generator=g) * 4)
    elif kind == "sequence":
        s = torch.exp(torch.randn(batch, 1, 1, 1, generator=g) * 4)
    else:  # extreme: products near float32's limits
        s = torch.tensor(1e36 if heads % 2 else 1e-30)
    return formats.static_scale(s, torch.zeros(batch, heads, 1, 1), None)


def _kv(g: torch.Generator, shape: tuple[int, ...], spread: float, specials: bool) -> torch.Tensor:
    x = torch.randn(2, *shape, generator=g) * torch.exp(torch.randn(2, *shape, generator=g) * spread)
    x = x.clamp(-3e38, 3e38)
    if specials:
        flat = x.view(-1)
        flat[::13] = math.nan
        flat[5::17] = math.inf
        flat[7::19] = -math.inf
        flat[3::23] = 1e-42  # subnormal
        flat[11::29] = -0.0
        x[:, :, -1] = 0.0  # an all-zero token (every head)
    return x


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("scale", ["one", "scalar", "heads", "sequence", "extreme"])
def test_matches_the_torch_reference(fmt: str, dtype: torch.dtype, scale: str) -> None:
    g = torch.Generator().manual_seed(len(fmt) * 7 + len(scale))
    b, h, d = 3, 2, 64
    for i in range(12):
        t = 1 + i % 3
        x = _kv(g, (b, h, t, d), spread=3.0 if i % 2 else 25.0, specials=i % 3 == 0).to(dtype)
        k, v = x[0], x[1].transpose(1, 2).contiguous().transpose(1, 2)  # V strided as attention hands it
        valid = None if i % 4 else torch.rand(b, t, generator=g) > 0.3
        kin = torch.bfloat16 if i % 2 else None
        ks, vs = _scale(fmt, scale, h, b, g), _scale(fmt, scale, h, b, g)
        args: tuple[Any, ...] = (k, v, fmt, ks, vs, valid, kin)
        _check(decode_write_ref(*args), cpu_write.decode_write(*args))


PAIRS = [
    *((k.name, v.name) for k, v in formats.TQ_PRESETS.values()),
    ("fp8_e4m3", "nvfp4"),  # kvcal's K != V pairs: each side its own format, scale and aux
    ("int4_per_token_head", "fp4_e2m1"),
    ("fp4_e2m1", "tq_mse3_nc"),
]


@pytest.mark.parametrize("pair", PAIRS, ids="/".join)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_pairs_match_the_torch_reference(pair: tuple[str, str], dtype: torch.dtype) -> None:
    """K and V in two formats (TurboQuant's presets, K != V pairs): each side as its own format writes it."""
    g = torch.Generator().manual_seed(len(pair[0]) * 11 + len(pair[1]))
    b, h, d = 3, 2, 64
    for i in range(12):
        t = 1 + i % 3
        x = _kv(g, (b, h, t, d), spread=3.0 if i % 2 else 25.0, specials=i % 3 == 0).to(dtype)
        k, v = x[0], x[1].transpose(1, 2).contiguous().transpose(1, 2)
        valid = None if i % 4 else torch.rand(b, t, generator=g) > 0.3
        kin = torch.bfloat16 if i % 2 else None
        ks, vs = _scale(pair[0], "heads", h, b, g), _scale(pair[1], "scalar", h, b, g)
        args: tuple[Any, ...] = (k, v, pair[0], ks, vs, valid, kin)
        _check(decode_write_ref(*args, v_fmt=pair[1]), cpu_write.decode_write(*args, v_fmt=pair[1]))


@settings(max_examples=60, deadline=None)
@given(
    fmt=st.sampled_from(FORMATS),
    words=st.lists(st.integers(0, 2**32 - 1), min_size=2 * 64, max_size=2 * 64),
    log_scale=st.floats(-40.0, 40.0),
)
def test_any_float32_bits(fmt: str, words: list[int], log_scale: float) -> None:
    """Any float32 bit pattern (NaN payloads, infinities, subnormals, the largest finite values), any scale."""
    x = torch.tensor(words, dtype=torch.int64).to(torch.int32).view(torch.float32).reshape(2, 1, 1, 1, 64)
    s = None
    if formats.get_format(fmt).calibratable:
        s = formats.static_scale(torch.tensor(2.0**log_scale), x[0], None)
    _check(decode_write_ref(x[0], x[1], fmt, s, s), cpu_write.decode_write(x[0], x[1], fmt, s, s))


@pytest.mark.parametrize("fmt", ["fp8_e4m3", "fp8_e5m2", "bf16", "float16"])
def test_every_rounding_boundary(fmt: str) -> None:
    """Every float32 within 2 ulps of a midpoint between two representable values of the target (FP8 codes,
    float16 (every subnormal and normal step up to the tie above 65504 that rounds to Inf), or bf16 for the bf16
    format and the K/V input rounding): round-to-nearest-even and saturation exactly torch's."""
    if fmt == "bf16":
        grid = torch.arange(0, 0x7F80, 7, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).float()
    elif fmt == "float16":
        grid = torch.arange(0, 0x7C00, dtype=torch.int32).to(torch.int16).view(torch.float16).float()
    else:
        dt = torch.float8_e4m3fn if fmt == "fp8_e4m3" else torch.float8_e5m2
        grid = torch.arange(0, 128, dtype=torch.uint8).view(dt).float()
        grid = grid[torch.isfinite(grid)]
    grid = grid.sort().values
    mids = torch.cat([(grid[:-1] + grid[1:]) / 2, grid[-1:] * 1.1])  # and past the largest value
    near = torch.cat([mids.view(torch.int32) + o for o in (-2, -1, 0, 1, 2)]).view(torch.float32)
    near = torch.cat([near, -near])
    near = torch.nn.functional.pad(near, (0, -near.numel() % 128)).reshape(2, 1, -1, 1, 64)
    k, v = near[0], near[1]
    s = formats.static_scale(None, k, 1.0) if formats.get_format(fmt).calibratable else None
    _check(decode_write_ref(k, v, fmt, s, s), cpu_write.decode_write(k, v, fmt, s, s))
    _check(  # the K/V input rounding to bf16 (float32 model, bf16 serving dtype) at the same boundaries
        decode_write_ref(k, v, "bf16", kv_input_dtype=torch.bfloat16),
        cpu_write.decode_write(k, v, "bf16", kv_input_dtype=torch.bfloat16),
    )


def test_fp4_e2m1_exponent_near_powers_of_two() -> None:
    """fp4_e2m1's block exponent is ceil(log2(bmax / 6)): block maxima within a few ulps of 6 * 2**k, where the
    last bit of torch's log2 decides the ceiling, give the reference's exponents (the kernel takes torch's)."""
    k = torch.arange(-34, 126, dtype=torch.float32)
    edges = (6.0 * torch.exp2(k)).view(torch.int32)
    near = torch.cat([edges + o for o in range(-3, 4)]).view(torch.float32)
    near = near[torch.isfinite(near)]
    x = torch.zeros(2, 1, 1, near.numel(), 64)
    x[..., 0] = near  # the block max of block 0; the other elements small
    x[..., 1:16] = near[:, None] * 0.3
    x[1] = -x[1]
    _check(decode_write_ref(x[0], x[1], "fp4_e2m1"), cpu_write.decode_write(x[0], x[1], "fp4_e2m1"))


def test_supports_only_what_it_implements() -> None:
    x = torch.zeros(1, 2, 1, 64)
    assert cpu_write.supports(formats.get_format("nvfp4"), x, torch.bfloat16, torch.tensor(1.0))
    assert not cpu_write.supports(formats.get_format("int8_per_token_head"), x, torch.float16, None)
    assert not cpu_write.supports(
        formats.get_format("mxfp4"), torch.zeros(1, 2, 1, 16), None, None
    )  # block 32
    assert not cpu_write.supports(formats.get_format("bf16"), x.half(), None, None)
    strided = torch.zeros(1, 2, 1, 128)[..., ::2]  # the kernel reads rows of contiguous head_dim
    assert not cpu_write.supports(formats.get_format("bf16"), strided, None, None)


def test_off_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVCAL_CPU_WRITE", "0")
    cpu_write.reload()
    try:
        assert cpu_write.library() is None and cpu_write.status() == "skipped: KVCAL_CPU_WRITE=0"
    finally:
        monkeypatch.delenv("KVCAL_CPU_WRITE")
        cpu_write.reload()
    assert cpu_write.library() is not None and cpu_write.status().startswith("compiled: ")


def test_the_library_reports_the_abi_cpu_write_py_passes() -> None:
    """The loaded library's side_t (sizeof, 20 offsets) equals ctypes' _Side and its format ids formats' c_kernel
    column; a ctypes struct that lost a field is a mismatch, named."""
    lib = cpu_write.library()
    assert cpu_write.abi_mismatch(lib) is None  # type: ignore[arg-type]
    assert cpu_write.FORMATS == {
        f.name: f.c_kernel
        for f in (*formats.FORMATS.values(), *formats.TQ_SIDES.values())
        if f.c_kernel is not None
    }
    # every quantized format and TurboQuant's key and value sides, but fp8_e4m3_cpu / fp8_e5m2_cpu (vLLM's CPU
    # build's truncating stores: the torch path writes them; the C write's FP8 conversions round to nearest)
    cpu_stores = ("fp8_e4m3_cpu", "fp8_e5m2_cpu")
    assert set(cpu_write.FORMATS) == {n for n in formats.FORMATS if n not in ("auto", *cpu_stores)} | set(
        formats.TQ_SIDES
    )
    assert all(formats.FORMATS[n].c_kernel is None for n in cpu_stores)

    class Short(ctypes.Structure):
        _fields_ = [f for f in cpu_write._Side._fields_ if f[0] != "aux"]

    assert "side_t is (sizeof, offsets)" in cpu_write.abi_mismatch(lib, Short)  # type: ignore[arg-type,operator]


def _edited_source(tmp_path: Path, old: str, new: str) -> Path:
    src = cpu_write.SOURCE.read_text()
    assert old in src
    out = tmp_path / "cpu_write.c"
    out.write_text(src.replace(old, new, 1))
    return out


def test_a_build_with_another_abi_is_refused_with_a_warning(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A library whose side_t has one more field, or whose format enum moved, is refused: a RuntimeWarning that
    names the difference and KVCAL_CPU_WRITE=0, and no library (the torch write)."""
    monkeypatch.setenv("KVCAL_CACHE", str(tmp_path / "cache"))
    for old, new, what in (
        ("    const float *aux;", "    int64_t extra;\n    const float *aux;", "side_t is"),
        ("F_MXFP4 = 6, F_FP4_E2M1 = 7", "F_MXFP4 = 7, F_FP4_E2M1 = 6", "format ids differ"),
    ):
        src = _edited_source(tmp_path, old, new)
        with pytest.warns(RuntimeWarning, match="KVCAL_CPU_WRITE=0") as rec:
            lib, line = cpu_write.open_library(src)
        assert lib is None and line.startswith("skipped: ") and what in line
        assert len(rec) == 1 and what in str(rec[0].message)


def test_a_failed_build_warns_once_with_the_compilers_message(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KVCAL_CACHE", str(tmp_path / "cache"))
    src = _edited_source(
        tmp_path, "static inline float sat(float y) {", "static inline float sat(float y) { oops"
    )
    with pytest.warns(RuntimeWarning) as rec:
        lib, line = cpu_write.open_library(src)
    assert lib is None and len(rec) == 1
    msg = str(rec[0].message)
    assert "oops" in msg and "error" in msg and "KVCAL_CPU_WRITE=0" in msg  # the compiler's own words
    assert line.startswith("skipped: ") and "exited with" in line
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    with pytest.warns(RuntimeWarning, match="could not run"):
        assert cpu_write.open_library(src)[0] is None


def test_without_a_compiler_it_is_skipped_silently(monkeypatch: pytest.MonkeyPatch, recwarn: Any) -> None:
    """No compiler on PATH is an ordinary machine, not a failure: no warning, a stated reason."""
    monkeypatch.delenv("CC", raising=False)
    monkeypatch.setenv("PATH", "/nonexistent-dir")
    assert cpu_write.open_library() == (None, "skipped: no C compiler (CC, cc or gcc on PATH)")
    assert not [w for w in recwarn if issubclass(w.category, RuntimeWarning)]


@pytest.mark.parametrize(
    "fmt", ["fp8_e4m3", "int8_per_token_head", "nvfp4", "nvfp4_4over6", "mxfp4", "fp4_e2m1"]
)
@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_decode_with_the_kernel_equals_decode_without(
    fmt: str, arch: str, kv_model: Any, batch: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A left-padded batch decoded greedily (sliding layers for gemma3), once through the kernel and once through
    torch ops: the same tokens and bit-identical scores, and the kernel wrote every decode step of every layer."""
    model = kv_model(arch, head_dim=32)
    ids, mask = batch(length=9, pad=3)
    calls = []
    write = cpu_write.write_into
    monkeypatch.setattr(cpu_write, "write_into", lambda *a: calls.append(1) or write(*a))
    runs = []
    for use in (True, False):
        if not use:
            monkeypatch.setattr(cpu_write, "library", lambda: None)
        rt = KVRuntime(model, fmt, impl="torch", kv_input_dtype="bfloat16")
        with torch.no_grad():
            out = model.generate(
                ids,
                attention_mask=mask,
                max_new_tokens=8,  # past gemma3's window of 6
                do_sample=False,
                output_scores=True,
                return_dict_in_generate=True,
                past_key_values=rt.new_cache(),
                pad_token_id=0,
            )
        runs.append((out.sequences, torch.stack(out.scores)))
        if use:
            assert len(calls) == 7 * model.config.num_hidden_layers  # every decode step after the prefill
    assert torch.equal(runs[0][0], runs[1][0]) and torch.equal(runs[0][1], runs[1][1])
