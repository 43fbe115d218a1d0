"""`QuantizedKVCache`: a transformers Cache whose layers store K and V only as `kvcal.formats.QTensor` storage.

What a layer holds: codes + scales of every token it keeps ([B, H_kv, T, D] logical layout), never a
full-precision copy. Each write quantizes only the new tokens and concatenates codes (and block scales) along T,
as an engine writes new slots of its paged cache; nothing already stored is re-quantized.

What `update` returns: transformers calls `past_key_values.update(k, v, layer_idx)` and passes the result straight
to the attention function. We return two zero-stride placeholders of the right shape and dtype
(`scalar.expand(B, H_kv, Tk, D)`, no memory) that carry a `KVRead` in the attribute `kvcal_read`: the QTensors the
attention must read (for a sliding layer during prefill, the kept window PLUS the whole new chunk, as transformers'
`DynamicSlidingWindowLayer.update` returns), their format and positions. kvcal's attention function
(`kvcal.kernels.attention`) reads codes + scales from there; the torch path dequantizes, the Triton path reads the
codes in the kernel. No other attention implementation can use this cache (it would attend to zeros), so the
placeholders refuse nothing but are useless outside kvcal — `KVRuntime` installs the matching attention.

Sliding layers keep their last `window` tokens (transformers keeps window - 1; one more is harmless, as the mask
hides it, and matches an engine's window-sized allocation and `kvcal capacity`'s min(context, window)).

Scales:
- fp8_*: static `scale` per layer (0-d or [H_kv]) from a ScaleSet, else None -> formats' default 1.0
  (the uncalibrated engine configuration).
- nvfp4: global scale per layer (and per K/V) from a ScaleSet (vLLM reads it from the checkpoint). Without one,
  the global is dynamic but FIXED AT THE LAYER'S FIRST WRITE (the prefill): amax(prefill K or V) / (448 * 6),
  then reused for every later write. An engine must fix a scale before writing into its paged cache, and a single
  global keeps the storage layout (one fp32 per tensor) and the kernels unchanged. Decode tokens larger than the
  prefill's amax saturate their block scale at 448 (E4M3 max), exactly as a calibrated global would clip them.
  (Per-chunk globals would need a per-token scale in storage; re-quantizing old tokens is what no engine does.)
- int8_per_token_head, fp4_e2m1, mxfp4: per-token / per-block dynamic scales computed at write time.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from kvcal import formats
from kvcal.formats import KVFormat, QTensor


@dataclass(frozen=True)
class LayerPlan:
    """How one layer's K/V are stored."""

    index: int
    fmt: KVFormat
    window: int | None = None  # tokens kept by a sliding layer; None = keep all
    k_scale: torch.Tensor | None = None  # static scale (fp8) or global scale (nvfp4); 0-d or [H_kv]
    v_scale: torch.Tensor | None = None
    skipped: bool = False  # kept in BF16 because of --skip-layers


@dataclass
class KVRead:
    """What the attention of one layer reads for one forward: K/V storage of [B, H_kv, Tk, D] and positions."""

    k: QTensor
    v: QTensor
    fmt: KVFormat
    q_start: int  # absolute (cache) position of the first query of this forward
    k_start: int  # absolute position of the first key in k/v
    layer: int
    window: int | None = None


def _cat(a: QTensor | None, b: QTensor) -> QTensor:
    """Concatenate storage along T (dim -2 of codes and block scales); the static/global scale is shared."""
    if a is None:
        return b
    bs = None if b.block_scales is None else torch.cat([a.block_scales, b.block_scales], dim=-2)
    return QTensor(codes=torch.cat([a.codes, b.codes], dim=-2), block_scales=bs, scale=b.scale)


def _slice_t(q: QTensor, start: int | None = None, stop: int | None = None, clone: bool = False) -> QTensor:
    """Keep tokens [start:stop) (dim -2); a view unless `clone`."""
    codes = q.codes[..., start:stop, :]
    bs = None if q.block_scales is None else q.block_scales[..., start:stop, :]
    if clone:
        codes, bs = codes.clone(), None if bs is None else bs.clone()
    return QTensor(codes=codes, block_scales=bs, scale=q.scale)


def _map_batch(q: QTensor | None, fn) -> QTensor | None:
    if q is None:
        return None
    bs = None if q.block_scales is None else fn(q.block_scales)
    return QTensor(codes=fn(q.codes), block_scales=bs, scale=q.scale)


def _placeholder(x: torch.Tensor, tk: int, read: KVRead) -> torch.Tensor:
    """A zero-stride [B, H_kv, Tk, D] tensor (no storage) carrying `read`."""
    b, h, _, d = x.shape
    ph = torch.zeros((), dtype=x.dtype, device=x.device).expand(b, h, tk, d)
    ph.kvcal_read = read  # type: ignore[attr-defined]
    return ph


