"""The scale policy of one cache side (K or V of one layer): which scale each write quantizes with.

Chosen once per side when the layer is built (`side_policies`), from its format's codec and the layer plan:
- `NoScale`: a format without a static scale (dynamic per-token / per-block scales, bf16, TurboQuant's sides):
  writes quantize with none (a plan's scale for such a side is not read).
- `StaticScale`: fp8_* / int8_per_tensor with a scale file's scale (or None: formats' default 1.0); nvfp4 with a
  scale file's global.
- `FirstBatch`: vLLM's calculate_kv_scales (`FirstBatchScales`): the layer's first write fixes the scale.
- `OneGlobal`: nvfp4 without a scale file, policy "one": 1.0 (vLLM's default).
- `PerSequenceGlobal`: nvfp4 policy "per_sequence": each sequence's own amax / (448 * 6), fixed at its first
  write with a real token (the layer's K and V share the record of which sequences have fixed theirs).
`fixed(device)` is the scale when it does not depend on the new tokens (the C write needs it before writing), False
when they decide it; `scale(x, valid)` is the scale a write quantizes with.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from kvcal import formats
from kvcal.formats import KVFormat

# vLLM's ranges for calculate_kv_scales (vllm/envs.py K_SCALE_CONSTANT, V_SCALE_CONSTANT; Q_SCALE_CONSTANT = 200)
K_SCALE_CONSTANT = 200.0
V_SCALE_CONSTANT = 100.0
FIRST_BATCH = "first-batch"


class FirstBatchScales:
    """vLLM's `calculate_kv_scales`: each layer's k_scale / v_scale computed from the first forward that writes K/V
    and fixed for every later write of any cache of the same runtime (vLLM fixes them for the server's lifetime).

    vLLM (vllm/model_executor/layers/attention/attention.py `Attention.calc_kv_scales`, called through
    `maybe_calc_kv_scales` at the start of the attention layer's forward, before the cache write, while the layer's
    `calculate_kv_scales` flag is set; the flag drops after the first call, and the V1 model runner turns it off
    after its first real forward): `k_scale = abs(key).max() / K_SCALE_CONSTANT (200)`, `v_scale = abs(value).max()
    / V_SCALE_CONSTANT (100)`, one fp32 number per layer over every token of that batch (its real tokens: vLLM's
    batches hold no padding) and every KV head. Here: over the real tokens of the first write (padding stored as 0,
    NaN/Inf ignored as everywhere in kvcal), in the K/V input dtype; an all-zero first batch gets 1.0. fp8_* use it
    as their scale, nvfp4 / nvfp4_4over6 as their global scale (vLLM's NVFP4 store divides by k_scale / v_scale).

    History: vLLM deprecated `--calculate-kv-scales` (PR #37201, March 2026) and removed it (PR #49389, July 2026):
    current vLLM takes checkpoint scales or 1.0. This reproduces the releases that have it (up to v0.18), whose
    V1 runner computes the scales in its first real forward (PR #27232); some earlier ones took them from the
    profiling dummy run (PR #37565), which kvcal does not reproduce."""

    def __init__(self) -> None:
        self.scales: dict[tuple[int, str], torch.Tensor] = {}  # (layer, 'k' | 'v') -> fp32 0-d

    def scale(self, layer: int, which: str, x: torch.Tensor) -> torch.Tensor:
        """The layer's fixed scale, computed from x [B, H_kv, T, D] (padding zeroed) if this is its first write."""
        key = (layer, which)
        if key not in self.scales:
            amax = formats.finite_abs(x).amax().float() if x.numel() else torch.zeros((), device=x.device)
            rng = K_SCALE_CONSTANT if which == "k" else V_SCALE_CONSTANT
            self.scales[key] = torch.where(amax > 0, amax / rng, torch.ones_like(amax))
        return self.scales[key]

    def as_lists(self) -> dict[str, list[float | None]]:
        """{'k': [per layer], 'v': [...]} of the scales fixed so far (None: layer not written yet)."""
        n = 1 + max((i for i, _ in self.scales), default=-1)
        return {
            w: [float(self.scales[(i, w)]) if (i, w) in self.scales else None for i in range(n)] for w in "kv"
        }


def per_sequence(s: torch.Tensor | None) -> bool:
    return s is not None and s.dim() == 4  # [B, 1, 1, 1]


def _on_device(s: torch.Tensor | float, x: torch.Tensor, fmt: KVFormat) -> torch.Tensor:
    """A plan's scale as fp32 on x's device; a calibratable side's validated once here: every write
    passes this tensor (or a scale computed positive and finite) with scale_checked."""
    s = torch.as_tensor(s, dtype=torch.float32).to(x.device)
    s = s.reshape(()) if s.numel() == 1 else s
    return formats.check_scale(s, x) if fmt.calibratable else s


class ScalePolicy:
    """One side's scale policy (see the module docstring)."""

    def __init__(self, fmt: KVFormat, initial: torch.Tensor | None = None) -> None:
        self.fmt = fmt
        self.initial = initial  # the plan's scale
        self.s: torch.Tensor | None = initial

    def init(self, x: torch.Tensor) -> None:
        """The layer's first write (x: its new K or V): the plan's scale on x's device, validated."""
        if self.s is not None:
            self.s = _on_device(self.s, x, self.fmt)

    def fixed(self, device: torch.device) -> torch.Tensor | None | bool:
        return self.s

    def scale(self, x: torch.Tensor, valid: torch.Tensor | None) -> torch.Tensor | None:
        """x: the new K or V [B, H_kv, T, D] with its padding already zeroed."""
        return self.fixed(x.device)  # type: ignore[return-value]

    def select(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """A batch re-index of the cache: a per-sequence scale follows its sequences."""
        if per_sequence(self.s):
            self.s = fn(self.s)  # type: ignore[arg-type]

    def reset(self) -> None:
        self.s = self.initial


class NoScale(ScalePolicy):
    """No static scale: `s` stays None."""


class StaticScale(ScalePolicy):
    """A scale file's scale (fp8_*, int8_per_tensor, nvfp4's global), or None: formats' default 1.0."""


class FirstBatch(ScalePolicy):
    """vLLM's calculate_kv_scales: the layer's first write fixes the scale in the runtime's shared store."""

    def __init__(self, fmt: KVFormat, store: FirstBatchScales, layer: int, which: str) -> None:
        super().__init__(fmt)
        self.store, self.key = store, (layer, which)

    def fixed(self, device: torch.device) -> torch.Tensor | None | bool:
        return self.store.scales.get(self.key, False)

    def scale(self, x: torch.Tensor, valid: torch.Tensor | None) -> torch.Tensor | None:
        return self.store.scale(*self.key, x)


class OneGlobal(ScalePolicy):
    """nvfp4 without a scale file, policy "one": a global 1.0 (one tensor per device for every write)."""

    def fixed(self, device: torch.device) -> torch.Tensor | None | bool:
        if self.s is None or self.s.device != device:
            self.s = torch.ones((), dtype=torch.float32, device=device)
        return self.s

    def init(self, x: torch.Tensor) -> None:
        pass

    def reset(self) -> None:
        self.s = None


class SequencesFixed:
    """[B] bool: which sequences of a layer have fixed their per-sequence global (shared by its K and V)."""

    def __init__(self) -> None:
        self.mask: torch.Tensor | None = None


class PerSequenceGlobal(ScalePolicy):
    """nvfp4 policy "per_sequence": each sequence's amax / (448 * 6) over its real tokens ([B, 1, 1, 1]), fixed at
    its first write with a real token. `last`: this side is the layer's last nvfp4 side (it records the fix)."""

    def __init__(self, fmt: KVFormat, initial: torch.Tensor | None, done: SequencesFixed, last: bool) -> None:
        super().__init__(fmt, initial)
        self.done, self.last = done, last

    def fixed(self, device: torch.device) -> torch.Tensor | None | bool:
        return False

    def scale(self, x: torch.Tensor, valid: torch.Tensor | None) -> torch.Tensor | None:
        new = formats.nvfp4_dynamic_global(x)  # [B, 1, 1, 1]
        real = torch.ones(x.shape[0], dtype=torch.bool, device=x.device) if valid is None else valid.any(-1)
        done = self.done.mask
        # a sequence keeps the global of its first write with a real token
        s = new if self.s is None or done is None else torch.where(done[:, None, None, None], self.s, new)
        self.s = s
        if self.last:
            self.done.mask = real if done is None else done | real
        return s


def side_policies(
    k_fmt: KVFormat,
    v_fmt: KVFormat,
    scales: tuple[torch.Tensor | None, torch.Tensor | None],
    first_batch: FirstBatchScales | None,
    nvfp4_global: str,
    layer: int,
    done: SequencesFixed,
) -> dict[str, ScalePolicy]:
    """K's and V's policies of one layer: `scales` = the plan's (k, v) scales; `done` the layer's record
    of the sequences that fixed their per-sequence global."""
    out: dict[str, ScalePolicy] = {}
    for which, fmt, s in (("k", k_fmt, scales[0]), ("v", v_fmt, scales[1])):
        if not fmt.calibratable:
            out[which] = NoScale(fmt)
        elif first_batch is not None:
            out[which] = FirstBatch(fmt, first_batch, layer, which)
        elif not fmt.codec.global_scale or (s is not None and not per_sequence(s)):
            out[which] = StaticScale(fmt, s)
        elif nvfp4_global == "one":
            out[which] = OneGlobal(fmt)
        else:
            last = which == "v" or not v_fmt.codec.global_scale  # after the layer's last nvfp4 side
            out[which] = PerSequenceGlobal(fmt, s, done, last)
    return out
