"""Triton fused-dequant attention vs the torch reference, on CPU under the Triton interpreter.

Tolerance (scale-free): the kernel's max error against the float64 reference must be within C = 8 times the float32
reference's own max error against the float64 reference, plus 4 float32 ulps of the output's magnitude (for cases
where the float32 reference happens to be exact, e.g. a single visible key; one bf16 ulp for a bf16 output). Both references read the same
quantized storage, so the comparison isolates the kernel's arithmetic.

The interpreter runs each program instance in numpy, so sizes are tiny; the cases cover every format, decode
(split-K and not) and prefill, lengths 1/17/257, GQA ratios 1/3/4/8, head_dim 64/128/256, sliding windows (with a
window-sized cache, k_start > 0), softcap, sinks, key padding (including empty rows) and batch > 1, without the
full cartesian product. vLLM's TurboQuant presets (K/V pairs of side formats, MSE keys rotated by H / sqrt(D))
each run decode and prefill at an odd length (37 keys) with GQA.

TRITON_INTERPRET=1 is set per test (monkeypatch), not at import: `triton_attention` creates its jit kernels on first
use for the current mode and calls none of the jit helpers that triton decorates at its own import, so it does not
matter that other test modules (transformers) import triton first, and the setting does not leak into them.
"""

from __future__ import annotations

import inspect
import zlib
from dataclasses import dataclass, field

import pytest
import torch

pytest.importorskip("triton")

from kvcal import formats  # noqa: E402
from kvcal.errors import UsageError  # noqa: E402
from kvcal.kernels import triton_attention as ta  # noqa: E402
from kvcal.kernels.reference import quantized_attention_ref  # noqa: E402

C_TOL = 8.0


@pytest.fixture(autouse=True)
def _interpret(monkeypatch: pytest.MonkeyPatch) -> None:
    # The kernels are created lazily for the current mode, so setting the variable per test is enough (and does not
    # leak into other test modules). No pinned config from the caller's environment.
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.delenv("KVCAL_TRITON_CONFIG", raising=False)
    monkeypatch.delenv("KVCAL_TRITON_SPLITS", raising=False)


@dataclass
class Case:
    fmt: str
    tq: int
    tk: int
    group: int  # H_q // H_kv
    d: int
    h_kv: int = 1
    b: int = 1
    q_start: int | None = None  # default: the queries are the last Tq positions of the keys
    k_start: int = 0
    causal: bool = True
    window: int | None = None
    softcap: float | None = None
    sinks: bool = False
    pad_left: tuple[int, ...] = ()  # per batch row: number of left-padding keys (key_padding False)
    splits: int | None = None
    per_head_scale: bool = False
    q_dtype: torch.dtype = torch.float32
    extra: dict = field(default_factory=dict)

    def id(self) -> str:
        parts = [self.fmt, f"q{self.tq}", f"k{self.tk}", f"g{self.group}", f"d{self.d}"]
        for flag, name in (
            (self.window, "win"),
            (self.softcap, "cap"),
            (self.sinks, "sink"),
            (self.pad_left, "pad"),
            (self.splits, "split"),
            (self.per_head_scale, "headscale"),
            (not self.causal, "noncausal"),
            (self.b > 1, f"b{self.b}"),
            (self.k_start, f"ks{self.k_start}"),
            (self.q_dtype != torch.float32, "bf16q"),
            (self.extra.get("q_transposed"), "qT"),
        ):
            if flag:
                parts.append(name)
        return "-".join(parts)


