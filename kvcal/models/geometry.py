"""A model's KV-cache geometry from its transformers config: layer types, windows, heads (`kv_spec`), and the
`--skip-layers` selector over it. Pure: reads no files (`kvcal.models.config.load_config` gives the config)."""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass
from typing import Any

from kvcal.errors import UsageError

log = logging.getLogger(__name__)

SLIDING = "sliding_attention"
FULL = "full_attention"
# vLLM's --kv-cache-dtype-skip-layers spells the sliding type "sliding_window"; transformers "sliding_attention".
LAYER_TYPE_ALIASES = {
    "sliding_window": SLIDING,
    "sliding_attention": SLIDING,
    "sliding": SLIDING,
    "full_attention": FULL,
    "full": FULL,
    "global": FULL,
}


@dataclass(frozen=True)
class LayerSpec:
    """One attention layer's KV cache geometry."""

    index: int
    type: str  # SLIDING or FULL
    window: int | None  # tokens a sliding layer keeps; None for full attention
    num_heads: int  # query heads
    kv_heads: int
    head_dim: int


@dataclass(frozen=True)
class KVSpec:
    """The KV-cache-relevant facts of a model config."""

    model_type: str
    layers: tuple[LayerSpec, ...]
    max_position_embeddings: int | None
    torch_dtype: str | None

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def layer_types(self) -> list[str]:
        return [layer.type for layer in self.layers]

    def to_dict(self) -> dict[str, Any]:
        return {
            "model_type": self.model_type,
            "num_layers": self.num_layers,
            "max_position_embeddings": self.max_position_embeddings,
            "torch_dtype": self.torch_dtype,
            "layers": [asdict(layer) for layer in self.layers],
        }


def kv_spec(config: Any) -> KVSpec:
    """Per-layer KV geometry from a transformers config; raises UsageError for models without a standard KV cache."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    model_type = str(getattr(text, "model_type", None) or getattr(config, "model_type", "unknown"))
    if getattr(text, "kv_lora_rank", None) or getattr(text, "q_lora_rank", None):
        raise UsageError(
            f"model type '{model_type}' uses multi-head latent attention (compressed KV); kvcal supports "
            "caches of per-head K and V (Llama, Qwen2, Mistral, Gemma 2/3, gpt-oss and similar)"
        )
    num_layers = getattr(text, "num_hidden_layers", None)
    num_heads = getattr(text, "num_attention_heads", None)
    hidden = getattr(text, "hidden_size", None)
    if not num_layers or not num_heads:
        raise UsageError(
            f"config of model type '{model_type}' has no attention dimensions "
            "(num_hidden_layers / num_attention_heads); is this a decoder-only language model?"
        )
    kv_heads = getattr(text, "num_key_value_heads", None) or num_heads
    head_dim = getattr(text, "head_dim", None) or (hidden // num_heads if hidden else None)
    if not head_dim:
        raise UsageError(f"config of model type '{model_type}' has neither head_dim nor hidden_size")
    window = getattr(text, "sliding_window", None)
    layer_types = getattr(text, "layer_types", None)
    if layer_types is None:
        # Mistral-style configs: one sliding window for every layer when set.
        uses_window = window is not None and getattr(text, "use_sliding_window", True)
        layer_types = [SLIDING if uses_window else FULL] * num_layers
    layers = []
    for i, raw in enumerate(layer_types[:num_layers]):
        ltype = LAYER_TYPE_ALIASES.get(str(raw), FULL if "full" in str(raw) else str(raw))
        if ltype not in (SLIDING, FULL):
            raise UsageError(
                f"layer {i} of model type '{model_type}' has attention type '{raw}', which kvcal does not support"
            )
        layers.append(
            LayerSpec(
                index=i,
                type=ltype,
                window=int(window) if ltype == SLIDING and window else None,
                num_heads=int(num_heads),
                kv_heads=int(kv_heads),
                head_dim=int(head_dim),
            )
        )
    # `dtype` first: reading `torch_dtype` of a transformers 5 config logs a deprecation warning
    dtype = getattr(text, "dtype", None) or getattr(config, "dtype", None)
    return KVSpec(
        model_type=model_type,
        layers=tuple(layers),
        max_position_embeddings=getattr(text, "max_position_embeddings", None),
        torch_dtype=str(dtype).replace("torch.", "") if dtype is not None else None,
    )


def parse_skip_layers(spec: str | None, kv: KVSpec) -> frozenset[int]:
    """Layers that keep a 16-bit cache: '', 'sliding_window' (vLLM) / 'sliding_attention', 'full_attention',
    or comma-separated indices '0,3,17'; items may be mixed ('sliding_window,0'). A type that selects no layer of
    this model logs a warning (the `kvcal` CLI prints it as `Warning: ...`)."""
    if spec is None or not str(spec).strip() or str(spec).strip().lower() == "none":
        return frozenset()
    chosen: set[int] = set()
    for item in (s.strip() for s in str(spec).split(",")):
        if not item:
            continue
        if item.lstrip("-").isdigit():
            idx = int(item)
            if not 0 <= idx < kv.num_layers:
                raise UsageError(
                    f"skip-layer index {idx} is out of range: the model has layers 0..{kv.num_layers - 1}"
                )
            chosen.add(idx)
            continue
        ltype = LAYER_TYPE_ALIASES.get(item.lower())
        if ltype is None:
            raise UsageError(
                f"unknown skip-layer name '{item}'; use sliding_window (or sliding_attention), "
                "full_attention, or layer indices like 0,3,17"
            )
        matched = [layer.index for layer in kv.layers if layer.type == ltype]
        if not matched:  # accepted (one selector serves many models), but it keeps nothing in 16 bits here
            log.warning(
                f"--skip-layers '{item}' selects no layer: this {kv.model_type} model has no "
                f"{ltype.replace('_', '-')} layers, so that item keeps none in 16 bits"
            )
        chosen.update(matched)
    return frozenset(chosen)
