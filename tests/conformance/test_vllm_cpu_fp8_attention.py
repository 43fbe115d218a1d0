"""vLLM's CPU build's attention over its FP8 KV cache (`vllm._custom_ops.cpu_attention_with_kv_cache` after
`cpu_attn_reshape_and_cache`, kv_cache_dtype 'fp8' / 'fp8_e5m2'), the compiled ops of the installed release run in
the engine's own Python: is the engine's FP8 attention the attention of kvcal's dequantized cache?

kvcal emulates the engine as: store (fp8_e4m3_cpu / fp8_e5m2_cpu, byte for byte the engine's: test_vllm_cpu_fp8.py),
dequantize (codes x scale), attend. The engine's kernel could do more (another rounding of the dequantized values,
a scale applied elsewhere, another accumulation). One prefill of T tokens, GQA, causal, bfloat16 Q/K/V, calibrated-
like scales (not powers of two): the engine's FP8 output `o8` is held to float64 attention over kvcal's float32
dequantized K/V, within twice the engine's own BF16 error (its BF16-cache output against float64 attention over the
unquantized K/V: the bound is the machine's, derived in the test). The round-to-nearest store's dequantized K/V must
fall outside that bound (the test can tell the two stores apart). Measured damages (relative output change) are
printed: the engine's FP8 - BF16 against the emulation's.
"""

from __future__ import annotations

import sys
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from kvcal import formats

ENGINE_SCRIPT = textwrap.dedent("""
    import json, sys
    import torch
    from safetensors.torch import load_file, save_file
    if not (torch.cpu._is_avx512_supported() or torch.cpu._is_amx_tile_supported()):
        print(json.dumps({"skip": "this CPU has neither AVX-512 nor AMX: vLLM's CPU build refuses an FP8 KV cache "
                          "here (FP8 KV cache on CPU requires x86 with AVX-512 or AMX)"}))
        sys.exit(0)
    if torch.cpu._is_amx_tile_supported():
        torch._C._cpu._init_amx()  # the kernel's AMX tiles need the process's permission (the engine asks too)
    from vllm import _custom_ops as ops
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa
    t = load_file(sys.argv[1]); cfg = json.loads(sys.argv[3])
    q, k, v = t["q"], t["k"], t["v"]
    T, H, D = q.shape; HKV, BS = k.shape[1], cfg["block_size"]
    nb = -(-T // BS)
    slots = torch.arange(T, dtype=torch.int64)
    qsl = torch.tensor([0, T], dtype=torch.int32); sl = torch.tensor([T], dtype=torch.int32)
    out = {}
    for name, dtype, ks, vs in (("o16", "auto", 1.0, 1.0), ("o8", cfg["kv_cache_dtype"], cfg["k_scale"], cfg["v_scale"])):
        isa = _get_attn_isa(q.dtype, BS, D, dtype)
        # the backend's cache: [blocks, H_kv, block_size, 2 * D] viewed as K and V halves (cpu_attn.py forward)
        kv = torch.zeros(nb, HKV, BS, 2 * D, dtype=torch.uint8 if dtype != "auto" else q.dtype)
        kc, vc = kv.view(nb, HKV, 2 * BS, D).chunk(2, dim=2)
        ops.cpu_attn_reshape_and_cache(k, v, kc, vc, slots, isa, k_scale=ks, v_scale=vs, kv_cache_dtype=dtype)
        md = ops.cpu_attn_get_scheduler_metadata(
            num_reqs=1, num_heads=H, num_kv_heads=HKV, head_dim=D, seq_lens=sl, dtype=q.dtype, query_start_loc=qsl,
            causal=True, sliding_window_size=-1, isa=isa, enable_kv_split=False, kv_cache_dtype=dtype)
        o = torch.zeros_like(q)
        ops.cpu_attention_with_kv_cache(
            query=q, key_cache=kc, value_cache=vc, output=o, query_start_loc=qsl, seq_lens=sl, scale=D ** -0.5,
            causal=True, alibi_slopes=None, sliding_window=-1, block_table=torch.arange(nb, dtype=torch.int32)[None],
            softcap=0.0, scheduler_metadata=md, s_aux=None, dynamic_causal=None, k_scale=ks, v_scale=vs,
            kv_cache_dtype=dtype)
        out[name] = o
        out["isa_" + name] = isa
    save_file({"o16": out["o16"], "o8": out["o8"]}, sys.argv[2])
    print(json.dumps({"isa": [out["isa_o16"], out["isa_o8"]]}))
""")

