"""`QuantizedKVCache`: a transformers Cache whose layers store K and V only as `kvcal.formats.QTensor` storage.

What a layer holds: codes + scales of every token it keeps ([B, H_kv, T, D] logical layout), never a
full-precision copy. Each write quantizes only the new tokens and appends their codes (and block scales) along T
into storage with spare room (`kvcal.kernels.buffer.TokenBuffer`: amortized O(1) per decode step, no copy of
everything stored), as an engine writes new slots of its paged cache; nothing already stored is re-quantized.
(The torch reference attention keeps, beside the stored codes, the float32 values it has already
dequantized, so a decode step dequantizes only the new tokens: `fast.Workspace`, one per layer and K/V, handed to
the attention in `KVRead`. That is the CPU path's workspace, not cache storage, filled by decode-sized reads only (a
prefill chunk's values are a temporary of its layer: `fast.WORKSPACE_MAX_QUERIES`); the Triton path never fills it.)

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

A sample's storage never depends on its batch. Batches are padded (lm-eval: left padding for generation, right
padding for scoring); `KVRuntime` hands each forward's 2-D attention mask to the cache (`set_attention_mask`), and
a write stores the padding positions as zeros — an engine stores no padding at all — so no padding value (NaN or
Inf included) reaches a scale or, through attention's P.V, a real token. Every dynamic quantity is per sequence.

Roles of a layer (`QuantizedLayer`): storage per side (`_Side`: codes and block scales in TokenBuffers, the torch
path's workspace), a scale policy per side (`kvcal.kernels.scale_policy`: static, first-batch, one, per-sequence;
chosen from the plan when the layer is built) and a writer: the C kernel (`kvcal.kernels.cpu_write`) for decode
steps where the layer's formats, K/V dtype and head_dim suit it — decided once, at the layer's first write —
else torch ops (the same bits).

Scales:
- fp8_*: static `scale` per layer (0-d or [H_kv]) from a ScaleSet, else None -> formats' default 1.0
  (vLLM's and SGLang's uncalibrated configuration).
- nvfp4: global scale per layer (and per K/V) from a ScaleSet (vLLM reads it from the checkpoint). Without one,
  `LayerPlan.nvfp4_global` chooses (`NVFP4_GLOBALS`):
  - "one" (default): 1.0, what vLLM uses when the checkpoint has no k_scale/v_scale (its NVFP4 store kernel
    quantizes with global 1 / k_scale).
  - "per_sequence": each sequence's own `amax / (448 * 6)` over its real tokens (`formats.nvfp4_dynamic_global`),
    FIXED AT ITS FIRST WRITE (the prefill) and reused for every later write, stored as a [B, 1, 1, 1] scale. An
    engine must fix a scale before writing into its paged cache; decode tokens larger than the prefill's amax
    saturate their block scale at 448 (E4M3 max), as a calibrated global would clip them.
- int8_per_token_head, fp4_e2m1, mxfp4: per-token / per-block dynamic scales computed at write time.
- `LayerPlan.first_batch` (fp8_*, nvfp4, nvfp4_4over6; `--scales first-batch`): vLLM's calculate_kv_scales,
  scales computed from the first write and fixed afterwards (`FirstBatchScales`).

K/V input dtype: `LayerPlan.kv_input_dtype` rounds the new K/V to the engine's serving dtype (bf16 by default in
`kvcal eval`) before anything is computed from them, as an engine serving a bf16 model quantizes bf16 K/V.

Non-finite K/V: each write counts the NaN/Inf elements of the real tokens it was asked to store, per layer and
K/V, into the runtime's `NonFiniteCount` (on the device, no synchronisation); evaluation reports them.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from kvcal import formats, serde
from kvcal.errors import UsageError
from kvcal.formats import KVFormat, QTensor
from kvcal.kernels import cpu_write, fast
from kvcal.kernels.buffer import TokenBuffer
from kvcal.kernels.fast import Workspace, same_scale
from kvcal.kernels.scale_policy import (  # noqa: F401  (FirstBatchScales and its constants: re-exported)
    FIRST_BATCH,
    K_SCALE_CONSTANT,
    V_SCALE_CONSTANT,
    FirstBatchScales,
    ScalePolicy,
    SequencesFixed,
    per_sequence,
    side_policies,
)

# nvfp4 global scale when no scale file is given: name -> what it is (LayerPlan.nvfp4_global)
NVFP4_GLOBALS: dict[str, str] = {
    "one": "1.0, vLLM's default without checkpoint scales",
    "per_sequence": "each sequence's amax / (448 * 6) over its real tokens, fixed at its first write",
}


def check_nvfp4_global(name: str) -> str:
    if name not in NVFP4_GLOBALS:
        raise UsageError(f"unknown nvfp4 global scale policy '{name}'; use one of {', '.join(NVFP4_GLOBALS)}")
    return name


@dataclass(frozen=True)
class LayerPlan:
    """How one layer's K/V are stored."""

    index: int
    fmt: KVFormat
    window: int | None = None  # tokens kept by a sliding layer; None = keep all
    # static scale (fp8) or global scale (nvfp4); 0-d or [H_kv]
    k_scale: torch.Tensor | None = None
    v_scale: torch.Tensor | None = None
    skipped: bool = False  # kept in BF16 because of --skip-layers
    nvfp4_global: str = "one"  # nvfp4 without k_scale/v_scale: a key of NVFP4_GLOBALS
    v_fmt: KVFormat | None = None  # V's format when it differs from K's (`k=...,v=...`); None = fmt
    q_scale: float | None = None  # FP8 attention (`--attention fp8`): the query's e4m3 scale; None = off
    # K/V are rounded to this dtype before quantization (`--kv-input-dtype`: the engine's serving dtype holds them
    # so); None = quantize them as the model computed them
    kv_input_dtype: torch.dtype | None = None
    # vLLM's calculate_kv_scales (`--scales first-batch`): the runtime's store of scales fixed by the first write
    first_batch: FirstBatchScales | None = None
    # LMCache's storage tier (`--prefix-serde` / `--prefix-tokens`, kvcal.serde): the K/V of each sequence's first
    # `prefix_tokens` tokens round-trip through this serde before this layer's format stores them; None = off
    prefix_serde: str | None = None
    prefix_tokens: int = 0

    def side_format(self, which: str) -> KVFormat:
        """The format K ('k') or V ('v') is stored in."""
        return self.v_fmt if which == "v" and self.v_fmt is not None else self.fmt


