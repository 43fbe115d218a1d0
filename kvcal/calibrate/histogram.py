"""The streamed |x| histogram of calibration's statistics (`observers.TensorStats`): per KV head, log2-spaced bins
(BINS_PER_OCTAVE per octave from 2^HIST_LO to 2^HIST_HI), each with its count, sum and sum of squares.

`histogram_ref` is the plain torch reference (log2, index arithmetic, three float64 bincounts); `histogram` gives
its result bit for bit in one C pass (`histogram.c`, built by `kvcal.clib`) on the CPU — those ops were 9% of a
calibration pass (bench/RESULTS.md) — and falls back to the reference on a GPU, with KVCAL_C=0 or without a
compiler (a failed build warns once).
"""

from __future__ import annotations

import ctypes
import warnings
from functools import cache
from pathlib import Path

import torch

from kvcal import clib

HIST_LO = -40  # log2 of the smallest bin edge; |x| below it (and 0) land in bin 0
HIST_HI = 24  # log2 of the largest bin edge; |x| above it land in the last bin (amax is kept exactly anyway)
BINS_PER_OCTAVE = 128
NBINS = (HIST_HI - HIST_LO) * BINS_PER_OCTAVE
SOURCE = Path(__file__).with_name("histogram.c")

Hist = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # (count, sum |x|, sum |x|^2), each [H, NBINS] float64


def histogram_ref(a: torch.Tensor) -> Hist:
    """a: [H, N] |x| (float32) -> per head and bin: (count, sum of |x|, sum of |x|^2), each [H, NBINS] float64.
    Bin = floor((log2|x| - HIST_LO) * BINS_PER_OCTAVE), clamped (0 lands in bin 0); sums in float64, in element
    order."""
    heads = a.shape[0]
    idx = ((torch.log2(a) - HIST_LO) * BINS_PER_OCTAVE).floor_().clamp_(0, NBINS - 1).long()
    idx = (idx + torch.arange(heads, device=a.device).unsqueeze(1) * NBINS).flatten()
    a64 = a.flatten().double()
    n = heads * NBINS
    count = torch.bincount(idx, minlength=n).double().view(heads, NBINS)
    sum1 = torch.bincount(idx, weights=a64, minlength=n).view(heads, NBINS)
    sum2 = torch.bincount(idx, weights=a64 * a64, minlength=n).view(heads, NBINS)
    return count, sum1, sum2


@cache
def library() -> ctypes.CDLL | None:
    """histogram.c compiled and loaded (once per process), or None."""
    lib, why, _ = clib.load(SOURCE, "histogram")
    if why is not None:
        warnings.warn(
            f"kvcal: calibration's histogram runs with torch ops (same results, slower): {why}\n"
            "(set KVCAL_C=0 to skip building it)",
            RuntimeWarning,
            stacklevel=3,
        )
    if lib is not None:
        fn = lib.kvcal_hist_update
        fn.restype = None
        # a, log2(a) [H, N] float32; H, N, bins per head; log2 of the lowest edge, bins per octave; count, sum,
        # sum of squares [H, bins] float64
        fn.argtypes = [ctypes.c_void_p] * 2 + [ctypes.c_int64] * 3 + [ctypes.c_int] * 2 + [ctypes.c_void_p] * 3
    return lib


def histogram(a: torch.Tensor) -> Hist:
    """`histogram_ref(a)`, bit for bit: in one C pass for a [H, N] float32 CPU tensor when the library is built,
    else with the reference's torch ops."""
    lib = library() if a.device.type == "cpu" and a.dtype == torch.float32 and a.dim() == 2 else None
    if lib is None:
        return histogram_ref(a)
    a = a.contiguous()
    log2 = torch.log2(a)  # torch's log2 on the tensor the reference takes it of: the same last bits
    h, n = a.shape
    out = torch.zeros(3, h, NBINS, dtype=torch.float64)
    lib.kvcal_hist_update(
        a.data_ptr(), log2.data_ptr(), h, n, NBINS, HIST_LO, BINS_PER_OCTAVE,
        out[0].data_ptr(), out[1].data_ptr(), out[2].data_ptr(),
    )  # fmt: skip
    return out[0], out[1], out[2]