CASES = [
    # ---- decode (Tq * G <= 64 rows: split-K path) ----
    Case("bf16", 1, 257, 4, 128, h_kv=2, splits=3),
    Case("fp8_e4m3", 1, 257, 8, 64, h_kv=2, splits=4, per_head_scale=True),
    Case("fp8_e5m2", 1, 17, 3, 64, softcap=3.0),
    Case("int8_per_token_head", 1, 257, 1, 128, softcap=4.0, splits=2),
    Case("nvfp4", 1, 257, 4, 64, sinks=True, splits=3, per_head_scale=True),
    Case("fp4_e2m1", 1, 17, 8, 256, sinks=True),
    Case(
        "mxfp4", 1, 64, 3, 128, k_start=300, window=64, splits=2
    ),  # sliding cache: window-sized, k_start > 0
    Case("auto", 1, 1, 1, 64),
    Case("nvfp4", 1, 17, 2, 96),  # head_dim not a power of two (padded tiles)
    Case("nvfp4", 2, 40, 4, 128, b=2, pad_left=(0, 7), splits=2),  # 2 new tokens (speculative-style decode)
    Case("fp8_e4m3", 1, 17, 4, 64, q_dtype=torch.bfloat16),
    Case("fp8_per_token_head", 1, 257, 4, 64, h_kv=2, splits=3),
    Case("fp8_per_token_head", 1, 17, 3, 96, softcap=3.0),  # head_dim not a power of two
    Case("int4_per_token_head", 1, 257, 8, 64, h_kv=2, splits=4, sinks=True),
    Case("int4_per_token_head", 1, 64, 3, 128, k_start=300, window=64, splits=2),
    Case("float16", 1, 33, 4, 64, q_dtype=torch.bfloat16),
    Case("int8_per_tensor", 1, 257, 4, 64, h_kv=2, splits=3, per_head_scale=True),
    # ---- prefill (many rows: row tiles, causal / window tile skipping) ----
    Case("bf16", 17, 17, 3, 64, window=5, extra={"q_transposed": True}),
    Case("fp8_e4m3", 17, 257, 4, 128, softcap=5.0, sinks=True),  # chunked prefill: q_start = 240
    Case("int8_per_token_head", 33, 33, 8, 64, window=8),
    Case("nvfp4", 65, 65, 1, 64, b=2, pad_left=(3, 0), window=20),
    Case("fp4_e2m1", 17, 17, 4, 256, softcap=2.0),
    Case("mxfp4", 40, 40, 2, 64, sinks=True, h_kv=2),
    Case("fp8_e5m2", 17, 30, 4, 64, causal=False),
    Case("fp8_per_token_head", 33, 33, 8, 64, window=8),
    Case("int4_per_token_head", 17, 17, 4, 256, softcap=2.0),
    Case("int4_per_token_head", 33, 41, 2, 64, b=2, pad_left=(3, 0), window=20),
    Case("float16", 17, 17, 3, 64, window=5),
    Case("int8_per_tensor", 17, 40, 4, 64, window=9, sinks=True),
    Case("auto", 17, 17, 4, 128, pad_left=(5,)),  # left padding: the first 5 query rows see no key -> 0
    # ---- TurboQuant presets (K/V pairs; MSE keys read in the rotated domain, q rotated before the kernel) ----
    Case("turboquant_k8v4", 1, 37, 2, 64, h_kv=2),
    Case("turboquant_4bit_nc", 1, 37, 2, 64, h_kv=2, splits=2),
    Case("turboquant_k3v4_nc", 1, 37, 2, 128, h_kv=2),
    Case("turboquant_3bit_nc", 1, 37, 2, 64, h_kv=2, b=2, pad_left=(0, 5)),
    Case("turboquant_k8v4", 33, 37, 2, 128, h_kv=2),  # 66 rows: the prefill path; chunked (q_start = 4)
    Case("turboquant_4bit_nc", 33, 37, 2, 64, h_kv=2),
    Case("turboquant_k3v4_nc", 33, 37, 2, 64, h_kv=2, b=2, pad_left=(3, 0)),
    Case("turboquant_3bit_nc", 37, 37, 2, 64, h_kv=2),
]