@dataclass
class NonFiniteCount:
    """NaN/Inf elements of the real K/V tokens each layer was asked to store, accumulated on the device."""

    num_layers: int
    # int64 [num_layers, 2] (K, V) per device: under a device map each layer counts on its own device
    counts: dict[torch.device, torch.Tensor] = field(default_factory=dict, repr=False)

    def add(self, layer: int, which: int, x: torch.Tensor, valid: torch.Tensor | None) -> None:
        """x: [B, H_kv, T, D]; valid: [B, T] bool or None (all real). `which`: 0 = K, 1 = V."""
        if x.device.type == "cpu" and math.isfinite(float(x.sum())):
            # the usual case, two ops (a CPU check costs no device synchronisation): any NaN/Inf makes the sum
            # non-finite; a sum that overflows only sends all-finite x to the exact count below
            return
        bad = ~torch.isfinite(x)
        if valid is not None:
            bad = bad & valid[:, None, :, None]
        self.add_count(layer, which, bad.sum(), x.device)

    def add_count(self, layer: int, which: int, n: torch.Tensor | int, device: torch.device) -> None:
        """Count n more non-finite elements (a tensor on `device`, or a Python int from the CPU write kernel)."""
        if device not in self.counts:
            self.counts[device] = torch.zeros(self.num_layers, 2, dtype=torch.int64, device=device)
        self.counts[device][layer, which] += n

    def take(self) -> dict[str, Any]:
        """{'per_layer': [{'layer', 'k', 'v'}] (layers with a non-finite element only), 'total'} and reset."""
        parts = [t.cpu() for t in self.counts.values()]
        c = [[0, 0]] * self.num_layers if not parts else torch.stack(parts).sum(0).tolist()
        self.counts = {}
        per_layer = [{"layer": i, "k": k, "v": v} for i, (k, v) in enumerate(c) if k or v]
        return {"per_layer": per_layer, "total": sum(k + v for k, v in c)}


