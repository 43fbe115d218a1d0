"""fp8_e4m3, fp8_e5m2, float16 and bf16 against the installed vLLM release's own `reshape_and_cache_kernel_flash`
(vllm/v1/attention/ops/triton_reshape_and_cache_flash.py: the Triton cache write of its TRITON_ATTN backend),
launched as `triton_reshape_and_cache_flash` launches it for the NHD layout [num_blocks, block_size, H, D], under
the Triton interpreter. FP8: the kernel divides by k_scale / v_scale (a float32 tensor) and the store converts;
the cache handed to it is float32 and the conversion to e4m3 / e5m2 is torch's RNE cast (what cvt.rn.satfinite
does on an SM89+ GPU): the interpreter's own float32 -> e4m3 conversion is wrong across binades
(test_vllm_per_token_head.py shows it). float16 / bf16: the kernel stores into a float16 / bfloat16 cache itself.
On a GPU the division is the compiled kernel's: a GPU-only comparison."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from kvcal import formats

FILE = "vllm/v1/attention/ops/triton_reshape_and_cache_flash.py"
KERNEL = "reshape_and_cache_kernel_flash"
CACHE = {
    "fp8_e4m3": (torch.float32, torch.float8_e4m3fn, True),
    "fp8_e5m2": (torch.float32, torch.float8_e5m2, True),
    "float16": (torch.float16, None, False),
    "bf16": (torch.bfloat16, None, False),
}


def _release_store(kernel: Any, key: torch.Tensor, value: torch.Tensor, fmt: str, k_scale: float, v_scale: float,
                   block_size: int = 16) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    cache_dtype, _, fp8 = CACHE[fmt]
    t, h, d = key.shape
    nb = (t + block_size - 1) // block_size + 2
    slots = torch.randperm(nb * block_size, generator=torch.Generator().manual_seed(t))[:t]
    kc = torch.zeros(nb, block_size, h, d, dtype=cache_dtype)
    vc = torch.zeros_like(kc)
    n = h * d
    tile = min(2048, 1 << (n - 1).bit_length())
    kernel[(t, (n + tile - 1) // tile)](
        key, value, kc, vc, slots, torch.tensor([k_scale]), torch.tensor([v_scale]),
        key.stride(0), value.stride(0), kc.stride(0), kc.stride(2), 0, 0, kc.stride(1),
        num_heads=h, head_size=d, block_size=block_size, x=1, USE_HEAD_MAJOR_LAYOUT=False, FP8_KV_CACHE=fp8,
        TILE_SIZE=tile,
    )  # fmt: skip
    blk, off = slots // block_size, slots % block_size
    return kc[blk, off], vc[blk, off]


def _check(kernel: Any, fmt: str, k: torch.Tensor, v: torch.Tensor, case: str,
           tally: Callable[[str, str, int], None]) -> None:  # fmt: skip
    scales = (0.37, 2.0) if CACHE[fmt][2] else (1.0, 1.0)
    kc, vc = _release_store(kernel, k, v, fmt, *scales)
    for x, got, s in ((k, kc, scales[0]), (v, vc, scales[1])):
        want = got.to(CACHE[fmt][1]) if CACHE[fmt][1] is not None else got
        q = formats.quantize(x, fmt, s) if CACHE[fmt][2] else formats.quantize(x, fmt)
        a, b = q.codes.contiguous(), want.contiguous()
        diff = (a.view(torch.uint8) != b.view(torch.uint8)).sum().item()
        assert diff == 0, f"{fmt} {case}: {diff} of {a.numel()} stored bytes differ from vLLM's release"
        tally(fmt, case, a.numel())


@pytest.mark.parametrize("fmt", list(CACHE))
@pytest.mark.parametrize("shape", [(37, 2, 64), (5, 3, 64), (19, 1, 256)], ids=str)
def test_random_kv_bit_for_bit(fmt: str, shape: tuple[int, int, int], vllm_kernel: Callable[..., Any],
                               vllm_version: str, tally: Callable[[str, str, int], None]) -> None:  # fmt: skip
    g = torch.Generator().manual_seed(sum(shape))
    t, h, d = shape
    k = (torch.randn(t, h, d, generator=g) * torch.logspace(-3, 2.7, h).view(1, h, 1)).to(torch.bfloat16)
    v = (torch.randn(t, h, d, generator=g) * 3).to(torch.bfloat16)
    _check(vllm_kernel(FILE, KERNEL)[KERNEL], fmt, k, v, f"random {shape}", tally)


@pytest.mark.realmodel
@pytest.mark.parametrize("model", ["smollm2", "gemma3-270m"])
@pytest.mark.parametrize("fmt", list(CACHE))
def test_real_kv_bit_for_bit(fmt: str, model: str, real_kv: Callable[[str], Any], vllm_kernel: Callable[..., Any],
                             vllm_version: str, tally: Callable[[str, str, int], None]) -> None:  # fmt: skip
    kernel = vllm_kernel(FILE, KERNEL)[KERNEL]
    for i, (k, v) in enumerate(real_kv(model)):
        _check(kernel, fmt, k, v, f"{model} layer#{i}", tally)