def _run(case: Case) -> tuple[float, float, float]:
    torch.manual_seed(zlib.crc32(case.id().encode()))
    hq = case.h_kv * case.group
    q = (torch.randn(case.b, hq, case.tq, case.d) * 1.5).to(case.q_dtype)
    if case.extra.get(
        "q_transposed"
    ):  # transformers passes q as a [B, Tq, H, D] tensor transposed to [B, H, Tq, D]
        q = q.transpose(1, 2).contiguous().transpose(1, 2)
    k = torch.randn(case.b, case.h_kv, case.tk, case.d) * 2.0
    v = torch.randn(case.b, case.h_kv, case.tk, case.d)
    scale = None
    if case.per_head_scale:
        amax = k.abs().amax(dim=(0, 2, 3))  # [H_kv]
        scale = amax / {"fp8": 448.0, "int": 127.0}.get(case.fmt[:3], 448.0 * 6.0)
    kf, vf = formats.kv_pair(case.fmt)  # a TurboQuant preset: two side formats; otherwise the format twice
    v_scale = None if scale is None else scale * 0.5
    kq = formats.quantize(k, kf, scale=scale)
    vq = formats.quantize(v, vf, scale=v_scale)
    q_start = case.q_start if case.q_start is not None else case.k_start + case.tk - case.tq
    key_padding = None
    if case.pad_left:
        key_padding = torch.ones(case.b, case.tk, dtype=torch.bool)
        for i, n in enumerate(case.pad_left):
            key_padding[i, :n] = False
    sinks = torch.randn(hq) if case.sinks else None
    kw = dict(
        scaling=case.d**-0.5,
        q_start=q_start,
        k_start=case.k_start,
        causal=case.causal,
        sliding_window=case.window,
        softcap=case.softcap,
        sinks=sinks,
        key_padding=key_padding,
        v_fmt=None if vf is kf else vf,
    )
    out = ta.attention(q, kq, vq, kf, num_splits=case.splits, **kw)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert torch.isfinite(out).all()
    # references on float32 / float64 queries, so that a bf16 q does not round their outputs to bf16
    r32 = quantized_attention_ref(q.float(), kq, vq, kf, **kw)
    r64 = quantized_attention_ref(q.double(), kq, vq, kf, compute_dtype=torch.float64, **kw)
    err = (out.double() - r64).abs().max().item()
    err32 = (r32.double() - r64).abs().max().item()
    return err, err32, r64.abs().max().item()


@pytest.mark.parametrize("case", CASES, ids=[c.id() for c in CASES])
def test_kernel_matches_reference(case: Case) -> None:
    err, err32, mag = _run(case)
    # plus the output's own rounding: 4 float32 ulps, or one bf16 ulp when the output is bf16 (2x its max rounding)
    eps = torch.finfo(case.q_dtype).eps * (4 if case.q_dtype == torch.float32 else 1)
    assert err <= C_TOL * err32 + eps * mag, f"kernel err {err:.3e} vs float32 reference err {err32:.3e}"


def test_empty_rows_are_exact_zeros() -> None:
    # left-padded batch row: queries at padded positions see no key at all
    torch.manual_seed(0)
    q = torch.randn(1, 2, 6, 64)
    k = formats.quantize(torch.randn(1, 1, 6, 64), "nvfp4")
    v = formats.quantize(torch.randn(1, 1, 6, 64), "nvfp4")
    pad = torch.tensor([[False, False, False, True, True, True]])
    sinks = torch.tensor([0.5, -1.0])
    out = ta.quantized_attention_triton(
        q, k, v, "nvfp4", scaling=0.125, q_start=0, k_start=0, key_padding=pad, sinks=sinks
    )
    assert torch.equal(out[:, :, :3], torch.zeros_like(out[:, :, :3]))
    assert (out[:, :, 3:].abs() > 0).any()


def test_split_count_does_not_change_result() -> None:
    torch.manual_seed(1)
    q = torch.randn(1, 4, 1, 64)
    k = formats.quantize(torch.randn(1, 1, 130, 64), "fp8_e4m3", scale=0.01)
    v = formats.quantize(torch.randn(1, 1, 130, 64), "fp8_e4m3", scale=0.01)
    kw = dict(scaling=0.125, q_start=129, k_start=0, sinks=torch.randn(4))
    # 5 splits of 32 keys over 130 keys: the last split is empty (exercises the reduction's empty partials)
    outs = [ta.attention(q, k, v, "fp8_e4m3", num_splits=n, **kw) for n in (1, 2, 5)]
    for o in outs[1:]:
        torch.testing.assert_close(o, outs[0], rtol=1e-5, atol=1e-6)