@dataclass
class KVRead:
    """What the attention of one layer reads for one forward: K/V storage of [B, H_kv, Tk, D] and positions."""

    k: QTensor
    v: QTensor
    fmt: KVFormat  # K's format (and V's unless v_fmt is set)
    q_start: int  # absolute (cache) position of the first query of this forward
    k_start: int  # absolute position of the first key in k/v
    layer: int
    window: int | None = None
    v_fmt: KVFormat | None = None  # V's format when a K/V pair differs
    # the torch path's workspaces of the cache sides k and v are read from (their first token at k_start)
    workspaces: tuple[Workspace, Workspace] | None = None


class _Side:
    """One side's (K or V) stored tokens: codes and block scales in `TokenBuffer`s (appends amortized O(1), views
    handed to the attention), and the torch path's workspace of their float32 values."""

    __slots__ = ("block_scales", "codes", "workspace")

    def __init__(self, q: QTensor | None = None) -> None:
        """Empty, or holding q's tokens (after a batch re-index: q's tensors become the buffers)."""
        self.codes = TokenBuffer(None if q is None else q.codes)
        self.block_scales = TokenBuffer(None if q is None else q.block_scales)
        self.workspace = Workspace()

    def append(self, new: QTensor) -> QTensor:
        """Store new's tokens after the kept ones; the QTensor of all of them (views). The static/global scale is
        the new write's (the same for every write of a sequence, see QuantizedLayer._scale)."""
        codes = self.codes.append(new.codes)
        bs = None if new.block_scales is None else self.block_scales.append(new.block_scales)
        return QTensor(codes=codes, block_scales=bs, scale=new.scale)

    def view(self, scale: torch.Tensor | None) -> QTensor | None:
        codes = self.codes.view()
        if codes is None:
            return None
        return QTensor(codes=codes, block_scales=self.block_scales.view(), scale=scale)

    def keep_last(self, n: int) -> None:
        self.codes.keep_last(n)
        self.block_scales.keep_last(n)

    def drop_last(self, n: int) -> None:
        self.codes.drop_last(n)
        self.block_scales.drop_last(n)
        self.workspace = Workspace()  # positions past the crop will be written again


def _map_batch(q: QTensor | None, fn: Callable[[torch.Tensor], torch.Tensor]) -> QTensor | None:
    if q is None:
        return None
    bs = None if q.block_scales is None else fn(q.block_scales)
    scale = fn(q.scale) if per_sequence(q.scale) else q.scale
    return QTensor(codes=fn(q.codes), block_scales=bs, scale=scale)


_ZEROS: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}  # 0-d zeros the placeholders expand


def _placeholder(x: torch.Tensor, tk: int, read: KVRead) -> torch.Tensor:
    """A zero-stride [B, H_kv, Tk, D] tensor (no storage) carrying `read`."""
    b, h, _, d = x.shape
    key = (x.dtype, x.device)
    if key not in _ZEROS:
        _ZEROS[key] = torch.zeros((), dtype=x.dtype, device=x.device)
    ph = _ZEROS[key].expand(b, h, tk, d)
    ph.kvcal_read = read  # type: ignore[attr-defined]
    return ph


def new_token_padding(attention_mask: torch.Tensor | None, start: int, n: int) -> torch.Tensor | None:
    """[B, n] bool (True = real token) of the n tokens written at positions start..start+n-1, from a 2-D mask over
    all tokens so far (transformers' convention; positions it does not cover are real); None = all real."""
    if attention_mask is None:
        return None
    am = attention_mask.to(torch.bool)
    if am.shape[-1] < start + n:
        am = torch.nn.functional.pad(am, (0, start + n - am.shape[-1]), value=True)
    return am[:, start : start + n]


def own_positions(attention_mask: torch.Tensor | None, start: int, n: int, device: torch.device) -> torch.Tensor:
    """[B, n] (or [1, n] without a mask) int64: each new token's index among its own sequence's real tokens, for the
    n tokens written at cache positions start..start+n-1. A 2-D mask (transformers' convention, positions it does
    not cover real) counts only real tokens, so a left-padded row's first real token is its token 0; a padding
    position gets its sequence's count so far minus one (it stores zeros whatever the serde does)."""
    if attention_mask is None:
        return torch.arange(start, start + n, device=device)[None, :]
    am = attention_mask.to(device=device, dtype=torch.bool)
    if am.shape[-1] < start + n:
        am = torch.nn.functional.pad(am, (0, start + n - am.shape[-1]), value=True)
    return (am[:, : start + n].long().cumsum(-1) - 1)[:, start:]


