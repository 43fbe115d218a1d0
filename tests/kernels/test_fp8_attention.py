"""FP8 attention (vLLM's FlashAttention-3 path, `--attention fp8`): Q cast to e4m3 with q_scale, softmax P cast to
e4m3 (times 2**8) for P.V, in the torch reference and the Triton kernel (interpreter), and through KVRuntime.

Reference vs kernel: the reference quantizes P per key tile of `p_tile` keys relative to the running row max, as a
flash kernel does; with p_tile = the interpreter's BLOCK_N (32) both round the same P, so the kernel must match the
reference within C times the reference's own float32-vs-float64 error (tests/kernels/test_triton_kernels.py's
tolerance), while FP8 attention itself moves the output by far more than that (checked, so the comparison cannot
pass by quantizing nothing).
"""

from __future__ import annotations

import math

import pytest
import torch

from kvcal import formats
from kvcal.errors import UsageError
from kvcal.kernels import triton_attention as ta  # imports without triton; its kernels need it
from kvcal.kernels.reference import (
    FA3_P_OFFSET,
    quantize_query,
    quantized_attention_ref,
    round_p_e4m3,
)

C_TOL = 8.0
INTERP_BLOCK_N = 32  # triton_attention._interpreter_config


@pytest.fixture()
def interpret(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.delenv("KVCAL_TRITON_CONFIG", raising=False)
    monkeypatch.delenv("KVCAL_TRITON_SPLITS", raising=False)


def test_quantize_query_is_vllms_static_fp8_cast() -> None:
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 3, 5, 16, generator=g) * 40
    for q_scale in (1.0, 0.05, 3.0):
        got = quantize_query(q, q_scale)
        want = (q * (1.0 / q_scale)).clamp(-448, 448).to(torch.float8_e4m3fn).float()
        assert got.dtype == q.dtype and torch.equal(got, want)
    # saturation at +-448 (q / 0.05 reaches 800 and more), and exact in bf16
    assert float(quantize_query(q, 0.05).abs().max()) == 448.0
    qb = q.to(torch.bfloat16)
    assert torch.equal(quantize_query(qb, 0.5).float(), quantize_query(qb.float(), 0.5))


def test_round_p_e4m3_matches_fa3_offset() -> None:
    p = torch.tensor([1.0, 0.5, 2.0**-8 * 0.75, 2.0**-17, 2.0**-18, 0.3, 0.0])
    got = round_p_e4m3(p)
    want = (p * FA3_P_OFFSET).to(torch.float8_e4m3fn).float() / FA3_P_OFFSET
    assert torch.equal(got, want)
    assert got[0] == 1.0 and got[4] == 0.0  # 2**-18 * 256 = 2**-10 is half the smallest subnormal: ties to 0
    assert got[3] == 2.0**-17  # 2**-9 (the smallest e4m3 subnormal) / 256


def test_kernel_e4m3_rounding_matches_torch_cast(interpret: None) -> None:
    """The kernel rounds P by arithmetic (the interpreter's fp32->fp8 cast gives wrong bytes): every e4m3 value,
    every midpoint between neighbours (ties to even) and its float32 neighbours, against torch's cast."""
    triton = pytest.importorskip("triton")
    import triton.language as tl

    ta._kernels()  # installs the jit helpers
    codes = torch.arange(0, 127, dtype=torch.uint8).view(torch.float8_e4m3fn).float()  # 0 .. 448
    mids = (codes[:-1] + codes[1:]) / 2
    up, down = torch.nextafter(mids, mids + 1), torch.nextafter(mids, mids - 1)
    x = torch.cat([codes, mids, up, down]).contiguous()
    out = torch.empty_like(x)

    @triton.jit
    def kernel(X, OUT, N: tl.constexpr):
        offs = tl.arange(0, N)
        tl.store(OUT + offs, ta._round_e4m3(tl.load(X + offs)))

    n = 1 << (x.numel() - 1).bit_length()
    xp = torch.cat([x, torch.zeros(n - x.numel())])
    outp = torch.empty_like(xp)
    kernel[(1,)](xp, outp, N=n)
    out = outp[: x.numel()]
    assert torch.equal(out, x.to(torch.float8_e4m3fn).float())


