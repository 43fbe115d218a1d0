"""vLLM's TurboQuant presets (turboquant_k8v4, turboquant_4bit_nc, turboquant_k3v4_nc, turboquant_3bit_nc) against
the installed release's own store path, run from its files (nothing copied):

- vllm/model_executor/layers/quantization/turboquant/config.py and centroids.py, executed as modules (they import
  only the standard library and torch): `TurboQuantConfig.from_cache_dtype` and `get_centroids`;
- vllm/v1/attention/backends/turboquant_attn.py: `_build_hadamard(_cached)` and the methods
  `TurboQuantAttentionImpl._ensure_on_device` (PiT = Pi = H / sqrt(D) for every layer, the midpoints of the sorted
  centroids), `do_kv_cache_update` and `_store_kv`, called on an object holding the attributes the impl's
  __init__ sets for them (head_size, num_kv_heads, tq_config, _soa_store False: the default AoS layout);
- vllm/v1/attention/ops/triton_turboquant_store.py: the launcher `triton_turboquant_store` (norm, x / (norm +
  1e-8), y = x_hat @ PiT as a float32 torch matmul, the kernel arguments) and its kernels `_tq_fused_store_mse`,
  `_tq_fused_store_fp8`, `_store_quantized_value` under the Triton interpreter, with `_use_fp8_e4b15` of
  triton_turboquant_decode.py on vLLM's CPU platform (not CUDA-alike: e4nv keys, what Hopper+ stores).

The cache is the backend's page [num_blocks, block_size, H_kv, slot_size_aligned] uint8 handed to
do_kv_cache_update as its (blocks, H, block_size, slot) view, written through a shuffled slot mapping (several
blocks, odd lengths, GQA head counts). Every stored byte of every written slot is compared with kvcal's
`formats.quantize` of the preset's sides, on random and on real (SmolLM2, Gemma-3) K/V:

- uniform values (all presets): codes and the fp16 scale / zero words bit for bit;
- FP8 keys (turboquant_k8v4): bit for bit. The kernel converts with `.to(tl.float8e4nv)`, which the interpreter
  gets wrong (ties away from even, no carry into the exponent, no saturation: test_vllm_per_token_head.py shows
  it): here the interpreter's float32 -> e4nv conversion is PTX cvt.rn.satfinite's rule, written out below on the
  e4m3 grid (round to nearest even, +-448 beyond), what Hopper runs for it;
- MSE keys: the release rotates with a float32 GEMM (cuBLAS on a GPU, torch's CPU matmul here), whose order of
  float operations is its BLAS's; kvcal rotates exactly (float64 sums rounded once, `formats.tq_unit_rotate`) and
  takes the float64 norm. So every rotated value must agree within the float32 rounding of the release's
  arithmetic (the bound derived here from float32's unit roundoff, the head_dim and the two norms' measured
  difference), the kernel's binary search must be kvcal's rule on the release's own values, and a stored code may
  differ only where the two rotations' values lie on either side of the midpoint between the two codes (each such
  code is counted and shown); the fp16 norms likewise only where the two float32 norms round to different fp16.
  A rotation by another matrix (per-layer random signs) fails the bound on most elements.
"""

from __future__ import annotations

import importlib.util
import math
import sys
import types
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from kvcal import formats

STORE = "vllm/v1/attention/ops/triton_turboquant_store.py"
DECODE = "vllm/v1/attention/ops/triton_turboquant_decode.py"
BACKEND = "vllm/v1/attention/backends/turboquant_attn.py"
TQ = "vllm/model_executor/layers/quantization/turboquant"
PRESETS = list(formats.TQ_PRESETS)
U = float(torch.finfo(torch.float32).eps) / 2  # float32's unit roundoff, 2**-24

# every finite e4m3fn magnitude by its bits 0..126 (0x7F is NaN): exponent field e, mantissa m
_E, _M = np.arange(127) >> 3, np.arange(127) & 7
E4M3_MAGS = np.where(_E == 0, _M / 8 * 2.0**-6, (1 + _M / 8) * 2.0 ** (_E - 7))