def test_signature_matches_reference() -> None:
    ref = inspect.signature(quantized_attention_ref).parameters
    ker = inspect.signature(ta.quantized_attention_triton).parameters
    # reference-only: compute_dtype, and p_tile (the kernel's FP8 P tile is its BLOCK_N)
    ref_params = [(p.name, p.kind, p.default) for n, p in ref.items() if n not in ("compute_dtype", "p_tile")]
    assert [(p.name, p.kind, p.default) for p in ker.values()] == ref_params


def test_pinned_config_env(monkeypatch: pytest.MonkeyPatch) -> None:
    torch.manual_seed(2)
    q = torch.randn(1, 2, 1, 64)
    k = formats.quantize(torch.randn(1, 1, 50, 64), "mxfp4")
    v = formats.quantize(torch.randn(1, 1, 50, 64), "mxfp4")
    kw = dict(scaling=0.125, q_start=49, k_start=0)
    base = ta.quantized_attention_triton(q, k, v, "mxfp4", **kw)
    monkeypatch.setenv("KVCAL_TRITON_CONFIG", "BLOCK_M=16,BLOCK_N=16,num_warps=2,num_stages=1")
    monkeypatch.setenv("KVCAL_TRITON_SPLITS", "2")
    pinned = ta.quantized_attention_triton(q, k, v, "mxfp4", **kw)
    torch.testing.assert_close(pinned, base, rtol=1e-5, atol=1e-6)
    monkeypatch.setenv("KVCAL_TRITON_CONFIG", "BLOCK_N=24")
    with pytest.raises(UsageError, match="power of two"):
        ta.quantized_attention_triton(q, k, v, "mxfp4", **kw)
    monkeypatch.setenv("KVCAL_TRITON_CONFIG", "TILE=16")
    with pytest.raises(UsageError, match="malformed"):
        ta.quantized_attention_triton(q, k, v, "mxfp4", **kw)


def test_dot_operand_dtype_is_exact_for_the_inputs() -> None:
    kind = ta._dot_kind
    assert (
        kind(True, torch.bfloat16, torch.bfloat16, ta.FMT_PLAIN) == ta.DOT_F32
    )  # interpreter: always float32
    assert kind(False, torch.bfloat16, torch.float8_e4m3fn, ta.FMT_FP8) == ta.DOT_BF16
    assert kind(False, torch.bfloat16, torch.uint8, ta.FMT_NVFP4) == ta.DOT_BF16
    assert kind(False, torch.bfloat16, torch.float16, ta.FMT_PLAIN) == ta.DOT_F32  # fp16 cache, bf16 q
    assert kind(False, torch.float16, torch.float16, ta.FMT_PLAIN) == ta.DOT_F16
    assert kind(False, torch.float16, torch.int8, ta.FMT_INT8) == ta.DOT_F16
    assert kind(False, torch.float16, torch.uint8, ta.FMT_MXFP4) == ta.DOT_F32  # E8M0 range exceeds fp16
    assert kind(False, torch.float32, torch.float8_e5m2, ta.FMT_FP8) == ta.DOT_F32
    # TurboQuant: Lloyd-Max centroids and code * scale + min are float32 numbers, not exact in bf16 / fp16
    for fmt_id in (ta.FMT_TQ_MSE, ta.FMT_TQ_UNIFORM):
        for q_dtype in (torch.bfloat16, torch.float16):
            assert kind(False, q_dtype, torch.uint8, fmt_id) == ta.DOT_F32
    # k8v4: FP8 keys alone would take bf16 dots, the pair takes one type for both products
    pair = (torch.float8_e4m3fn, torch.uint8)
    assert ta._pair_dot_kind(False, torch.bfloat16, pair, (ta.FMT_FP8, ta.FMT_TQ_UNIFORM)) == ta.DOT_F32