class QuantizedLayer(CacheLayerMixin):
    """One layer's quantized K/V storage (see the module docstring)."""

    is_compileable = False
    is_croppable = True

    def __init__(self, plan: LayerPlan):
        super().__init__()
        self.plan = plan
        self.is_sliding = plan.window is not None
        self.sliding_window = plan.window
        self.k: QTensor | None = None  # stored keys, [B, H_kv, T_kept, D] logical
        self.v: QTensor | None = None
        self.cumulative_length = 0  # tokens written so far (positions 0..cumulative_length-1)
        self._k_scale = plan.k_scale
        self._v_scale = plan.v_scale

    def __repr__(self) -> str:
        return f"QuantizedLayer({self.plan.index}, {self.plan.fmt.name}, window={self.plan.window})"

    # -- storage -------------------------------------------------------------------------------------------

    @property
    def kept(self) -> int:
        return 0 if self.k is None else int(self.k.codes.shape[-2])

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        for name in ("_k_scale", "_v_scale"):
            s = getattr(self, name)
            if s is not None:
                s = torch.as_tensor(s, dtype=torch.float32).to(self.device)
                setattr(self, name, s.reshape(()) if s.numel() == 1 else s)
        self.is_initialized = True

    def _quantize(self, x: torch.Tensor, which: str) -> QTensor:
        fmt = self.plan.fmt
        scale = self._k_scale if which == "k" else self._v_scale
        q = formats.quantize(x, fmt, scale=scale if fmt.calibratable else None)
        if fmt.name == "nvfp4" and scale is None:
            # dynamic global: fixed at the first write (see the module docstring)
            setattr(self, "_k_scale" if which == "k" else "_v_scale", q.scale)
        return q

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Quantize the new tokens, append their codes, trim a sliding layer to its window; return placeholders
        carrying what this forward's attention reads. key_states/value_states: [B, H_kv, T_new, D]."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        t_new = key_states.shape[-2]
        kept_before = self.kept
        q_start = self.cumulative_length
        k_start = q_start - kept_before
        full_k = _cat(self.k, self._quantize(key_states, "k"))  # [B, H_kv, kept + T_new, D]
        full_v = _cat(self.v, self._quantize(value_states, "v"))
        self.cumulative_length += t_new
        w = self.plan.window
        if w is not None and full_k.codes.shape[-2] > w:
            # copy the window out, so the chunk's full buffer is freed after this forward
            self.k, self.v = _slice_t(full_k, -w, clone=True), _slice_t(full_v, -w, clone=True)
        else:
            self.k, self.v = full_k, full_v
        read = KVRead(
            k=full_k,
            v=full_v,
            fmt=self.plan.fmt,
            q_start=q_start,
            k_start=k_start,
            layer=self.plan.index,
            window=w,
        )
        tk = kept_before + t_new
        return _placeholder(key_states, tk, read), _placeholder(value_states, tk, read)

    # -- sizes for transformers' mask creation --------------------------------------------------------------

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        """(kv_length, kv_offset) of the keys the next forward of `query_length` tokens reads."""
        return self.kept + query_length, self.cumulative_length - self.kept

    def get_seq_length(self) -> int:
        return self.cumulative_length

    def get_max_length(self) -> int:
        return -1 if self.plan.window is None else self.plan.window

    def nbytes(self) -> int:
        """Bytes of stored codes + block scales (per-tensor / per-head scales not counted)."""
        return sum(q.nbytes for q in (self.k, self.v) if q is not None)

    # -- generate() plumbing -------------------------------------------------------------------------------

    def offload(self) -> None:  # kvcal caches stay where they are
        return None

    def prefetch(self) -> None:
        return None

    def reset(self) -> None:
        self.k = self.v = None
        self.cumulative_length = 0
        self._k_scale, self._v_scale = self.plan.k_scale, self.plan.v_scale
        self.is_initialized = False

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._select(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._select(lambda t: t.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._select(lambda t: t[indices, ...])

    def _select(self, fn) -> None:
        self.k, self.v = _map_batch(self.k, fn), _map_batch(self.v, fn)

    def crop(self, tokens_to_remove: int) -> None:
        """Drop the last tokens (negative = how many; positive = the length to keep, transformers' legacy form)."""
        if tokens_to_remove > 0:
            tokens_to_remove = max(self.cumulative_length - tokens_to_remove, 0)
        n = abs(tokens_to_remove)
        if n == 0 or self.k is None:
            return
        if self.plan.window is not None and self.cumulative_length > self.kept and n > 0:
            raise RuntimeError(
                f"layer {self.plan.index} keeps only its {self.plan.window}-token window; it cannot be cropped"
            )
        n = min(n, self.kept)
        self.k, self.v = _slice_t(self.k, None, self.kept - n), _slice_t(self.v, None, self.kept - n)
        self.cumulative_length -= n


class QuantizedKVCache(Cache):
    """A Cache of `QuantizedLayer`s, one per decoder layer, built from per-layer plans (`KVRuntime.new_cache`)."""

    def __init__(self, plans: list[LayerPlan]):
        super().__init__(layers=[QuantizedLayer(p) for p in plans])
        self.plans = plans

    def nbytes(self) -> int:
        """Bytes of every layer's stored codes + block scales."""
        return sum(layer.nbytes() for layer in self.layers)

    def layer_formats(self) -> list[str]:
        return [p.fmt.name for p in self.plans]