def e4m3_rn_satfinite(x: np.ndarray) -> np.ndarray:
    """float32 -> e4m3fn bits as PTX cvt.rn.satfinite.e4m3x2.f32: the nearest e4m3 value, ties to the even
    mantissa, magnitudes beyond 448 (Inf included) saturated to 448, NaN kept NaN."""
    a = np.minimum(np.abs(x.astype(np.float64)), 448.0)
    hi = np.clip(np.searchsorted(E4M3_MAGS, a), 0, 126)  # first magnitude >= a
    lo = np.maximum(hi - 1, 0)
    dl, dh = a - E4M3_MAGS[lo], E4M3_MAGS[hi] - a
    pick = np.where((dh < dl) | ((dh == dl) & (hi % 2 == 0)), hi, lo)
    sign = np.where(np.signbit(x), 0x80, 0)
    return np.where(np.isnan(x), 0x7F | sign, pick | sign).astype(np.uint8)


def test_e4m3_rule_is_the_grid_and_torch_agrees() -> None:
    """The rule above on every float32 near an e4m3 midpoint: the same bits as torch's RNE cast of the value
    clamped to +-448 (what kvcal's FP8 keys store), ties to even, saturation."""
    mids = (E4M3_MAGS[:-1] + E4M3_MAGS[1:]) / 2
    near = np.concatenate(
        [mids, np.nextafter(mids.astype(np.float32), 0), np.nextafter(mids.astype(np.float32), 1)]
    )
    x = np.concatenate([near, -near, [0.0, 448.0, 464.0, 480.0, 1e9, np.inf, -np.inf]]).astype(np.float32)
    want = torch.from_numpy(x).clamp(-448, 448).to(torch.float8_e4m3fn).view(torch.uint8).numpy()
    assert np.array_equal(e4m3_rn_satfinite(x), want)
    ties = torch.from_numpy(e4m3_rn_satfinite(np.array([124.0, -68.0, 21.0], np.float32)))
    assert ties.view(torch.float8_e4m3fn).float().tolist() == [128.0, -64.0, 20.0]  # to the even mantissa


@pytest.fixture
def satfinite_e4nv(monkeypatch: pytest.MonkeyPatch) -> None:
    """The interpreter's float32 -> float8e4nv conversion replaced by `e4m3_rn_satfinite` (other casts: its own)."""
    import triton.language as tl
    from triton.runtime import interpreter

    own = interpreter.InterpreterBuilder.create_fp_to_fp

    def create_fp_to_fp(self: Any, src: Any, dst_type: Any, rounding_mode: Any) -> Any:
        if dst_type.scalar == tl.float8e4nv and src.dtype.scalar == tl.float32:
            return interpreter.TensorHandle(e4m3_rn_satfinite(src.data), dst_type.scalar)
        return own(self, src, dst_type, rounding_mode)

    monkeypatch.setattr(interpreter.InterpreterBuilder, "create_fp_to_fp", create_fp_to_fp)


def _module(path: Path) -> types.ModuleType:
    """Execute a release file whose imports are the standard library and torch as a module of its own name."""
    name = f"vllm_release_{path.stem}"
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod  # dataclasses resolves the config's string annotations through it
    spec.loader.exec_module(mod)
    return mod


class _Spy:
    """The release's `_tq_fused_store_mse` as the launcher calls it (`kernel[grid](...)`), keeping (y, norms)."""

    def __init__(self, kernel: Any) -> None:
        self.kernel, self.seen = kernel, []

    def __getitem__(self, grid: Any) -> Callable[..., Any]:
        def launch(*args: Any, **kw: Any) -> Any:
            self.seen.append((args[0].clone(), args[1].clone()))  # y [NH, D], norms [NH]
            return self.kernel[grid](*args, **kw)

        return launch