def test_autotune_configs_are_valid() -> None:
    for cfg in ta.decode_configs(16) + ta.prefill_configs():
        for blk in (cfg.block_m, cfg.block_n):
            assert blk >= 16 and blk & (blk - 1) == 0
        assert cfg.num_warps in (2, 4, 8) and cfg.num_stages >= 1
    assert all(c.block_m == 32 for c in ta.decode_configs(32))


def test_bad_inputs(monkeypatch: pytest.MonkeyPatch) -> None:
    q = torch.randn(1, 2, 1, 64)
    kq = formats.quantize(torch.randn(1, 1, 8, 64), "fp8_e4m3")
    kw = dict(scaling=0.125, q_start=7, k_start=0)
    with pytest.raises(UsageError, match="multiple of KV heads"):
        ta.quantized_attention_triton(
            torch.randn(1, 3, 1, 64), *[formats.quantize(torch.randn(1, 2, 8, 64), "bf16")] * 2, "bf16", **kw
        )
    with pytest.raises(UsageError, match="sinks"):
        ta.quantized_attention_triton(q, kq, kq, "fp8_e4m3", sinks=torch.zeros(3), **kw)
    # FP4 block scales need head_dim % block == 0: a 48-dim head is fine for nvfp4 (16) but not for mxfp4 (32)
    packed = formats.quantize(torch.randn(1, 1, 8, 48), "nvfp4")
    with pytest.raises(UsageError, match="block size 32"):
        ta.quantized_attention_triton(torch.randn(1, 2, 1, 48), packed, packed, "mxfp4", **kw)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(UsageError, match="CUDA"):
        ta.quantized_attention_triton(q, kq, kq, "fp8_e4m3", **kw)


def test_turboquant_bad_inputs() -> None:
    """What the TurboQuant path refuses before any kernel runs: a head_dim vLLM builds no Hadamard matrix for, an FP8
    query (FlashAttention-3's FP8 attention reads fp8_e4m3 caches only), packed codes of another head_dim."""
    kf, vf = formats.kv_pair("turboquant_4bit_nc")
    kw = dict(scaling=0.125, q_start=7, k_start=0, v_fmt=vf)
    k, v = torch.randn(1, 1, 8, 64), torch.randn(1, 1, 8, 64)
    kq, vq = formats.quantize(k, kf), formats.quantize(v, vf)
    q = torch.randn(1, 2, 1, 64)
    with pytest.raises(UsageError, match="power-of-two head_dim"):
        ta.quantized_attention_triton(torch.randn(1, 2, 1, 48), kq, vq, kf, **kw)
    with pytest.raises(UsageError, match="--attention fp8"):
        ta.quantized_attention_triton(q, kq, vq, kf, q_scale=1.0, **kw)
    # packed codes of another head_dim than q's
    with pytest.raises(UsageError, match="do not fit together"):
        ta.quantized_attention_triton(torch.randn(1, 2, 1, 128), kq, vq, kf, **kw)
    # FP8 keys (k8v4) are read as the fp8 family but apply no scale, whatever QTensor.scale holds (formats.dequantize)
    kf8, vf8 = formats.kv_pair("turboquant_k8v4")
    k8 = formats.quantize(k, kf8)
    scaled = formats.QTensor(codes=k8.codes, scale=torch.tensor(2.0))
    kw8 = dict(kw, v_fmt=vf8)
    vq8 = formats.quantize(v, vf8)
    base = ta.quantized_attention_triton(q, k8, vq8, kf8, **kw8)
    assert torch.equal(ta.quantized_attention_triton(q, scaled, vq8, kf8, **kw8), base)


