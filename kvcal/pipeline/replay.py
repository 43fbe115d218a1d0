"""Replaying a reference forward's untouched layers: a one-layer damage forward need not recompute them.

Sensitivity and plan run, per calibration batch, one reference forward (no layer quantized) and then forwards in
which only some layers are fake-quantized. Every decoder layer before the first quantized one sees exactly the
reference's input, so its output is the reference's output, bit for bit (same weights, same shapes, same
kernels). `LayerReplay` keeps those outputs from the reference forward and, for a later forward whose first
quantized layer is `f`, answers layers 0..f-1 with them instead of running them. A one-layer pass over L layers
then runs L - f layers rather than L: (L + 1) / 2L of the decoder's work on average (the LM head and the
log-softmax still run once per forward).

It only replaces what a layer returns; the embedding, masks and rotary tables are still computed by the model's
own forward, and a quantized layer's cache write is unchanged. A layer that is not reached never writes its K/V,
which a prefill-only cache (FakeQuantCache, PlanCache) never reads back. Models whose decoder layers kvcal cannot
find (`decoder_layers` returns None) run every forward in full.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch


def decoder_layers(model: Any, num_layers: int) -> list[torch.nn.Module] | None:
    """The model's decoder layers in order (`get_decoder().layers`), or None when it has no such list of
    `num_layers` modules."""
    get = getattr(model, "get_decoder", None)
    decoder = get() if callable(get) else None
    layers = getattr(decoder, "layers", None)
    if not isinstance(layers, torch.nn.ModuleList) or len(layers) != num_layers:
        return None
    return list(layers)


def first_quantized(quant: Sequence[Any]) -> int:
    """Index of the first layer a config quantizes (None = untouched); len(quant) when it quantizes none."""
    return next((i for i, q in enumerate(quant) if q is not None), len(quant))


class LayerReplay:
    """The reference forward's decoder-layer outputs of one batch, replayed for forwards that leave a prefix of
    layers untouched. Use: `with replay.capture(): reference forward`, then `with replay.skip(f): forward`."""

    def __init__(self, model: Any, num_layers: int) -> None:
        self.layers = decoder_layers(model, num_layers) or []
        self.outputs: list[Any] = []  # per layer (all but the last): what its forward returned, [B, T, hidden]

    @contextmanager
    def capture(self) -> Iterator[None]:
        self.outputs = [None] * max(len(self.layers) - 1, 0)

        def keep(index: int) -> Any:
            def hook(_module: torch.nn.Module, _args: Any, output: Any) -> None:
                self.outputs[index] = output

            return hook

        handles = [layer.register_forward_hook(keep(i)) for i, layer in enumerate(self.layers[:-1])]
        try:
            yield
        finally:
            for h in handles:
                h.remove()
        if any(o is None for o in self.outputs):  # a layer did not run: replay nothing rather than guess
            self.outputs = []

    @contextmanager
    def skip(self, first: int) -> Iterator[None]:
        """While active, layers 0..first-1 return the captured outputs without running (none when nothing was
        captured). The instance's own `forward` attribute (an accelerate hook, say) is put back afterwards."""
        n = min(first, len(self.outputs))
        saved = [layer.__dict__.get("forward") for layer in self.layers[:n]]
        for layer, out in zip(self.layers[:n], self.outputs, strict=False):
            layer.forward = _returning(out)  # type: ignore[method-assign]
        try:
            yield
        finally:
            for layer, own in zip(self.layers[:n], saved, strict=True):
                if own is None:
                    del layer.forward
                else:
                    layer.forward = own  # type: ignore[method-assign]


def _returning(output: Any) -> Any:
    def forward(*_args: Any, **_kwargs: Any) -> Any:
        return output

    return forward
