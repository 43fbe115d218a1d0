"""int4_per_token_head against the installed vLLM release's own code: its rotation (`single_rht` with
`_get_rht_signs` and `fast_hadamard_transform`'s PyTorch butterfly, the tier it runs on CPU and for D < 16; on
CUDA it rotates with hadacore in bf16 instead, so the rotated input there can differ in the last bf16 bit — a
GPU-only comparison) and its store kernel `_reshape_cache_int4_kernel` under the Triton interpreter, from
vllm/v1/attention/ops/int4_per_token_head.py. Packed codes and the scale word (fp32 scale with the zero point in
its 4 low mantissa bits) compared bit for bit with kvcal's `formats.quantize`."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from kvcal import formats

FILE = "vllm/v1/attention/ops/int4_per_token_head.py"


def _release_int4(
    vllm_kernel: Callable[..., Any], key: torch.Tensor, value: torch.Tensor, block_size: int = 16
):
    ns = vllm_kernel(FILE, "pack_int4_nibbles", "_reshape_cache_int4_kernel", "single_rht", "_get_rht_signs",
                     "fast_hadamard_transform")  # fmt: skip
    # the names single_rht reaches on CPU: no hadacore, the signs cache, D a power of two (kvcal refuses others)
    ns.update(
        _hadacore_available=lambda: False, _RHT_SIGNS_CACHE={}, largest_power_of_2_divisor=lambda d: d & -d
    )
    t, h, d = key.shape
    k = ns["single_rht"](key.float()).to(key.dtype)  # reshape_and_cache_int4's pre-rotation
    v = ns["single_rht"](value.float()).to(value.dtype)
    nblocks = (t + block_size - 1) // block_size + 2
    slots = torch.randperm(nblocks * block_size, generator=torch.Generator().manual_seed(t))[:t]
    kc = torch.zeros(nblocks, block_size, h, d // 2, dtype=torch.uint8)
    vc = torch.zeros_like(kc)
    ks = torch.zeros(nblocks, block_size, h, dtype=torch.float32)
    vs = torch.zeros_like(ks)
    ns["_reshape_cache_int4_kernel"][(t, h)](
        k,
        v,
        kc,
        vc,
        ks,
        vs,
        slots,
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        kc.stride(0),
        kc.stride(1),
        kc.stride(2),
        vc.stride(0),
        vc.stride(1),
        vc.stride(2),
        ks.stride(0),
        ks.stride(1),
        ks.stride(2),
        vs.stride(0),
        vs.stride(1),
        vs.stride(2),
        block_size=block_size,
        head_size=d,
        head_size_v=d,
        PACKED_HEAD_PADDED=1 << (d // 2 - 1).bit_length(),
    )  # fmt: skip  (the arguments _run_reshape_kernel passes, packing factor 2)
    blk, off = slots // block_size, slots % block_size
    return kc[blk, off], vc[blk, off], ks[blk, off].unsqueeze(-1), vs[blk, off].unsqueeze(-1)


def _check(vllm_kernel: Callable[..., Any], k: torch.Tensor, v: torch.Tensor, case: str,
           tally: Callable[[str, str, int], None]) -> None:  # fmt: skip
    kc, vc, ks, vs = _release_int4(vllm_kernel, k, v)
    for x, codes, scales in ((k, kc, ks), (v, vc, vs)):
        q = formats.quantize(x, "int4_per_token_head")
        assert torch.equal(q.block_scales.view(torch.int32), scales.view(torch.int32)), (
            f"int4 {case}: scale words"
        )
        diff = (q.codes != codes).sum().item()
        assert diff == 0, f"int4 {case}: {diff} of {codes.numel()} packed bytes differ from vLLM's release"
        tally("int4_per_token_head", case, codes.numel() + scales.numel())


@pytest.mark.parametrize("shape", [(37, 2, 64), (5, 3, 64), (33, 1, 256), (17, 4, 16)], ids=str)
def test_random_kv_bit_for_bit(shape: tuple[int, int, int], vllm_kernel: Callable[..., Any], vllm_version: str,
                               tally: Callable[[str, str, int], None]) -> None:  # fmt: skip
    g = torch.Generator().manual_seed(sum(shape))
    t, h, d = shape
    k = (torch.randn(t, h, d, generator=g) * torch.logspace(-2, 2, h).view(1, h, 1)).to(torch.bfloat16)
    v = (torch.randn(t, h, d, generator=g) * 3).to(torch.bfloat16)
    k[0, 0] = 0
    _check(vllm_kernel, k, v, f"random {shape}", tally)


@pytest.mark.realmodel
@pytest.mark.parametrize("model", ["smollm2", "gemma3-270m"])
def test_real_kv_bit_for_bit(model: str, real_kv: Callable[[str], Any], vllm_kernel: Callable[..., Any],
                             vllm_version: str, tally: Callable[[str, str, int], None]) -> None:  # fmt: skip
    for i, (k, v) in enumerate(real_kv(model)):
        _check(vllm_kernel, k, v, f"{model} layer#{i}", tally)
