"""vLLM's CPU build's FP8 KV cache write (`vllm._custom_ops.cpu_attn_reshape_and_cache`, kv_cache_dtype 'fp8'
and 'fp8_e5m2'), the compiled op of the installed release, run in the engine's own Python (<repo>/.venv-vllm/bin/python, tensors
exchanged as safetensors files). vLLM allows it only on x86 with AVX-512 or AMX (`_get_attn_isa`: "FP8 KV cache on
CPU requires x86 with AVX-512 or AMX"; the AVX2 build has no FP8 dispatch): elsewhere the test skips, saying so.

What the op stores (csrc/cpu/cpu_attn_fp8.hpp `float_to_fp8e4m3_scalar`, called per element by
`reshape_and_cache_fp8_vec_impl` / `_amx_impl`; csrc/cpu/cpu_attn.cpp passes `k_inv = 1.0f / (float)k_scale`):
v = x * k_inv (float32), clamped to +-448 (NaN -> +448: std::min/std::max keep the bound), 0 -> byte 0, else the
float32 bits of v * 2**-120 with the sign and bits 26..20 kept: the E4M3 mantissa TRUNCATED toward zero, not
rounded (subnormals included, through the float32 subnormal of v * 2**-120). kvcal's fp8_e4m3 is the CUDA/Triton
store (x / k_scale, RNE): on the same values the CPU build's bytes differ wherever RNE rounds up. This test holds
the transcription below (`cpu_e4m3`) to the engine's bytes and counts how many of kvcal's fp8_e4m3 codes differ.
'fp8_e5m2' (`float_to_fp8e5m2_scalar`) truncates the same way: the sign, the exponent rebiased, the top 2 mantissa
bits (clamp +-57344, NaN -> +57344, subnormals shifted down): kvcal's fp8_e5m2_cpu, held here to the engine's
bytes beside fp8_e5m2 (torch's RNE cast).
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
    from vllm import _custom_ops as ops
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa
    t = load_file(sys.argv[1]); cfg = json.loads(sys.argv[3])
    k, v, slots = t["key"], t["value"], t["slots"]
    isa = _get_attn_isa(k.dtype, cfg["block_size"], k.shape[2], cfg["kv_cache_dtype"])
    h, d, bs = k.shape[1], k.shape[2], cfg["block_size"]
    kc = torch.zeros(cfg["blocks"], h, bs, d, dtype=torch.uint8); vc = torch.zeros_like(kc)
    ops.cpu_attn_reshape_and_cache(k, v, kc, vc, slots, isa, k_scale=cfg["k_scale"], v_scale=cfg["v_scale"],
                                   kv_cache_dtype=cfg["kv_cache_dtype"])
    save_file({"kc": kc, "vc": vc}, sys.argv[2])
    print(json.dumps({"isa": isa}))
""")


def cpu_e4m3(x: torch.Tensor, inv: float) -> torch.Tensor:
    """kvcal's emulation of the CPU build's store (formats `fp8_e4m3_cpu`'s conversion): x float32, inv =
    float32(1 / scale) -> uint8 E4M3 bytes, mantissa truncated."""
    return formats.cpu_e4m3_bytes(x.float() * torch.tensor(inv, dtype=torch.float32))


