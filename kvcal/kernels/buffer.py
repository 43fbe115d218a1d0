"""`TokenBuffer`: a tensor [..., T, C] that grows along the token dim (-2) with spare capacity, as an engine's
cache is allocated ahead of the tokens written into it.

A decode step appends one token per layer; `torch.cat` of everything stored so far would copy O(T) per step (per
layer, per K/V), which at 8k tokens costs more than the step's attention. Here an append writes the new tokens into
the spare room (amortized O(1): when the room runs out, the live tokens move once into a buffer ~1.5x as large) and
returns a VIEW of the live tokens — what the attention reads. Dropping tokens from the front (a sliding window) or
the back (crop) moves indices only; a buffer left mostly empty by a drop is compacted.

Views handed out stay valid until the next append/crop: tokens already written are never rewritten in place (crop
then append does rewrite positions past the crop, which is why `QuantizedLayer` invalidates the torch path's
workspace on crop). The cache stores codes and block scales in these (`kvcal.kernels.cache`), and the torch path
keeps its float32 values of them in one (`kvcal.kernels.fast.Workspace`).
"""

from __future__ import annotations

import torch


def grown(needed: int, capacity: int) -> int:
    """Capacity for `needed` live tokens when a buffer of `capacity` is full: 1.5x the old one (geometric, so
    appends are amortized O(1)), but at most 2x what is needed (a sliding window's live count is constant: its
    buffer must not grow at every move) and never less than needed (the first allocation is exact, so a prefill
    costs no spare memory)."""
    return max(needed, min(2 * needed, capacity + capacity // 2))


class TokenBuffer:
    """Live tokens `data[..., start:end, :]` of a [..., capacity, C] tensor (see the module docstring)."""

    __slots__ = ("data", "end", "start")

    def __init__(self, data: torch.Tensor | None = None) -> None:
        self.data = data  # [..., capacity, C]; None before the first append
        self.start = 0
        self.end = 0 if data is None else data.shape[-2]

    def __len__(self) -> int:
        return self.end - self.start

    @property
    def capacity(self) -> int:
        return 0 if self.data is None else self.data.shape[-2]

    def view(self) -> torch.Tensor | None:
        """The live tokens [..., len, C] (a view)."""
        return None if self.data is None else self.data.narrow(-2, self.start, self.end - self.start)

    def append(self, new: torch.Tensor) -> torch.Tensor:
        """Write new [..., n, C] after the live tokens; return the view of all live tokens (old + new)."""
        n = new.shape[-2]
        d = self.data
        if d is not None and (d.shape[:-2] != new.shape[:-2] or d.shape[-1] != new.shape[-1]):
            raise ValueError(f"appending {tuple(new.shape)} to stored tokens of shape {tuple(d.shape)}")
        if d is None or self.end + n > d.shape[-2] or d.dtype != new.dtype or d.device != new.device:
            self._move(len(self) + n, new.shape[:-2], new.shape[-1], new.dtype, new.device)
        # narrow + copy_, not `data[..., a:b, :] = new`: Python indexing costs ~15 µs a call, and a decode step
        # appends 4-8 times per layer
        self.data.narrow(-2, self.end, n).copy_(new)  # type: ignore[union-attr]
        self.end += n
        return self.data.narrow(-2, self.start, self.end - self.start)  # type: ignore[union-attr]

    def reserve(
        self, n: int, lead: tuple[int, ...], width: int, dtype: torch.dtype, device: torch.device
    ) -> None:
        """Make room for n tokens after the live ones in a [*lead, capacity, width] buffer of dtype (a writer
        that fills `data[..., end:end + n, :]` itself, then advances `end`: kvcal.kernels.cpu_write)."""
        d = self.data
        if d is not None and (d.shape[:-2] != lead or d.shape[-1] != width):
            raise ValueError(f"appending {(*lead, n, width)} to stored tokens of shape {tuple(d.shape)}")
        if d is None or self.end + n > d.shape[-2] or d.dtype != dtype or d.device != device:
            self._move(len(self) + n, lead, width, dtype, device)

    def keep_last(self, n: int) -> None:
        """Drop all but the last n live tokens (a sliding window); compact a buffer left mostly empty."""
        self.start = max(self.start, self.end - n)
        if self.data is not None and self.capacity > 4 * max(1, len(self)):
            d = self.data
            self._move(len(self), d.shape[:-2], d.shape[-1], d.dtype, d.device)

    def drop_last(self, n: int) -> None:
        """Forget the last n live tokens (crop)."""
        self.end = max(self.start, self.end - n)

    def _move(
        self, needed: int, lead: tuple[int, ...], width: int, dtype: torch.dtype, device: torch.device
    ) -> None:
        """Move the live tokens to the front of a new [*lead, capacity, width] buffer with room for `needed`."""
        live = len(self)
        cap = grown(needed, self.capacity)
        data = torch.empty((*lead, cap, width), dtype=dtype, device=device)
        if live:
            data[..., :live, :] = self.data[..., self.start : self.end, :]  # type: ignore[index]
        self.data, self.start, self.end = data, 0, live