def without_padding(x: torch.Tensor, valid: torch.Tensor | None) -> torch.Tensor:
    """x [B, H_kv, T, D] with the padding positions (valid [B, T] False) set to 0 — what is stored there."""
    if valid is None:
        return x
    return torch.where(
        valid.to(x.device)[:, None, :, None], x, torch.zeros((), dtype=x.dtype, device=x.device)
    )


def _c_writes(plan: LayerPlan) -> bool:
    """Whether the C kernel writes this layer's decode steps: both sides' formats have a C id (`c_kernel`)."""
    return all(plan.side_format(w).name in cpu_write.FORMATS for w in "kv")


def _decode_sized(k: torch.Tensor, v: torch.Tensor) -> bool:
    """A write the C kernel takes: small (a decode step; a prefill's large write is as fast vectorised in torch),
    of at most `fast.WORKSPACE_MAX_QUERIES` tokens (its read keeps nothing in the workspace: a prefill chunk), K and V
    alike, unit stride along D."""
    return (
        k.numel() * 2 <= fast.SMALL
        and k.shape[-2] <= fast.WORKSPACE_MAX_QUERIES
        and k.shape == v.shape
        and k.dtype == v.dtype
        and k.stride(-1) == 1
        and v.stride(-1) == 1
    )


def _in_step(ws: Workspace, fmt: KVFormat, x: torch.Tensor, q_start: int, k_start: int) -> bool:
    """The side's workspace holds every token written so far, in fmt, for x's batch and heads."""
    d = ws.values.data
    return (
        ws.fmt == fmt.name
        and d is not None
        and d.shape[:2] == x.shape[:2]
        and ws.first + len(ws.values) == q_start
        and ws.first <= k_start
    )