def _case(b, h_kv, group, tq, tk, d, seed, q_mag=3.0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, h_kv * group, tq, d, generator=g) * q_mag
    k = formats.quantize(torch.randn(b, h_kv, tk, d, generator=g) * 2, "fp8_e4m3", scale=0.02)
    v = formats.quantize(torch.randn(b, h_kv, tk, d, generator=g), "fp8_e4m3", scale=0.01)
    return q, k, v


CASES = {
    # name: (B, H_kv, G, Tq, Tk, D, q_scale, extra kwargs)
    "decode-gqa3-odd": (1, 2, 3, 1, 77, 64, 1.0, {}),
    "decode-2tokens-batch2-padding": (2, 1, 4, 2, 45, 64, 0.02, {"pad": 5}),
    "prefill-odd-gqa2": (1, 2, 2, 37, 37, 64, 0.05, {}),
    "prefill-window-softcap": (1, 1, 1, 33, 33, 128, 0.01, {"sliding_window": 9, "softcap": 20.0}),
    "prefill-sinks-saturating-q": (1, 2, 2, 19, 19, 64, 0.003, {"sinks": True}),
}


@pytest.mark.parametrize("name", list(CASES))
def test_reference_equals_triton_kernel(name: str, interpret: None) -> None:
    pytest.importorskip("triton")
    b, h_kv, group, tq, tk, d, q_scale, extra = CASES[name]
    q, k, v = _case(b, h_kv, group, tq, tk, d, seed=len(name))
    kw: dict = dict(scaling=d**-0.5, q_start=tk - tq, k_start=0)
    if extra.get("pad"):
        pad = torch.ones(b, tk, dtype=torch.bool)
        pad[1, : extra["pad"]] = False
        kw["key_padding"] = pad
    if extra.get("sinks"):
        kw["sinks"] = torch.randn(h_kv * group, generator=torch.Generator().manual_seed(3))
    for key in ("sliding_window", "softcap"):
        if key in extra:
            kw[key] = extra[key]
    ref = quantized_attention_ref(q, k, v, "fp8_e4m3", q_scale=q_scale, p_tile=INTERP_BLOCK_N, **kw)
    ref64 = quantized_attention_ref(
        q, k, v, "fp8_e4m3", q_scale=q_scale, p_tile=INTERP_BLOCK_N, compute_dtype=torch.float64, **kw
    )
    out = ta.quantized_attention_triton(q, k, v, "fp8_e4m3", q_scale=q_scale, **kw)
    ref_err = float((ref.double() - ref64).abs().max())
    tol = C_TOL * ref_err + 4 * torch.finfo(torch.float32).eps * float(ref64.abs().max())
    err = float((out.double() - ref64).abs().max())
    assert err <= tol, f"{name}: kernel error {err:.3g} > tolerance {tol:.3g}"
    # FP8 attention changes the output by far more than the tolerance: the comparison is not vacuous
    plain = quantized_attention_ref(q, k, v, "fp8_e4m3", **kw)
    assert float((plain - ref).abs().max()) > 50 * tol


def test_reference_matches_its_definition() -> None:
    """One key tile: out = (e4m3(P * 256) / 256) . V / sum(P), P = exp(s - max s), s = (e4m3(q / q_scale) . K) *
    scaling * q_scale — the formula written out in float64 against quantized_attention_ref."""
    q, k, v = _case(1, 1, 2, 6, 6, 16, seed=5)
    q_scale, scaling = 0.01, 0.25
    got = quantized_attention_ref(
        q, k, v, "fp8_e4m3", scaling=scaling, q_start=0, k_start=0, q_scale=q_scale, p_tile=None,
        compute_dtype=torch.float64,
    )  # fmt: skip
    q8 = (q * (1 / q_scale)).clamp(-448, 448).to(torch.float8_e4m3fn).double()
    kd, vd = formats.dequantize(k, "fp8_e4m3").double(), formats.dequantize(v, "fp8_e4m3").double()
    s = torch.einsum("bhqd,bkd->bhqk", q8, kd[:, 0]) * scaling * q_scale
    s = s.masked_fill(torch.ones(6, 6, dtype=torch.bool).triu(1), -math.inf)
    p = torch.exp(s - s.amax(-1, keepdim=True))
    p8 = (p * 256).to(torch.float8_e4m3fn).double() / 256
    want = torch.einsum("bhqk,bkd->bhqd", p8, vd[:, 0]) / p.sum(-1, keepdim=True)
    # float32 output of a float64 computation
    torch.testing.assert_close(got.double(), want, rtol=2e-7, atol=2e-7 * float(want.abs().max()))