class Release:
    """The installed release's TurboQuant store path (see the module docstring)."""

    def __init__(self, pkg: Path, load: Callable[..., dict[str, Any]]) -> None:
        self.config = _module(pkg.parent / TQ / "config.py")
        self.centroids = _module(pkg.parent / TQ / "centroids.py")
        dec = load(DECODE, "_use_fp8_e4b15")
        # vllm/platforms/cpu.py: CpuPlatform is not CUDA-alike, so e4nv (as on Hopper+; Ampere / Ada: e4b15)
        dec.update(_FP8_E4B15={}, current_platform=types.SimpleNamespace(is_cuda_alike=lambda: False))
        self.store = load(STORE, "_store_quantized_value", "_tq_fused_store_fp8", "_tq_fused_store_mse",
                          "triton_turboquant_store")  # fmt: skip
        self.spy = _Spy(self.store["_tq_fused_store_mse"])
        self.store.update(_use_fp8_e4b15=dec["_use_fp8_e4b15"], _tq_fused_store_mse=self.spy)
        impl = "TurboQuantAttentionImpl"
        self.backend = load(BACKEND, "_build_hadamard", "_build_hadamard_cached", f"{impl}._ensure_on_device",
                            f"{impl}._store_kv", f"{impl}.do_kv_cache_update")  # fmt: skip
        self.backend.update(
            get_centroids=self.centroids.get_centroids,
            triton_turboquant_store=self.store["triton_turboquant_store"],
        )

    def impl(self, preset: str, h: int, d: int) -> types.SimpleNamespace:
        """What TurboQuantAttentionImpl.__init__ sets for the store path, with its own store methods bound."""
        impl = types.SimpleNamespace(
            head_size=d, num_kv_heads=h, tq_config=self.config.TurboQuantConfig.from_cache_dtype(preset, d),
            _soa_store=False,
        )  # fmt: skip
        for name in ("_ensure_on_device", "_store_kv", "do_kv_cache_update"):
            setattr(impl, name, types.MethodType(self.backend[name], impl))
        return impl

    def write(
        self, preset: str, key: torch.Tensor, value: torch.Tensor, block_size: int = 16
    ) -> dict[str, Any]:
        """key / value [T, H, D] (the model's dtype) through do_kv_cache_update into a fresh paged cache; the
        written slots in token order [T, H, slot_size_aligned] uint8, the layer's buffers, and (MSE keys) the
        launcher's y [T, H, D] and float32 norms [T, H, 1]."""
        t, h, d = key.shape
        impl = self.impl(preset, h, d)
        layer = types.SimpleNamespace()
        nb = (t + block_size - 1) // block_size + 2
        cache = torch.zeros(nb, block_size, h, impl.tq_config.slot_size_aligned, dtype=torch.uint8)
        slots = torch.randperm(nb * block_size, generator=torch.Generator().manual_seed(t))[:t]
        self.spy.seen.clear()
        impl.do_kv_cache_update(
            layer, key.reshape(t, h * d), value.reshape(t, h * d), cache.transpose(1, 2), slots
        )
        out = {"rows": cache[slots // block_size, slots % block_size], "layer": layer, "cfg": impl.tq_config}
        if self.spy.seen:
            (y, norms), *more = self.spy.seen
            assert not more
            out.update(y=y.view(t, h, d), norms=norms.view(t, h, 1))
        return out


@pytest.fixture
def release(
    vllm_pkg: Path, vllm_kernel: Callable[..., Any], vllm_version: str, satfinite_e4nv: None
) -> Release:
    return Release(vllm_pkg, vllm_kernel)


def _words(b: torch.Tensor) -> torch.Tensor:
    """Little-endian byte pairs [..., 2n] -> int16 [..., n] (fp16 bits)."""
    return b.contiguous().view(torch.int16)


def _check_values(w: dict[str, Any], v: torch.Tensor, preset: str, case: str) -> int:
    cfg, rows = w["cfg"], w["rows"]
    vf = formats.TQ_PRESETS[preset][1]
    q = formats.quantize(v, vf)
    vb = math.ceil(v.shape[-1] * vf.bits / 8)
    codes, words = (
        rows[..., cfg.key_packed_size : cfg.key_packed_size + vb],
        rows[..., cfg.key_packed_size + vb :],
    )
    diff = int((codes != q.codes).sum())
    assert diff == 0, (
        f"{preset} {case}: {diff} of {codes.numel()} value code bytes differ from vLLM's release"
    )
    assert torch.equal(_words(words[..., :4]), q.block_scales.view(torch.int16)), (
        f"{preset} {case}: scale / zero"
    )
    return codes.numel() + q.block_scales.numel()


def _check_mse(w: dict[str, Any], k: torch.Tensor, preset: str, case: str) -> tuple[int, int]:
    """MSE keys against the release (module docstring); (elements compared, codes at a midpoint)."""
    kf = formats.TQ_PRESETS[preset][0]
    t, h, d = k.shape
    rows, mids = w["rows"], w["layer"]._tq_midpoints
    mb = math.ceil(d * kf.bits / 8)
    got = formats.tq_unpack(rows[..., :mb], kf.bits, d)  # [T, H, D]
    assert torch.equal(formats.tq_pack(got.to(torch.uint8), kf.bits), rows[..., :mb]), "packing"
    y_rel, n_rel = w["y"], w["norms"]
    # the kernel's binary search on the release's own values is kvcal's rule (code = midpoints <= y)
    assert torch.equal(got, torch.bucketize(y_rel, mids, right=True)), f"{preset} {case}: the kernel's search"
    assert torch.equal(_words(rows[..., mb : mb + 2]), n_rel.half().view(torch.int16)), (
        "the kernel's norm store"
    )

    q = formats.quantize(k, kf)
    want = formats.tq_unpack(q.codes, kf.bits, d)
    n_k, y_k = formats.tq_unit_rotate(k.float())
    assert torch.equal(want, torch.bucketize(y_k, mids, right=True))
    # the bound: the release's y is a float32 dot product of length D with the entries +-h of PiT (each within
    # gamma_D * h * sum|x_hat| of the exact one), on x_hat = x / (norm + 1e-8) whose norm differs from kvcal's by
    # the measured relative r, each division rounding once more; kvcal's y is the exact one rounded once
    r = ((n_rel.double() - n_k.double()).abs() / n_k.double().clamp_min(1e-30)).clamp_max(1.0)
    gamma = d * U / (1 - d * U)
    s = formats.tq_hadamard_entry(d) * (k.double() / n_k.double().clamp_min(1e-30)).abs().sum(
        -1, keepdim=True
    )
    bound = (gamma + r + 3 * U) * s + U * y_k.double().abs()
    gap = (y_rel.double() - y_k.double()).abs()
    off = int((gap > bound).sum())
    assert off == 0, (
        f"{preset} {case}: {off} of {gap.numel()} rotated values differ from the release's by more than its "
        f"float32 rounding (max gap {gap.max().item():.3g}): not the release's rotation"
    )
    differ = got != want
    m = mids[torch.minimum(got, want).clamp(max=mids.numel() - 1)]
    at_mid = (
        ((got - want).abs() == 1)
        & (torch.minimum(y_rel, y_k) <= m)
        & (m <= torch.maximum(y_rel, y_k))
    )  # fmt: skip
    unexplained = int((differ & ~at_mid).sum())
    assert unexplained == 0, (
        f"{preset} {case}: {int(differ.sum())} of {got.numel()} key codes differ from vLLM's release, "
        f"{unexplained} of them not at a midpoint the two rotations' values straddle"
    )
    norms_differ = _words(rows[..., mb : mb + 2]) != q.block_scales.view(torch.int16)
    # a norm may differ only where the two float32 norms round to different fp16 values
    assert torch.equal(norms_differ, n_rel.half().view(torch.int16) != n_k.half().view(torch.int16)), "norms"
    n_mid = int(differ.sum())
    if n_mid or int(norms_differ.sum()):
        print(f"\n{preset} {case}: {n_mid} key codes, {int(norms_differ.sum())} norms at a rounding midpoint")
    return got.numel() + n_rel.numel(), n_mid


def _check(release: Release, preset: str, k: torch.Tensor, v: torch.Tensor, case: str,
           tally: Callable[[str, str, int], None]) -> None:  # fmt: skip
    w = release.write(preset, k, v)
    n = _check_values(w, v, preset, case)
    kf = formats.TQ_PRESETS[preset][0]
    if kf.element == "tq_fp8":
        q = formats.quantize(k, kf)
        codes = w["rows"][..., : k.shape[-1]]
        diff = int((codes != q.codes.view(torch.uint8)).sum())
        assert diff == 0, (
            f"{preset} {case}: {diff} of {codes.numel()} FP8 key bytes differ from vLLM's release"
        )
        n += codes.numel()
    else:
        n += _check_mse(w, k, preset, case)[0]
    rest = w["rows"][..., w["cfg"].slot_size :]  # the alignment byte: never written
    assert not rest.any()
    tally(preset, case, n)


def _random_kv(t: int, h: int, d: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """bf16 K/V [T, H, D] like a model's: heads of scales 1e-2..1e2, a few outlier channels in K, a zero key row,
    a constant value row (its scale floors at 1e-8), keys beyond FP8's 448."""
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(t, h, d, generator=g) * torch.logspace(-2, 2, h).view(1, h, 1)
    k[..., torch.randperm(d, generator=g)[:3]] *= 40.0
    k[0, 0] = 0.0
    v = torch.randn(t, h, d, generator=g) * 3
    v[t // 2, h - 1] = 0.5
    return k.to(torch.bfloat16), v.to(torch.bfloat16)


# (tokens, KV heads, head_dim): odd lengths, GQA head counts, several blocks of 16, the head_dims of real models
RANDOM_SHAPES = [(37, 2, 64), (5, 3, 64), (33, 1, 256), (17, 4, 16), (19, 2, 128)]


@pytest.mark.parametrize("preset", PRESETS)
@pytest.mark.parametrize("shape", RANDOM_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_random_kv_is_the_releases_store(
    preset: str, shape: tuple[int, int, int], release: Release, tally: Callable[[str, str, int], None]
) -> None:
    k, v = _random_kv(*shape, seed=sum(shape))
    _check(release, preset, k, v, f"random {shape}", tally)


@pytest.mark.realmodel
@pytest.mark.parametrize("model", ["smollm2", "gemma3-270m"])
@pytest.mark.parametrize("preset", PRESETS)
def test_real_kv_is_the_releases_store(
    preset: str,
    model: str,
    real_kv: Callable[[str], Any],
    release: Release,
    tally: Callable[[str, str, int], None],
) -> None:
    for i, (k, v) in enumerate(real_kv(model)):
        _check(release, preset, k, v, f"{model} layer#{i}", tally)


@pytest.mark.parametrize("d", [16, 64, 128, 256])
def test_the_releases_tables_are_kvcals(d: int, release: Release) -> None:
    """_ensure_on_device's buffers: PiT = Pi = H / sqrt(D) (entries +-`tq_hadamard_entry`, no signs; the same
    object for every layer), its centroids and midpoints; the config's slot size."""
    for preset in PRESETS:
        impl = release.impl(preset, 2, d)
        layers = [types.SimpleNamespace(), types.SimpleNamespace()]
        for layer in layers:
            impl._ensure_on_device(layer, torch.device("cpu"))
        pit = layers[0]._tq_PiT
        assert pit is layers[1]._tq_PiT and pit is layers[0]._tq_Pi  # one rotation, shared, its own inverse
        assert torch.equal(pit.abs(), torch.full((d, d), formats.tq_hadamard_entry(d)))
        assert torch.equal(formats.tq_rotate(torch.eye(d)), pit)  # row i of I @ PiT
        bits = impl.tq_config.centroid_bits
        assert torch.equal(layers[0]._tq_centroids, formats.tq_centroids(d, bits))
        assert torch.equal(layers[0]._tq_midpoints, formats.tq_midpoints(d, bits))
        assert impl.tq_config.slot_size_aligned == formats.tq_slot_bytes(preset, d)


@pytest.fixture(scope="module", autouse=True)
def _one_thread() -> Iterator[None]:
    """The release's matmul and the interpreter on one thread (a shared 2-core machine)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