def _unpack(cache: torch.Tensor, isa: str, side: str, slots: torch.Tensor) -> torch.Tensor:
    """The engine's [blocks, H, block_size, D] uint8 cache -> [T, H, D] in token order, per its layout: VEC keys
    column-major within a block ([D, block_size]), VEC values row-major; AMX keys as uint16 pairs of 16-token groups,
    AMX values in 2-token sub-groups of 16 elements."""
    nb, h, bs, d = cache.shape
    flat = cache.reshape(nb, h, bs * d)
    blk, off = slots // bs, slots % bs
    i = torch.arange(d)
    if isa == "amx" and side == "k":
        idx = (
            2 * ((off // 16).view(-1, 1) * 16 * (d // 2) + (i // 2).view(1, -1) * 16 + (off % 16).view(-1, 1))
            + i % 2
        )
    elif isa == "amx":
        idx = (i // 16) * bs * 16 + ((off // 2) * 32 + off % 2).view(-1, 1) + 2 * (i % 16)
    elif side == "k":
        idx = i.view(1, -1) * bs + off.view(-1, 1)
    else:
        idx = off.view(-1, 1) * d + i.view(1, -1)
    return torch.stack([flat[blk[t], :, idx[t]] for t in range(len(slots))])  # [T, H, D]


# vLLM's kv_cache_dtype -> (kvcal's emulation of the CPU store, kvcal's round-to-nearest format, K and V
# magnitudes: K saturates at the largest code after * 1 / 0.37, V reaches the subnormal codes)
STORES = {
    "fp8": ("fp8_e4m3_cpu", "fp8_e4m3", 40.0, 0.01),
    "fp8_e5m2": ("fp8_e5m2_cpu", "fp8_e5m2", 4000.0, 1e-4),
}


@pytest.mark.slow
@pytest.mark.parametrize("kv_cache_dtype", sorted(STORES))
def test_cpu_fp8_store_bytes(run_engine: Callable[..., Any], vllm_version: str, tmp_path: Path, kv_cache_dtype: str) -> None:
    cpu_fmt, rne_fmt, k_mag, v_mag = STORES[kv_cache_dtype]
    t, h, d, bs = 45, 2, 64, 32
    g = torch.Generator().manual_seed(7)
    key = (torch.randn(t, h, d, generator=g) * k_mag).to(torch.bfloat16)
    value = (torch.randn(t, h, d, generator=g) * v_mag).to(torch.bfloat16)
    blocks = 4
    slots = torch.randperm(blocks * bs, generator=g)[:t].to(torch.int64)
    cfg = {"block_size": bs, "blocks": blocks, "k_scale": 0.37, "v_scale": 1.0, "kv_cache_dtype": kv_cache_dtype}
    info, got = run_engine(ENGINE_SCRIPT, tmp_path, {"key": key, "value": value, "slots": slots}, cfg)
    for side, x, scale, cache in (("k", key, 0.37, got["kc"]), ("v", value, 1.0, got["vc"])):
        engine = _unpack(cache, info["isa"], side, slots)
        if kv_cache_dtype == "fp8":
            inv = float(torch.tensor(1.0) / torch.tensor(scale, dtype=torch.float32))
            assert torch.equal(engine, cpu_e4m3(x, inv)), (
                f"{side}: the CPU store's bytes are not the transcription's"
            )
        emulated = formats.quantize(x.float(), cpu_fmt, scale).codes.view(torch.uint8)
        assert torch.equal(engine, emulated), f"{side}: kvcal's {cpu_fmt} is not the CPU build's {kv_cache_dtype} store"
        rne = formats.quantize(x.float(), rne_fmt, scale).codes.view(torch.uint8)
        assert bool((rne != engine).any()), f"{side}: no value told the truncating store from {rne_fmt}'s RNE"
        print(
            f"{side}: kvcal {rne_fmt} (RNE) differs from vLLM's CPU {kv_cache_dtype} store in "
            f"{(rne != engine).float().mean():.1%}",
            file=sys.stderr,
        )


def test_cpu_e4m3_transcription_truncates() -> None:
    """What the transcription does, on values a RNE cast rounds up (runs anywhere): 124.3 -> 120 (RNE 128),
    0.0137 (a subnormal, 7.01 * 2**-9) -> 7 * 2**-9, NaN -> 448, -1e-9 -> -0, 500 -> 448."""
    x = torch.tensor([124.3, 0.0137, float("nan"), -1e-9, 500.0, -3.0])
    got = cpu_e4m3(x, 1.0).view(torch.float8_e4m3fn).float().tolist()
    assert (
        got[0] == 120.0 and got[1] == 7 * 2.0**-9 and got[2] == 448.0 and got[4] == 448.0 and got[5] == -3.0
    )
    assert cpu_e4m3(x, 1.0)[3].item() == 0x80  # the sign kept: -0
    assert x[:1].to(torch.float8_e4m3fn).float().item() == 128.0  # kvcal's fp8_e4m3 (RNE) stores 128