def test_runtime_fp8_attention_torch_vs_triton(
    kv_model, batch, interpret: None, kv_recorder, batch_bound
) -> None:
    """A tiny Llama through KVRuntime: --attention fp8 with the torch and the Triton implementation agree (prefill
    + decode through the cache), and each differs from its own K/V-only fp8 run.

    Exact: with either implementation every write stores bit for bit fake_quantize of its K/V (fp8_e4m3 at
    vLLM's uncalibrated scale 1.0; zeros for padding). torch tiles P by 128 keys, the kernel by 32: with 13 tokens
    both see one tile, so they round the same P, and the logits differ by the two implementations' float32
    rounding, which the e4m3 casts of Q, P and K/V in later layers may amplify on another CPU: held to
    `batch_bound`, derived here from the same torch-vs-Triton comparison through a BF16 cache, BF16 storage's own
    effect and FP8 attention's response to BF16 rounding of its K/V input."""
    pytest.importorskip("triton")
    from kvcal.kernels.runtime import KVRuntime

    model = kv_model("llama")
    ids, mask = batch()
    real = mask.bool()
    outs, recorders = {}, []
    runs = (  # (implementation, attention, KV format, kv_input_dtype)
        ("torch", "fp8", "fp8_e4m3", None),
        ("triton", "fp8", "fp8_e4m3", None),
        ("torch", "fp8", "fp8_e4m3", "bfloat16"),
        ("torch", "kv", "fp8_e4m3", None),
        ("triton", "kv", "fp8_e4m3", None),
        ("torch", "kv", "bf16", None),
        ("triton", "kv", "bf16", None),
        ("torch", "kv", "auto", None),
    )
    for run in runs:
        impl, attention, fmt, kin = run
        rt = KVRuntime(model, fmt, impl=impl, attention=attention, kv_input_dtype=kin)
        if fmt != "auto":  # 'auto' leaves the model as loaded
            assert rt.describe()["attention"] == attention
            assert rt.q_scales == ([1.0] * 3 if attention == "fp8" else None)  # vLLM's uncalibrated q_scale
        if attention == "fp8" and kin is None:
            recorders.append(kv_recorder(rt))
        cache = rt.new_cache()
        with torch.no_grad():
            first = model(ids[:, :-1], attention_mask=mask[:, :-1], past_key_values=cache).logits
            last = model(ids[:, -1:], attention_mask=mask, past_key_values=cache).logits
        outs[run] = torch.cat([first, last], dim=1)[real]  # [real tokens, V]
        if fmt != "auto":  # 'auto' leaves the model as loaded
            assert rt.q_scales == ([1.0] * 3 if attention == "fp8" else None)  # vLLM's uncalibrated q_scale
    for rec in recorders:  # layers x (prefill, decode)
        assert rec.check_stored_as(lambda x, _: formats.fake_quantize(x, "fp8_e4m3")) == 3 * 2

    def gap(a: tuple, b: tuple) -> float:
        return float((outs[a] - outs[b]).abs().max())

    fp8_t, fp8_k, fp8_bf16_input, kv_t, kv_k, bf16_t, bf16_k, auto = runs
    bound = batch_bound(gap(fp8_t, fp8_bf16_input), gap(bf16_t, bf16_k), gap(bf16_t, auto))
    assert gap(fp8_t, fp8_k) <= bound, bound
    # Each implementation really runs FP8 attention: its e4m3 casts of Q and P (steps 2**5 times BF16's) move the
    # logits from its own K/V-only run by more than BF16 rounding of every K/V element does.
    assert min(gap(fp8_t, kv_t), gap(fp8_k, kv_k)) > gap(bf16_t, auto)


def test_attention_mode_refusals(kv_model) -> None:
    from kvcal.kernels.runtime import KVRuntime

    model = kv_model("llama")
    with pytest.raises(UsageError, match="fp8_e4m3 K/V cache"):
        KVRuntime(model, "nvfp4", attention="fp8")
    with pytest.raises(UsageError, match="unknown --attention"):
        KVRuntime(model, "fp8_e4m3", attention="fp4")
    rt = KVRuntime(model, "fp8_e4m3", attention="fp8")
    assert rt.q_scales == [1.0] * 3  # vLLM's uncalibrated q_scale
    assert all(p.q_scale == 1.0 for p in rt.plans)