class QuantizedLayer(CacheLayerMixin):
    """One layer's quantized K/V storage (see the module docstring)."""

    is_compileable = False
    is_croppable = True

    def __init__(self, plan: LayerPlan, nonfinite: NonFiniteCount | None = None, workspace: bool = True):
        super().__init__()
        self.plan = plan
        self.nonfinite = nonfinite
        # False: reads keep no float32 values in the torch path's workspaces (a cache read by one forward after its
        # prefill, as continuation scoring's: nothing would be read again, and the values of a context repeated
        # across a question's choices would be held once per choice); every read dequantizes into a temporary
        self.workspace = workspace
        self.is_sliding = plan.window is not None
        self.sliding_window = plan.window
        self.k: QTensor | None = None  # stored keys, [B, H_kv, T_kept, D] logical (views of self._sides)
        self.v: QTensor | None = None
        self._sides = {"k": _Side(), "v": _Side()}
        self.cumulative_length = 0  # tokens written so far (positions 0..cumulative_length-1)
        self._done = SequencesFixed()  # the per-sequence globals K and V have fixed
        self._policies = self._scale_policies()
        # the writer of decode steps, chosen once: the C kernel where the layer's formats have one and it is built
        # (a decode step it cannot take, e.g. a prefill chunk, is written with torch ops: the same bits)
        self._c_write = _c_writes(plan)

    def __repr__(self) -> str:
        return f"QuantizedLayer({self.plan.index}, {self.plan.fmt.name}, window={self.plan.window})"

    # -- storage -------------------------------------------------------------------------------------------

    @property
    def kept(self) -> int:
        return len(self._sides["k"].codes)

    def _scale_policies(self) -> dict[str, ScalePolicy]:
        """K's and V's scale policies (`kvcal.kernels.scale_policy`), chosen from the plan."""
        p = self.plan
        return side_policies(
            p.side_format("k"), p.side_format("v"), (p.k_scale, p.v_scale), p.first_batch, p.nvfp4_global, p.index,
            self._done,
        )  # fmt: skip

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        self._policies["k"].init(key_states)
        self._policies["v"].init(value_states)
        if self._c_write:  # what the C kernel needs of this layer's K/V (dtype, device, head_dim)
            self._c_write = all(
                cpu_write.supports_layer(self.plan.side_format(w), x, self.plan.kv_input_dtype)
                for w, x in (("k", key_states), ("v", value_states))
            )
        self.is_initialized = True

    def _scale(self, x: torch.Tensor, which: str, valid: torch.Tensor | None) -> torch.Tensor | None:
        """The scale this write quantizes with (its side's policy); x: [B, H_kv, T, D], padding zeroed."""
        return self._policies[which].scale(x, valid)

    def _prepare(self, x: torch.Tensor, which: str, valid: torch.Tensor | None) -> torch.Tensor:
        """New K or V [B, H_kv, T_new, D] as they are stored: in the K/V input dtype, padding zeroed (NaN/Inf of
        the real tokens counted)."""
        if self.plan.kv_input_dtype is not None and x.dtype != self.plan.kv_input_dtype:
            x = x.to(self.plan.kv_input_dtype)  # as the engine holds them (an overflow becomes Inf, as there)
        if self.nonfinite is not None:
            self.nonfinite.add(self.plan.index, 0 if which == "k" else 1, x, valid)
        return without_padding(x, valid)

    def _serde_rows(self, own: torch.Tensor | None) -> torch.Tensor | None:
        """[B or 1, T_new] bool: the new tokens whose K/V come back from LMCache's storage tier (their own index <
        prefix_tokens); None when the layer has no serde or no new token is in the prefix (checked on the host:
        the prefix is a few forwards' business, the rest of a run skips it)."""
        if self.plan.prefix_serde is None or own is None:
            return None
        rows = own < self.plan.prefix_tokens
        return rows if bool(rows.any()) else None

    def _round_trip(self, x: torch.Tensor, which: str, rows: torch.Tensor | None) -> torch.Tensor:
        """x [B, H_kv, T_new, D] (in the K/V input dtype, padding zeroed) with the prefix rows ([B or 1, T_new])
        replaced by the serde's round trip: what a prefix reloaded from LMCache's L2 tier hands the engine."""
        if rows is None:
            return x
        assert self.plan.prefix_serde is not None
        y = serde.round_trip(self.plan.prefix_serde, x, which, self.plan.index)
        return torch.where(rows.to(x.device)[:, None, :, None], y, x)

    def _write(
        self,
        key_states: torch.Tensor,
        value_states: torch.Tensor,
        valid: torch.Tensor | None,
        serde_rows: torch.Tensor | None = None,
    ) -> tuple[QTensor, QTensor]:
        """Quantize the new K and V (in one call when they share a format: `fast.quantize_kv`; the bits of
        `formats.quantize`). `serde_rows`: the tokens that first round-trip through the prefix serde."""
        k = self._round_trip(self._prepare(key_states, "k", valid), "k", serde_rows)
        k_scale = self._scale(k, "k", valid)
        v = self._round_trip(self._prepare(value_states, "v", valid), "v", serde_rows)
        v_scale = self._scale(v, "v", valid)
        fk, fv = self.plan.side_format("k"), self.plan.side_format("v")
        if fk is fv:
            return fast.quantize_kv(k, v, fk, k_scale, v_scale, scale_checked=True)
        return (
            fast.quantize(k, fk, scale=k_scale, scale_checked=True),
            fast.quantize(v, fv, scale=v_scale, scale_checked=True),
        )

    def update(
        self,
        key_states: torch.Tensor,
        value_states: torch.Tensor,
        *args: Any,
        valid: torch.Tensor | None = None,
        own: torch.Tensor | None = None,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Quantize the new tokens, append their codes, trim a sliding layer to its window; return placeholders
        carrying what this forward's attention reads. key_states/value_states: [B, H_kv, T_new, D]; valid:
        [B, T_new] bool (True = real token) or None (all real); own: [B or 1, T_new] each token's index in its own
        sequence (`own_positions`; None = the cache positions), read only with a prefix serde."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        valid = None if valid is None else valid.to(key_states.device)
        t_new = key_states.shape[-2]
        kept_before = self.kept
        q_start = self.cumulative_length
        k_start = q_start - kept_before  # absolute position of the first kept token
        if own is None and self.plan.prefix_serde is not None and q_start < self.plan.prefix_tokens:
            own = own_positions(None, q_start, t_new, key_states.device)  # no mask: the cache positions
        serde_rows = self._serde_rows(own)
        # the C decode write knows no serde: a write that touches the prefix takes the torch path (the same bits)
        # (without a workspace it declines too: it appends to workspaces that hold every token written so far)
        fused = None if serde_rows is not None else self._fused_write(key_states, value_states, valid, q_start, k_start)
        if fused is not None:
            full_k, full_v = fused
        else:
            new_k, new_v = self._write(key_states, value_states, valid, serde_rows)
            full_k = self._sides["k"].append(new_k)  # [B, H_kv, kept + T_new, D]: kept + new tokens
            full_v = self._sides["v"].append(new_v)
        self.cumulative_length += t_new
        self._keep(full_k, full_v)
        read = KVRead(
            k=full_k,
            v=full_v,
            fmt=self.plan.fmt,
            q_start=q_start,
            k_start=k_start,
            layer=self.plan.index,
            window=self.plan.window,
            v_fmt=self.plan.v_fmt,
            workspaces=(self._sides["k"].workspace, self._sides["v"].workspace) if self.workspace else None,
        )
        tk = kept_before + t_new
        return _placeholder(key_states, tk, read), _placeholder(value_states, tk, read)

    def _fused_write(
        self,
        k: torch.Tensor,
        v: torch.Tensor,
        valid: torch.Tensor | None,
        q_start: int,
        k_start: int,
    ) -> tuple[QTensor, QTensor] | None:
        """A decode step's write by the C kernel (`kvcal.kernels.cpu_write`): codes and block scales appended to
        the storage and float32 values to the torch path's workspace in one call, the same bytes as `_write` +
        `_Side.append` + the attention's dequantization. Whether the layer's formats, K/V dtype and head_dim
        suit the kernel was decided once (`_c_write`, at the first write); per write, None (the caller writes with
        torch ops, the same bits) unless the kernel is built, the write is a decode step's (small, at most
        `fast.WORKSPACE_MAX_QUERIES` tokens: a read that keeps its values), both workspaces hold every token
        written so far (the torch path is reading this cache; the Triton path never fills them) and the scales are
        fixed already."""
        if not self._c_write or not _decode_sized(k, v) or cpu_write.library() is None:
            return None
        f, fv = self.plan.side_format("k"), self.plan.side_format("v")
        sides = (self._sides["k"], self._sides["v"])
        if not all(_in_step(side.workspace, sf, k, q_start, k_start) for side, sf in zip(sides, (f, fv), strict=True)):
            return None
        fixed = (self._policies["k"].fixed(k.device), self._policies["v"].fixed(v.device))
        if any(s is False for s in fixed):
            return None
        # a calibratable side's validated scale; else None
        ks, vs = scales = tuple(
            formats.static_scale(s, k, sf.codec.scale_default, checked=True) if sf.calibratable else None
            for s, sf in zip(fixed, (f, fv), strict=True)
        )
        for side, s in zip(sides, scales, strict=True):
            if not same_scale(side.workspace.scale, s):  # type: ignore[arg-type]
                return None
        if not (cpu_write.scale_fits(f, ks, k) and cpu_write.scale_fits(fv, vs, v)):  # type: ignore[arg-type]
            return None
        for side in sides:  # what the read would drop before appending (fast.dequantize_fast)
            side.workspace.drop_before(k_start)
        buffers = tuple((s.codes, s.block_scales, s.workspace.values) for s in sides)
        kin = self.plan.kv_input_dtype
        bad = cpu_write.write_into(f, k, v, ks, vs, valid, kin, buffers, None if fv is f else fv)  # type: ignore[arg-type]
        if self.nonfinite is not None:
            for which, n in enumerate(bad):
                if n:
                    self.nonfinite.add_count(self.plan.index, which, n, k.device)
        out = []
        for side, s in zip(sides, scales, strict=True):
            side.workspace.scale = s  # type: ignore[assignment]
            q = QTensor(codes=side.codes.view(), block_scales=side.block_scales.view(), scale=s)  # type: ignore[arg-type]
            out.append(q)
        return out[0], out[1]

    def _keep(self, full_k: QTensor, full_v: QTensor) -> None:
        """Keep all of it, or a sliding layer's window (the buffers drop the tokens before it, and are compacted
        when a long chunk left them mostly empty)."""
        w = self.plan.window
        if w is not None and full_k.codes.shape[-2] > w:
            for side in self._sides.values():
                side.keep_last(w)
            self.k, self.v = self._sides["k"].view(full_k.scale), self._sides["v"].view(full_v.scale)
        else:
            self.k, self.v = full_k, full_v

    # -- sizes for transformers' mask creation --------------------------------------------------------------

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        """(kv_length, kv_offset) of the keys the next forward of `query_length` tokens reads."""
        return self.kept + query_length, self.cumulative_length - self.kept

    def get_seq_length(self) -> int:
        return self.cumulative_length

    def get_max_length(self) -> int:
        return -1 if self.plan.window is None else self.plan.window

    def nbytes(self) -> int:
        """Bytes of stored codes + block scales (per-tensor / per-head / per-sequence scales not counted)."""
        return sum(q.nbytes for q in (self.k, self.v) if q is not None)

    # -- generate() plumbing -------------------------------------------------------------------------------

    def offload(self) -> None:  # kvcal caches stay where they are
        return None

    def prefetch(self) -> None:
        return None

    def reset(self) -> None:
        self.k = self.v = None
        self._sides = {"k": _Side(), "v": _Side()}
        self.cumulative_length = 0
        self._done = SequencesFixed()
        self._policies = self._scale_policies()
        self._c_write = _c_writes(self.plan)
        self.is_initialized = False

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._select(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._select(lambda t: t.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._select(lambda t: t[indices, ...])

    def _select(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """Apply a batch re-indexing to everything stored per sequence."""
        self.k, self.v = _map_batch(self.k, fn), _map_batch(self.v, fn)
        self._sides = {"k": _Side(self.k), "v": _Side(self.v)}  # the re-indexed tensors become the storage
        for policy in self._policies.values():
            policy.select(fn)
        if self._done.mask is not None:
            self._done.mask = fn(self._done.mask)

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
        for side in self._sides.values():
            side.drop_last(n)
        self.k, self.v = self._sides["k"].view(self.k.scale), self._sides["v"].view(self.v.scale)
        self.cumulative_length -= n


class QuantizedKVCache(Cache):
    """A Cache of `QuantizedLayer`s, one per decoder layer, built from per-layer plans (`KVRuntime.new_cache`)."""

    def __init__(self, plans: list[LayerPlan], nonfinite: NonFiniteCount | None = None, workspace: bool = True):
        """workspace: see `QuantizedLayer` (False for a cache that one forward reads after its prefill)."""
        super().__init__(layers=[QuantizedLayer(p, nonfinite, workspace) for p in plans])
        self.plans = plans
        self.attention_mask: torch.Tensor | None = None  # 2-D [B, tokens so far + new] of the current forward

    def set_attention_mask(self, attention_mask: torch.Tensor | None) -> None:
        """The forward about to run: its 2-D attention mask (True/1 = real token), or None / a 4-D mask (every
        token real). `KVRuntime` calls this before each forward of its model."""
        if attention_mask is None or attention_mask.dim() != 2 or bool(attention_mask.bool().all()):
            self.attention_mask = None
        else:
            self.attention_mask = attention_mask.bool()

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        layer = self.layers[layer_idx]
        valid = new_token_padding(self.attention_mask, layer.cumulative_length, key_states.shape[-2])
        own = None
        if layer.plan.prefix_serde is not None and self.attention_mask is not None:  # padded: count own tokens
            own = own_positions(self.attention_mask, layer.cumulative_length, key_states.shape[-2], key_states.device)
        return layer.update(key_states, value_states, *args, valid=valid, own=own, **kwargs)

    def nbytes(self) -> int:
        """Bytes of every layer's stored codes + block scales."""
        return sum(layer.nbytes() for layer in self.layers)

    def layer_formats(self) -> list[str]:
        return [p.fmt.name for p in self.plans]