def test_bench_cpu_part_runs(tmp_path) -> None:
    # bench/attention.py's CPU part at a tiny context (the script is not a package: load it by path)
    import importlib.util
    import json
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "bench" / "attention.py"
    spec = importlib.util.spec_from_file_location("kvcal_bench_attention", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    out = tmp_path / "attention.json"
    assert mod.main(["--device", "cpu", "--repeats", "1", "--contexts", "64", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["cpu"]["rows"]
    assert {r["format"] for r in rows} == set(mod.CPU_FORMATS)
    assert all(r["ref_ms"] > 0 and r["ratio_ref_over_sdpa"] > 0 for r in rows)


# ---- the CUDA code path, compiled ahead of time for sm_90 (H100/H200) without a GPU ----
# The interpreter runs only the float32-dot path; this compiles the bf16-dot / split-K / FP4 variants the way the JIT
# would for a contiguous cache (unit strides specialized to 1, 16-divisible strides and pointers annotated), with
# the ptxas that ships in triton's wheel, so a kernel that cannot compile for a GPU fails here.
_AOT_VARIANTS = {
    # name: (FMT, HEAD_DIM, SPLIT, flags, BLOCK_M, BLOCK_N, num_warps, num_stages, code pointer type)
    "nvfp4-decode-split-sinks": (ta.FMT_NVFP4, 128, True, ("sinks",), 16, 64, 4, 2, "*u8"),
    "fp8-prefill-window-softcap-padding": (ta.FMT_FP8, 128, False, ("window", "softcap", "kpad"), 64, 64, 4, 2, "*fp8e4nv"),
    "fp16-auto-decode-fp16-dots": (ta.FMT_PLAIN, 64, True, (), 16, 64, 4, 2, "*fp16"),
    # FP8 attention (vLLM's FA3 path): P rounded to e4m3 in the kernel (kvcal.kernels.triton_attention._round_e4m3)
    "fp8-prefill-fp8-attention": (ta.FMT_FP8, 128, False, ("pfp8",), 64, 64, 4, 2, "*fp8e4nv"),
    # TurboQuant: 3-bit MSE keys (centroid gather, norm correction) + 3-bit uniform values; FP8 keys + 4-bit values
    "tq-3bit-decode-split": (ta.FMT_TQ_MSE, 128, True, (), 16, 64, 4, 2, "*u8"),
    "tq-k8v4-prefill-padding": (ta.FMT_FP8, 128, False, ("kpad",), 64, 64, 4, 2, "*fp8e4nv"),
}  # fmt: skip
# a variant whose V differs from its K (TurboQuant's pairs): name -> (FMT_V, BITS, BITS_V); float32 dots
_AOT_PAIRS = {
    "tq-3bit-decode-split": (ta.FMT_TQ_UNIFORM, 3, 3),
    "tq-k8v4-prefill-padding": (ta.FMT_TQ_UNIFORM, 0, 4),
}


_POINTERS = ("Q", "K", "V", "KBS", "VBS", "KSC", "VSC", "CENT", "SINKS", "KPAD", "OUT", "PART_ML", "PART_ACC")


@pytest.mark.parametrize("variant", list(_AOT_VARIANTS))
def test_cuda_kernels_compile_for_sm90(variant: str, monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    try:
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource
    except ImportError as exc:  # pragma: no cover - other triton layouts
        pytest.skip(f"triton's AOT compiler API is not available: {exc}")
    import triton

    if not triton.backends.backends.get("nvidia"):
        pytest.skip("triton has no NVIDIA backend here")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))  # compile for real, not from a cache
    monkeypatch.setenv("TRITON_DEFAULT_FP_FUSION", "1")  # triton 3.9's default, stated (silences its warning)
    kern = ta._kernels()
    fmt, d, split, flags, bm, bn, warps, stages, code_t = _AOT_VARIANTS[variant]
    fmt_v, bits, bits_v = _AOT_PAIRS.get(variant, (fmt, 0, 0))
    bs_types = {
        ta.FMT_NVFP4: "*fp8e4nv",
        ta.FMT_MXFP4: "*u8",
        ta.FMT_TQ_MSE: "*fp16",
        ta.FMT_TQ_UNIFORM: "*fp16",
    }
    consts: dict = dict(
        FMT=fmt, BLOCK_SIZE=16 if fmt == ta.FMT_NVFP4 else 2, HEAD_DIM=d, D_PAD=d, CAUSAL=True,
        HAS_WINDOW="window" in flags, HAS_SOFTCAP="softcap" in flags, HAS_SINKS="sinks" in flags,
        HAS_KPAD="kpad" in flags, SPLIT=split, DOT_PREC="tf32x3", BLOCK_M=bm, BLOCK_N=bn,
        FMT_V=fmt_v, BLOCK_SIZE_V=16 if fmt_v == ta.FMT_NVFP4 else 2, BITS=bits, BITS_V=bits_v, P_FP8="pfp8" in flags,
        DOT_KIND=ta.DOT_F32 if variant in _AOT_PAIRS else ta.DOT_F16 if code_t == "*fp16" else ta.DOT_BF16,
    )  # fmt: skip
    # q: fp16 / bf16 as the model's; the float32 query TurboQuant's MSE keys are read with (rotated before the kernel)
    q_t = "*fp16" if code_t == "*fp16" else "*fp32" if fmt == ta.FMT_TQ_MSE else "*bf16"
    ptr_types = {
        "Q": q_t,
        "OUT": q_t,
        "K": code_t,
        "V": "*u8" if fmt_v == ta.FMT_TQ_UNIFORM else code_t,
        "KBS": bs_types.get(fmt, "*fp32"),
        "VBS": bs_types.get(fmt_v, "*fp32"),
        "KPAD": "*u8",
    }
    unit = ("stride_qd", "stride_kd", "stride_vd", "stride_od", "stride_kbsd", "stride_vbsd", "stride_kpt")
    sig, attrs = {}, {}
    for i, name in enumerate(kern.attn.arg_names):
        if name in consts:
            sig[name] = "constexpr"
        elif name in unit:
            sig[name], consts[name] = "constexpr", 1
        elif name in _POINTERS:
            sig[name] = ptr_types.get(name, "*fp32")
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif name in ("sm_scale", "softcap"):
            sig[name] = "fp32"
        else:
            sig[name] = "i32"
            if name.startswith("stride") and name not in (
                "stride_ksc",
                "stride_vsc",
                "stride_kbst",
                "stride_vbst",
            ):
                attrs[(i,)] = [["tt.divisibility", 16]]
    src = ASTSource(fn=kern.attn, signature=sig, constexprs=consts, attrs=attrs)
    compiled = triton.compile(
        src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps, "num_stages": stages}
    )
    assert compiled.asm.get("cubin")
    assert "mma" in compiled.asm["ptx"]  # the bf16 dots run on tensor cores


@pytest.mark.parametrize(
    "fmt", ["fp8_e4m3", "int8_per_token_head", "nvfp4", "turboquant_3bit_nc", "turboquant_k8v4"]
)
def test_kernel_reads_the_cache_buffer_views(fmt: str) -> None:
    """The cache hands the attention views of buffers with spare room (`kvcal.kernels.buffer`: non-contiguous
    codes and block scales); the kernel reads them by their strides: the same output, bit for bit, as from
    contiguous copies. TurboQuant: packed codes, fp16 norms / (scale, min)."""
    from kvcal.kernels.cache import LayerPlan, QuantizedKVCache

    g = torch.Generator().manual_seed(4)
    kf, vf = formats.kv_pair(fmt)
    cache = QuantizedKVCache([LayerPlan(index=0, fmt=kf, v_fmt=None if vf is kf else vf)])
    for n in (9, 1, 1):
        kph, _ = cache.update(torch.randn(2, 2, n, 64, generator=g), torch.randn(2, 2, n, 64, generator=g), 0)
    read = kph.kvcal_read
    assert not read.k.codes.is_contiguous()

    def copy(q: formats.QTensor) -> formats.QTensor:
        bs = None if q.block_scales is None else q.block_scales.contiguous()
        return formats.QTensor(codes=q.codes.contiguous(), block_scales=bs, scale=q.scale)

    q = torch.randn(2, 4, 1, 64, generator=g)
    kw = dict(scaling=0.125, q_start=read.q_start, k_start=read.k_start, v_fmt=read.v_fmt)
    out = ta.attention(q, read.k, read.v, kf, **kw)
    assert torch.equal(out, ta.attention(q, copy(read.k), copy(read.v), kf, **kw))