# vLLM's kv_cache_dtype -> (kvcal's emulation of the CPU build's store, the round-to-nearest format)
STORES = {"fp8": ("fp8_e4m3_cpu", "fp8_e4m3"), "fp8_e5m2": ("fp8_e5m2_cpu", "fp8_e5m2")}


def attention64(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal GQA attention in float64: q [T, H, D], k/v [T, H_kv, D] -> [T, H, D]."""
    rep = q.shape[1] // k.shape[1]
    qh, kh, vh = (x.double().transpose(0, 1) for x in (q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)))
    out = torch.nn.functional.scaled_dot_product_attention(qh, kh, vh, is_causal=True)
    return out.transpose(0, 1)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


@pytest.mark.slow
@pytest.mark.parametrize("kv_cache_dtype", sorted(STORES))
def test_cpu_fp8_attention_is_the_attention_of_the_dequantized_cache(
    run_engine: Callable[..., Any], vllm_version: str, tmp_path: Path, kv_cache_dtype: str
) -> None:
    cpu_fmt, rne_fmt = STORES[kv_cache_dtype]
    t, h, hkv, d, bs = 300, 9, 3, 64, 32  # SmolLM2's heads and head size; 300 tokens span 10 blocks
    k_scale, v_scale = 0.0371, 0.0213  # not powers of two: code x scale is not a bfloat16 number
    g = torch.Generator().manual_seed(0)
    q = torch.randn(t, h, d, generator=g).to(torch.bfloat16)
    k = (torch.randn(t, hkv, d, generator=g) * 2).to(torch.bfloat16)
    v = torch.randn(t, hkv, d, generator=g).to(torch.bfloat16)
    cfg = {"block_size": bs, "k_scale": k_scale, "v_scale": v_scale, "kv_cache_dtype": kv_cache_dtype}
    info, got = run_engine(ENGINE_SCRIPT, tmp_path, {"q": q, "k": k, "v": v}, cfg)
    o16, o8 = got["o16"], got["o8"]

    def dequantized(fmt: str) -> tuple[torch.Tensor, torch.Tensor]:
        """kvcal's store and dequantization of K and V, in float32 (codes x scale, not rounded to bfloat16)."""
        return tuple(  # type: ignore[return-value]
            formats.dequantize(formats.quantize(x.float(), fmt, s), fmt, dtype=torch.float32)
            for x, s in ((k, k_scale), (v, v_scale))
        )

    exact = attention64(q, k, v)
    emulated = attention64(q, *dequantized(cpu_fmt))
    rne = attention64(q, *dequantized(rne_fmt))
    own_bf16_error = _rel(o16, exact)  # the engine's BF16 attention against float64: its arithmetic's error
    fp8_error = _rel(o8, emulated)
    print(
        f"{kv_cache_dtype} (ISA {info['isa']}): engine FP8 vs attention of kvcal's {cpu_fmt} cache {fp8_error:.2e}, "
        f"vs {rne_fmt}'s {_rel(o8, rne):.2e}; engine BF16 vs exact {own_bf16_error:.2e}; damage (relative output "
        f"change): engine {_rel(o8, o16):.4f}, {cpu_fmt} {_rel(emulated, exact):.4f}, {rne_fmt} {_rel(rne, exact):.4f}",
        file=sys.stderr,
    )
    assert fp8_error <= 2 * own_bf16_error, (
        f"the engine's FP8 attention is {fp8_error:.2e} from the attention of kvcal's {cpu_fmt} cache, beyond twice "
        f"its own BF16 error ({own_bf16_error:.2e}): the kernel computes something else"
    )
    assert _rel(o8, rne) > 2 * own_bf16_error, f"the test cannot tell {cpu_fmt} from {rne_fmt}"


# ---- a defect of vllm-cpu 0.32.0 (AMX): small E4M3 V codes are lost in its FP8 attention ---------------------------
# Found on the user's path: with FP8 at scale 1.0 (no checkpoint scales) the engine's wikitext damage on SmolLM2 is
# 2.5x the attention of its own stored cache (docs/studies/engine-conformance-smollm2.md, engine-fp8-scale1).


def _amx_only(info: dict[str, Any]) -> None:
    """The defect was measured on the AMX kernels (Intel Xeon, 2026-12-07); the `vec` kernels (AVX-512 without
    AMX) were not measured: there the test says so instead of asserting either way."""
    if info["isa"][1] != "amx":
        pytest.skip(f"the small-V-code defect is measured on vLLM's AMX kernels; this CPU runs ISA {info['isa'][1]}")


@pytest.mark.slow
def test_cpu_fp8_attention_reads_e4m3_subnormal_v_codes_as_zero(
    run_engine: Callable[..., Any], vllm_version: str, tmp_path: Path
) -> None:
    """One token (its attention weight is 1, the output is its V row as the kernel reads it) whose V holds every
    E4M3 value, v_scale 1.0: the engine returns every normal code exactly and the 14 subnormal codes (0x01-0x07,
    0x81-0x87) as 0, although its store keeps them (test_vllm_cpu_fp8.py)."""
    codes = torch.arange(256, dtype=torch.int32)
    codes = torch.where((codes & 0x7F) == 0x7F, codes - 1, codes).to(torch.uint8)  # the NaN codes left out
    values = codes.view(torch.float8_e4m3fn).float()  # [256] exact in bfloat16
    v = values.reshape(1, 4, 64).to(torch.bfloat16)
    qk = torch.ones(1, 4, 64, dtype=torch.bfloat16)
    cfg = {"block_size": 32, "k_scale": 1.0, "v_scale": 1.0, "kv_cache_dtype": "fp8"}
    info, got = run_engine(ENGINE_SCRIPT, tmp_path, {"q": qk, "k": qk.clone(), "v": v}, cfg)
    _amx_only(info)
    read = got["o8"].float().reshape(-1)
    subnormal = (codes & 0x78) == 0
    assert torch.equal(got["o16"].float().reshape(-1), values)  # its BF16 cache: every value
    assert torch.equal(read[~subnormal], values[~subnormal])
    lost = subnormal & (values != 0)
    print(f"ISA {info['isa']}: {int(lost.sum())} subnormal V codes read as 0", file=sys.stderr)
    assert torch.equal(read[subnormal], torch.zeros(int(subnormal.sum()))), (
        "vLLM's CPU FP8 attention reads E4M3 subnormal V codes as their values now: the defect documented in "
        "docs/engines.md is fixed in this release; update the emulation's notes"
    )


@pytest.mark.slow
def test_cpu_fp8_attention_departs_from_its_cache_when_v_codes_are_small(
    run_engine: Callable[..., Any], vllm_version: str, tmp_path: Path
) -> None:
    """300 tokens, causal, at v_scale 1.0: the engine's FP8 attention departs from the attention of its own stored
    (and kvcal's dequantized) cache by far more than its BF16 error, the more the smaller V is against its scale;
    at calibrated-like scales (codes near the top of the range) it does not (the test above this one's)."""
    t, h, hkv, d = 300, 9, 3, 64
    errors = {}
    for v_mag in (1.0, 0.03):
        g = torch.Generator().manual_seed(0)
        q = torch.randn(t, h, d, generator=g).to(torch.bfloat16)
        k = (torch.randn(t, hkv, d, generator=g) * 2).to(torch.bfloat16)
        v = (torch.randn(t, hkv, d, generator=g) * v_mag).to(torch.bfloat16)
        cfg = {"block_size": 32, "k_scale": 1.0, "v_scale": 1.0, "kv_cache_dtype": "fp8"}
        (tmp_path / str(v_mag)).mkdir()
        info, got = run_engine(ENGINE_SCRIPT, tmp_path / str(v_mag), {"q": q, "k": k, "v": v}, cfg)
        _amx_only(info)
        deq = [formats.dequantize(formats.quantize(x.float(), "fp8_e4m3_cpu", 1.0), "fp8_e4m3_cpu",
                                  dtype=torch.float32) for x in (k, v)]  # fmt: skip
        own = _rel(got["o16"], attention64(q, k, v))
        errors[v_mag] = (_rel(got["o8"], attention64(q, *deq)), own)
    print(f"ISA {info['isa']}: engine FP8 vs its cache's attention at v_scale 1.0 (error, own BF16 error): "
          f"{errors}", file=sys.stderr)  # fmt: skip
    (e1, own1), (e3, _) = errors[1.0], errors[0.03]
    assert e1 > 5 * own1 and e3 > 5 * e1, errors
