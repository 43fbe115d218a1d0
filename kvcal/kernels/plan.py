"""`CachePlan`: a model's quantized-KV configuration as parsed values — what `KVRuntime.from_plan` installs.

Strings become a plan in one place: `parse_cache_plan` (the format pair, the kv input dtype, the attention mode,
the nvfp4 global policy, the attention implementation), which `kvcal.evaluate.spec.eval_spec` calls for
`kvcal eval`, a sweep cell, a release candidate and lm-eval's `--model kvcal --model_args ...` alike, and
`KVRuntime`'s keyword form calls for Python users. The model-dependent parts (the scale file checked against
the checkpoint, the skipped layer indices) are bound on top with `dataclasses.replace` by
`kvcal.evaluate.bound.bind`. Below this, nothing parses an option string.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvcal import formats
from kvcal.errors import UsageError
from kvcal.kernels.attention import check_attention_mode
from kvcal.kernels.cache import FirstBatchScales, check_nvfp4_global
from kvcal.serde import check_prefix_serde

if TYPE_CHECKING:
    from kvcal.scales import ScaleSet

IMPLS = ("auto", "torch", "triton")


@dataclass(frozen=True)
class CachePlan:
    """Every option of a quantized KV cache, parsed. `k_fmt` / `v_fmt`: the two sides' formats (the same object
    unless a `k=...,v=...` pair). `scales`: a scale file already checked against the checkpoint (compared by
    identity: tensors have no plain ==). `first_batch`: vLLM's calculate_kv_scales (True, or a store whose scales
    the first batch fixed, shared by a runtime that replaces another). `skip_layers`: layer indices kept in BF16.
    `kv_input_dtype`: a KV_INPUT_DTYPES key, or None = K/V quantized as computed. `impl`: a requested IMPLS key
    (resolved against the device when installed). `prefix_serde` / `prefix_tokens`: LMCache's storage tier
    (`kvcal.serde`): each sequence's first `prefix_tokens` K/V round-trip through that serde before the live
    format stores them; None / 0 = off."""

    k_fmt: formats.KVFormat
    v_fmt: formats.KVFormat
    scales: ScaleSet | None = field(default=None, compare=False)
    first_batch: bool | FirstBatchScales = False
    skip_layers: frozenset[int] = frozenset()
    kv_input_dtype: str | None = None
    attention: str = "kv"
    nvfp4_global: str = "one"
    impl: str = "auto"
    prefix_serde: str | None = None
    prefix_tokens: int = 0

    @property
    def kv_format(self) -> str:
        """The canonical name (formats.parse_kv_format's): one format, or `k=<K>,v=<V>`."""
        return formats.pair_name(self.k_fmt, self.v_fmt)

    @property
    def quantized(self) -> bool:
        return self.k_fmt.name != "auto"


def parse_cache_plan(
    kv_format: str | formats.KVFormat,
    *,
    kv_input_dtype: str | None = None,
    attention: str = "kv",
    nvfp4_global: str = "one",
    impl: str = "auto",
    prefix_serde: str | None = None,
    prefix_tokens: int | None = None,
) -> CachePlan:
    """The cache's option strings as a model-free plan (no scales, no skipped layers); UsageError naming the
    option otherwise. `kv_input_dtype` None: K/V quantized as computed. `prefix_serde` / `prefix_tokens`: both or
    neither (`kvcal.serde.check_prefix_serde`)."""
    if impl not in IMPLS:
        raise UsageError(f"--impl must be one of {', '.join(IMPLS)}, got '{impl}'")
    k_fmt, v_fmt = formats.kv_pair(formats.parse_kv_format(kv_format) if isinstance(kv_format, str) else kv_format)
    serde, n_prefix = check_prefix_serde(prefix_serde, prefix_tokens)
    if serde is not None and k_fmt.name == "auto":
        raise UsageError(
            "--prefix-serde needs kvcal's cache, and --kv-format auto runs transformers' own; use --kv-format bf16 "
            "for an unquantized live cache (or any quantized format)"
        )
    return CachePlan(
        k_fmt=k_fmt,
        v_fmt=v_fmt,
        kv_input_dtype=None if kv_input_dtype is None else formats.parse_kv_input_dtype(kv_input_dtype),
        attention=check_attention_mode(attention, k_fmt.name, v_fmt.name),
        nvfp4_global=check_nvfp4_global(nvfp4_global),
        impl=impl,
        prefix_serde=serde,
        prefix_tokens=n_prefix,
    )
