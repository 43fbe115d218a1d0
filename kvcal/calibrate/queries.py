"""See the post-RoPE queries each attention layer computes, for FP8 attention's query scale (`q_scale`).

vLLM's FlashAttention-3 FP8 path quantizes the query to e4m3 with a static per-tensor `q_scale` right before the
attention kernel (after RoPE and any q-norm), and reads `model.layers.{i}.self_attn.q_scale` from the checkpoint.
llm-compressor calibrates it where compressed-tensors hooks the query: `QuantizedAttentionImpl` (compressed_tensors
0.19, modeling/attention.py) is called through a registered attention implementation with the query the model
hands its attention function, i.e. post-RoPE, [B, H_q, T, D]. kvcal observes the same tensor the same way: it
registers an attention implementation that shows the query to a sink and then runs the model's own implementation
(sdpa, eager — the modeling file's `eager_attention_forward` — or any registered one).

The scale is llm-compressor's static min-max for FP8: q_scale = amax / 448 over every real query element of the
calibration samples (per tensor: vLLM takes one Q scale per layer). Samples run one per forward (no padding), and
the forward stops right after the last layer's query is seen.

The softmax probabilities need no observation: the FP8 kernel quantizes P = exp(s - running max), whose largest
value is exactly 1 in every row by construction; FA3 uses a fixed 2**8 offset instead of a scale and vLLM's
CUDA backends take no prob_scale (only ROCm paths read `prob_scale`, from Quark checkpoints'
`self_attn.prob_output_scale`), so kvcal writes none.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from kvcal.calibrate.hooks import ProgressFn, _StopForward, attention_fn, check_finite, forward_observed
from kvcal.errors import KvcalError

OBSERVE_ATTN = "kvcal_observe_query"
FP8_E4M3_MAX = 448.0

# sink(layer_idx, query) with query: [B, H_q, T, D] post-RoPE
QuerySink = Callable[[int, torch.Tensor], None]


class QueryAmax:
    """Running per-layer amax of the post-RoPE queries (float32, on CPU)."""

    def __init__(self, num_layers: int) -> None:
        self.amax = torch.zeros(num_layers, dtype=torch.float32)
        self.seen: set[int] = set()

    def __call__(self, layer_idx: int, query: torch.Tensor) -> None:
        a = query.detach().abs().amax().float().cpu()
        check_finite(layer_idx, "queries", a)
        self.amax[layer_idx] = torch.maximum(self.amax[layer_idx], a)
        self.seen.add(layer_idx)

    def scales(self) -> list[torch.Tensor]:
        """q_scale per layer, shape (1,): amax / 448; an all-zero layer gets the smallest normal float32."""
        tiny = torch.finfo(torch.float32).tiny
        return [torch.clamp(a / FP8_E4M3_MAX, min=tiny).reshape(1) for a in self.amax]


def observe_queries(
    model: Any,
    samples: Sequence[torch.Tensor],
    num_layers: int,
    progress: ProgressFn | None = None,
) -> QueryAmax:
    """Run every sample (1-D token ids, one per forward) through the model with its queries shown to a QueryAmax;
    the model's attention implementation is restored afterwards."""
    sink = QueryAmax(num_layers)
    original = model.config._attn_implementation
    last = num_layers - 1

    def observing(module: torch.nn.Module, query: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        sink(int(module.layer_idx), query)  # query: [B, H_q, T, D], post-RoPE
        if int(module.layer_idx) == last:
            raise _StopForward  # nothing after the last layer's query is needed
        return attention_fn(module, original, "observe the queries")(module, query, *args, **kwargs)

    ALL_ATTENTION_FUNCTIONS.register(OBSERVE_ATTN, observing)
    ALL_MASK_ATTENTION_FUNCTIONS.register(OBSERVE_ATTN, ALL_MASK_ATTENTION_FUNCTIONS[original])
    model.set_attn_implementation(OBSERVE_ATTN)
    try:
        if progress:
            progress(0, len(samples), "queries")
        with torch.no_grad():
            for i, ids in enumerate(samples):
                forward_observed(model, ids.reshape(1, -1), lambda *_: None, stop_after=None)
                if progress:
                    progress(i + 1, len(samples), "queries")
    finally:
        model.set_attn_implementation(original)
    missing = sorted(set(range(num_layers)) - sink.seen)
    if missing:
        raise KvcalError(
            f"layers {missing[:8]} of model type '{model.config.model_type}' never called their attention "
            "function with a query; kvcal cannot calibrate attention scales for this architecture"
        )
    return sink
