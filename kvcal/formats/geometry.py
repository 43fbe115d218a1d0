"""Where a format (a row, a K/V pair, a TurboQuant preset) can be stored: its families' geometry rules over a
model's layers. One place for what capacity, the evaluation's binding and the runtime each refuse: the boundary
layers the engine keeps out of a family (vLLM's TurboQuant: the first and last 2), sliding-window layers a family
does not take (TurboQuant), and each side's head_dim rule (blocks; a power of two for a rotation)."""

from __future__ import annotations

from collections.abc import Iterable

from kvcal.formats.codec import KVFormat
from kvcal.formats.table import kv_pair, pair_name, parse_kv_format
from kvcal.formats.turboquant import check_tq_sliding, tq_boundary_layers

# a format as given: a name (parsed here), a row, or the (K, V) rows of a parsed plan (nothing parsed)
Format = str | KVFormat | tuple[KVFormat, KVFormat]


def _sides(kv_format: Format) -> list[KVFormat]:
    k, v = kv_format if isinstance(kv_format, tuple) else kv_pair(kv_format)
    return [k] if k is v else [k, v]


def _name(kv_format: Format) -> str:
    """The canonical name errors give: a preset's, a pair's `k=...,v=...`, a row's."""
    if isinstance(kv_format, tuple):
        return pair_name(*kv_format)
    return parse_kv_format(kv_format if isinstance(kv_format, str) else kv_format.name)


def boundary_layers(kv_format: Format, num_layers: int, n: int | None = None) -> frozenset[int]:
    """The layers the engine keeps out of this format ('auto' there): the first and last n (default: the family's
    own, vLLM's TurboQuant 2; n capped at half), none for a family without boundary layers."""
    if isinstance(kv_format, str) and kv_format.strip().lower() in ("", "auto"):
        return frozenset()
    own = max(f.codec.boundary_layers for f in _sides(kv_format))
    if not own:
        return frozenset()
    return tq_boundary_layers(num_layers, own if n is None else n)


def check_sliding(kv_format: Format, sliding: list[int]) -> None:
    """UsageError where a side's family takes no sliding window and the format would hold the sliding-window
    layers `sliding` (their indices, the skipped ones left out)."""
    if any(not f.codec.sliding for f in _sides(kv_format)):
        check_tq_sliding(_name(kv_format), sliding)


def check_rotation_head_dims(kv_format: Format, head_dims: Iterable[int]) -> None:
    """UsageError unless every head_dim is one the engine builds a rotated family's cache for (a power of two:
    int4_per_token_head, TurboQuant); the error names the format as given (a preset by its name)."""
    sides = [f for f in _sides(kv_format) if f.codec.pow2_head_dim]
    name = _name(kv_format) if sides else ""
    for f in sides:
        for d in head_dims:
            f.check_head_dim(d, name)
