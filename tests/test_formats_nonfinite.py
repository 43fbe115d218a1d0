"""Non-finite K/V through every format (issue 13): NaN stays NaN, Inf saturates, and neither changes how its
neighbours are stored (scales come from the finite values only). Properties over random tensors (hypothesis)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcal.formats import (
    FORMATS,
    INT8_NAN,
    dequantize,
    fake_quantize,
    quantize,
    unpack_fp4,
)

# Formats whose engines define another non-finite behaviour, which kvcal reproduces (tests/test_formats.py,
# tests/test_formats_per_token_head.py): float16's Inf stays Inf (the IEEE cast), int4_per_token_head's rotation
# makes a row with a NaN/Inf all NaN, int8_per_tensor stores NaN as 0 (TensorRT-LLM's cvt.rni.sat.s8), fp8_e4m3_cpu
# stores NaN as 448 and +-Inf as +-448, fp8_e5m2_cpu as 57344 (vLLM's CPU build: std::min/std::max clamp;
# tests/test_formats_fp8_cpu.py).
ENGINE_DEFINED = ("float16", "int4_per_token_head", "int8_per_tensor", "fp8_e4m3_cpu", "fp8_e5m2_cpu")
QUANTIZED = [n for n in FORMATS if n != "auto" and n not in ENGINE_DEFINED]
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _with_holes(seed: int, n: int, value: float, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """x [2, 2, 3, 64] (scaled per sequence so per-sequence scales differ) with `n` elements set to `value`;
    returns (x, mask of those elements)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, 2, 3, 64, generator=g) * torch.tensor([1.0, 30.0])[:, None, None, None]
    idx = torch.randperm(x.numel(), generator=g)[:n]
    hole = torch.zeros(x.numel(), dtype=torch.bool)
    hole[idx] = True
    hole = hole.reshape(x.shape)
    if value != value:  # NaN
        x = x.masked_fill(hole, float("nan"))
    else:  # +-Inf with random signs
        signs = torch.where(torch.rand(x.shape, generator=g) < 0.5, -1.0, 1.0)
        x = torch.where(hole, signs * value, x)
    return x.to(dtype), hole


def _hole_cases(test: Callable[..., None]) -> Callable[..., None]:
    """The cases every hole test draws: a seeded vector of n values with holes, in each format and dtype."""
    return settings(max_examples=60, deadline=None)(
        given(
            seed=st.integers(0, 2**31 - 1),
            n=st.integers(1, 40),
            name=st.sampled_from(QUANTIZED),
            dtype=st.sampled_from(DTYPES),
        )(test)
    )


@_hole_cases
def test_nan_stays_nan_and_leaves_its_neighbours_alone(
    seed: int, n: int, name: str, dtype: torch.dtype
) -> None:
    x, hole = _with_holes(seed, n, float("nan"), dtype)
    y = fake_quantize(x, name)
    assert torch.equal(torch.isnan(y), hole)  # NaN exactly where it was, nowhere else
    zeroed = fake_quantize(x.masked_fill(hole, 0.0), name)
    assert torch.equal(y[~hole], zeroed[~hole])  # neighbours as if the NaN were a zero


@_hole_cases
def test_inf_saturates_and_leaves_its_neighbours_alone(
    seed: int, n: int, name: str, dtype: torch.dtype
) -> None:
    x, hole = _with_holes(seed, n, float("inf"), dtype)
    y = fake_quantize(x, name).float()
    assert torch.isfinite(y).all()
    zeroed = fake_quantize(x.masked_fill(hole, 0.0), name).float()
    assert torch.equal(y[~hole], zeroed[~hole])
    # an Inf becomes the largest magnitude of its row's grid, with its sign (0 only in an all-zero block)
    sign = torch.sign(x.float())[hole]
    assert ((torch.sign(y[hole]) == sign) | (y[hole] == 0)).all()
    row_max = y.abs().amax(dim=-1, keepdim=True).expand_as(y)
    if FORMATS[name].block_size == 0:  # one scale per row (or tensor): the Inf is the row's largest value
        assert torch.equal(y[hole].abs(), row_max[hole])


@pytest.mark.parametrize("name", QUANTIZED)
def test_nan_markers_in_storage(name: str) -> None:
    """The stored form of a NaN: the format's own NaN (bf16, fp8), int8 code -128, E2M1 code 8 — and those codes
    appear nowhere else."""
    x = torch.randn(1, 2, 4, 64)
    x[0, 1, 2, 17] = float("nan")
    q = quantize(x, name)
    nan_at = torch.zeros(x.shape, dtype=torch.bool)
    nan_at[0, 1, 2, 17] = True
    f = FORMATS[name]
    if f.element == "int8":
        assert torch.equal(q.codes == INT8_NAN, nan_at)
    elif f.is_fp4:
        assert torch.equal(unpack_fp4(q.codes) == 8, nan_at)
    else:
        assert torch.equal(torch.isnan(q.codes.float()), nan_at)
    assert torch.equal(torch.isnan(dequantize(q, name)), nan_at)


def test_nan_and_inf_leave_the_nvfp4_global_of_their_sequence_as_if_absent() -> None:
    x = torch.randn(3, 2, 5, 32)
    bad, ref = x.clone(), x.clone()
    bad[1, 0, 0, 0], bad[2, 1, 4, 31] = float("nan"), float("inf")
    ref[1, 0, 0, 0], ref[2, 1, 4, 31] = 0.0, 0.0
    assert torch.equal(quantize(bad, "nvfp4").scale, quantize(ref, "nvfp4").scale)
