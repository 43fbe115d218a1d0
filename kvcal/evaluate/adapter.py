"""lm-eval model `kvcal`: lm-eval's HFLM whose every forward reads K/V through kvcal's quantized cache.

`python -m kvcal.evaluate.adapter --model kvcal --model_args pretrained=DIR,kv_format=nvfp4,kv_scales=S,skip_layers=sliding_window
--tasks ...` is lm-eval's own command line with this model registered (lm-eval 0.4.13 has no model plugin discovery,
so plain `lm_eval --model kvcal` works wherever kvcal.evaluate.adapter has been imported, e.g. from Python). With `kv_format=auto` nothing is overridden: the class *is* HFLM (the parity
reference). Otherwise:

- `_model_call` (loglikelihood, loglikelihood_rolling) passes a fresh quantized cache as `past_key_values` with
  `use_cache=True`, so the prefill itself writes K/V into the quantized cache and attention reads them back
  dequantized — the same thing an engine does when it serves a prompt with a quantized KV cache.
- `_model_generate` (generate_until) passes a fresh quantized cache to `generate`, so prefill and every decode step
  read quantized K/V.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from lm_eval.api.registry import register_model
from lm_eval.models.huggingface import HFLM

from kvcal import models, parallel
from kvcal.errors import UsageError
from kvcal.evaluate.timing import ForwardTimer, generate_call
from kvcal.formats import parse_kv_format
from kvcal.placement import Placement

FIRST_BATCH = "first-batch"  # kv_scales value: vLLM's calculate_kv_scales (= kvcal.kernels.cache.FIRST_BATCH)


def _as_bool(value: Any) -> bool:
    # lm-eval's --model_args parser turns "true"/"false" into bools, but a dict may still hold strings.
    if isinstance(value, str):
        return value.strip().lower() in ("1", "true", "yes", "on")
    return bool(value)


@register_model("kvcal")
class KvcalLM(HFLM):
    """HFLM with kvcal's quantized KV cache. Extra model_args: kv_format, kv_scales, skip_layers, impl,
    force_scales, nvfp4_global (nvfp4 without scales: one | per_sequence), model_ref (the name recorded in results; defaults to `pretrained`),
    kv_input_dtype (K/V rounded to it before quantization; default: as computed); kv_scales=first-batch is vLLM's
    calculate_kv_scales; attention (kv | fp8: vLLM's FlashAttention-3 FP8 attention)."""

    # kvcal eval's timer of this LM's forwards (kvcal.evaluate.timing); its generate calls mark their requests
    forward_timer: ForwardTimer | None = None

    def __init__(
        self,
        pretrained: str | Any,
        kv_format: str = "auto",
        kv_scales: str | None = None,
        skip_layers: str | None = None,
        impl: str = "auto",
        force_scales: bool | str = False,
        model_ref: str | None = None,
        nvfp4_global: str = "one",
        kv_input_dtype: str | None = None,
        attention: str = "kv",
        device_map: str | None = None,
        max_memory: str | None = None,
        offload_folder: str | None = None,
        kv_scale_set: Any = None,
        skip_set: frozenset[int] | None = None,
        placement: Placement | None = None,
        **kwargs: Any,
    ) -> None:
        # kv_scale_set / skip_set / placement: already loaded / resolved / parsed by run_eval (kvcal.evaluate.spec),
        # so nothing is read twice; lm-eval's command line passes the strings instead
        placement = placement or Placement.parse(device_map, max_memory, offload_folder)
        if isinstance(pretrained, (str, os.PathLike)):
            # real-model names and .gguf files become a local safetensors folder (kvcal.models)
            trust = _as_bool(kwargs.get("trust_remote_code", False))
            ref, model_dir = str(pretrained), models.resolve_model(pretrained, trust_remote_code=trust)
            pretrained = str(model_dir)
            if placement.active:  # accelerate's dispatch: kvcal loads, HFLM takes the placed model
                placed = models.load_model(
                    model_dir,
                    dtype=str(kwargs.pop("dtype", "auto")),
                    trust_remote_code=trust,
                    placement=placement,
                )
                pretrained, kwargs["tokenizer"] = placed.model, placed.tokenizer
                kwargs.pop("device", None)
        else:  # an already-built transformers model
            ref, model_dir = (
                str(model_ref or getattr(pretrained, "name_or_path", "model")),
                Path(getattr(pretrained, "name_or_path", ".")),
            )
        super().__init__(pretrained=pretrained, **kwargs)
        if placement.active:  # inputs go where the embedding is (HFLM took the first parameter's device)
            self._device = models.input_device(self.model)
        # Data parallel under torchrun / accelerate launch: lm-eval splits requests by lm.rank / lm.world_size
        # (Task.doc_iterator) and gathers them on rank 0 (evaluator.evaluate), but HFLM 0.4.13 reports them only
        # with several GPUs; kvcal reports them whatever the device (gloo on CPU). tp_plan: one model, no split.
        self._kvcal_dist = parallel.from_env() if kwargs.get("tp_plan") is None else parallel.Dist()
        self._kvcal_tp = parallel.from_env() if kwargs.get("tp_plan") is not None else parallel.Dist()
        if self._kvcal_dist.active:
            self._rank, self._world_size = self._kvcal_dist.rank, self._kvcal_dist.world_size
        self.model_ref = str(model_ref or ref)
        self.model_dir = model_dir
        self.kv_format = parse_kv_format(kv_format)
        self.impl = str(impl or "auto")
        self.scales_path = str(kv_scales) if kv_scales not in (None, "", "none", "None") else None
        # kv_scales=first-batch: vLLM's calculate_kv_scales (kvcal.kernels.cache.FirstBatchScales), not a file
        self.first_batch = self.scales_path == FIRST_BATCH
        if self.first_batch:
            self.scales_path = None
        self.kv_input_dtype = None if kv_input_dtype in (None, "", "none", "None") else str(kv_input_dtype)
        self.skip_spec = str(skip_layers) if skip_layers not in (None, "", "none", "None") else ""
        self.force_scales = _as_bool(force_scales)
        self.nvfp4_global = str(nvfp4_global)
        self.attention = str(attention or "kv")  # "fp8": vLLM's FA3 FP8 attention (kvcal.kernels.attention)
        self.scale_set: Any = None
        self.skip_layers: frozenset[int] = frozenset()
        self.runtime: Any = None
        if self.kv_format == "auto":
            if self.scales_path or self.skip_spec:
                raise UsageError(
                    "--scales / --skip-layers need a quantized --kv-format (auto leaves the cache untouched)"
                )
            return
        self.runtime, self.scale_set, self.skip_layers = build_runtime(
            self.model,
            model_ref=self.model_ref,
            model_dir=self.model_dir,
            kv_format=self.kv_format,
            scales_path=self.scales_path,
            skip_spec=self.skip_spec,
            impl=self.impl,
            force_scales=self.force_scales,
            nvfp4_global=self.nvfp4_global,
            kv_input_dtype=self.kv_input_dtype,
            first_batch=self.first_batch,
            attention=self.attention,
            scale_set=kv_scale_set,
            skip=skip_set,
        )
        shard_runtime_by_head(self.runtime, self.model, self._kvcal_tp)

    # ---- lm-eval's collectives over torch.distributed (HFLM's go through accelerate, GPU runs only) --------

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        if not self._kvcal_dist.active:
            return super().all_gather(tensor)
        return parallel.all_gather_tensor(tensor, self._kvcal_dist)

    def gather_object(self, obj: Any, dst: int = 0) -> list[Any] | None:
        if not self._kvcal_dist.active:
            return super().gather_object(obj, dst=dst)
        if dst != 0:
            raise ValueError("kvcal gathers on rank 0 only")
        return parallel.gather_objects(obj, self._kvcal_dist, what="gathering lm-eval's samples")

    def barrier(self) -> None:
        if not self._kvcal_dist.active:
            return super().barrier()
        parallel.barrier(self._kvcal_dist)

    # ---- the two places HFLM calls the model -------------------------------------------------------------

    def _model_call(
        self, inps: torch.Tensor, attn_mask: torch.Tensor | None = None, labels: torch.Tensor | None = None
    ) -> torch.Tensor:
        if self.runtime is None or attn_mask is not None or labels is not None:
            return super()._model_call(inps, attn_mask=attn_mask, labels=labels)
        # inps: [B, T] right-padded (HFLM); the mask tells the cache which positions are padding (not stored)
        mask = _right_padding_mask(inps, getattr(self, "_row_lengths", None))
        self._row_lengths = None
        with (
            torch.no_grad(),
            torch.autocast(
                device_type=self.device.type,
                dtype=self.mixed_precision_dtype,
                enabled=self.mixed_precision_dtype is not None,
            ),
        ):
            out = self.model(
                inps, attention_mask=mask, past_key_values=self.runtime.new_cache(), use_cache=True
            )
        return out.logits  # [B, T, V]

    def _loglikelihood_tokens(self, *args: Any, **kwargs: Any) -> Any:
        with _recording_row_lengths(self):
            return super()._loglikelihood_tokens(*args, **kwargs)

    def _model_generate(
        self, context: torch.Tensor, max_length: int, stop: list[str], **generation_kwargs: Any
    ):
        if self.runtime is not None:
            # context: [B, T] left-padded; generate keeps the attention mask, the cache holds quantized K/V.
            generation_kwargs["past_key_values"] = self.runtime.new_cache()
        with generate_call(self.forward_timer, int(context.shape[0])):
            return super()._model_generate(context, max_length, stop, **generation_kwargs)

    def activate_runtime(self) -> None:
        """(Re)install this LM's KV configuration on its model. A model carries one KVRuntime at a time, so
        anything that installs another one (the kl task's BF16 baseline) calls this afterwards."""
        from kvcal.kernels.runtime import KVRuntime

        rt = KVRuntime(
            self.model,
            self.kv_format,
            scales=self.scale_set,
            skip_layers=self.skip_layers,
            impl=self.impl,
            nvfp4_global=self.nvfp4_global,
            kv_input_dtype=self.kv_input_dtype,
            # the scales the first batch fixed stay fixed (vLLM keeps them for the server's lifetime)
            first_batch=getattr(self.runtime, "first_batch", None) or self.first_batch,
            attention=self.attention,
        )
        shard_runtime_by_head(rt, self.model, self._kvcal_tp)
        self.runtime = None if self.kv_format == "auto" else rt

    def kvcal_describe(self) -> dict[str, Any]:
        info: dict[str, Any] = {
            "model_ref": self.model_ref,
            "model_dir": str(self.model_dir),
            "kv_format": self.kv_format,
            "scales": self.scales_path,
            "skip_layers": sorted(self.skip_layers),
            "impl": self.impl,
        }
        if self.runtime is not None:
            info["runtime"] = self.runtime.describe()
        return info


@contextmanager
def _recording_row_lengths(lm: Any) -> Iterator[None]:
    """HFLM._loglikelihood_tokens right-pads each batch (lm_eval.models.huggingface.pad_and_concat) and calls
    `_model_call(batch)` without a mask; record the rows' real lengths on `lm` for that call (padding must not be
    stored: a sample's cache must not depend on its batch). Restores lm-eval's function afterwards."""
    import lm_eval.models.huggingface as hf

    original = hf.pad_and_concat

    def recording(max_length: int, tensors: list[torch.Tensor], padding_side: str = "right") -> torch.Tensor:
        if padding_side == "right":
            lm._row_lengths = [int(t.shape[-1]) for t in tensors]
        return original(max_length, tensors, padding_side=padding_side)

    hf.pad_and_concat = recording
    try:
        yield
    finally:
        hf.pad_and_concat = original


def _right_padding_mask(inps: torch.Tensor, lengths: list[int] | None) -> torch.Tensor | None:
    """[B, T] attention mask (1 = real) of a right-padded batch with these row lengths; None = no padding known."""
    if lengths is None or len(lengths) != inps.shape[0] or max(lengths) > inps.shape[1]:
        return None
    n = torch.tensor(lengths, device=inps.device)
    return (torch.arange(inps.shape[1], device=inps.device)[None, :] < n[:, None]).long()


def shard_runtime_by_head(runtime: Any, model: Any, tp: parallel.Dist) -> None:
    """Tensor parallel (`tp_plan`, under torchrun): transformers splits k_proj / v_proj column-wise, so rank r's
    attention writes only KV heads `parallel.heads_of_rank(H_kv, r, N)` to its cache, [B, H_kv / N, T, D]; its
    cache then holds those heads' codes and scales (per-head scales sliced, per-tensor ones shared). Checked on CPU
    with gloo: 2 ranks give 1 rank's logits to float rounding (docs/scaling-out.md)."""
    if runtime is None or not tp.active:
        return
    import dataclasses

    from kvcal.kernels.runtime import install_plans

    kv = models.kv_spec(model.config)

    def cut(scale: Any, heads: int) -> Any:
        return None if scale is None else parallel.slice_heads(scale, heads, tp.rank, tp.world_size)

    runtime.plans = [
        dataclasses.replace(p, k_scale=cut(p.k_scale, layer.kv_heads), v_scale=cut(p.v_scale, layer.kv_heads))
        for p, layer in zip(runtime.plans, kv.layers, strict=True)
    ]
    install_plans(model, runtime.plans, runtime.impl, nonfinite=runtime.nonfinite)


def build_runtime(
    model: Any,
    *,
    model_ref: str,
    model_dir: Path,
    kv_format: str,
    scales_path: str | None,
    skip_spec: str,
    impl: str,
    force_scales: bool,
    nvfp4_global: str = "one",
    kv_input_dtype: str | None = None,
    first_batch: bool = False,
    attention: str = "kv",
    scale_set: Any = None,
    skip: frozenset[int] | None = None,
) -> tuple[Any, Any, frozenset[int]]:
    """(KVRuntime, ScaleSet | None, skipped layer indices) for `model`; the scale file is checked against the
    checkpoint (binding, format, layer count) by kvcal.scales. `scale_set` / `skip`: checked / resolved already
    (run_eval), not read again from `scales_path` / `skip_spec`."""
    from kvcal.kernels.runtime import KVRuntime

    kv = models.kv_spec(model.config)
    if skip is None:
        skip = models.parse_skip_layers(skip_spec, kv)
    if scale_set is None and scales_path:
        from kvcal.scales import load_scales_for_model  # refuses a missing file with one UsageError

        scale_set = load_scales_for_model(
            scales_path, model_ref, model_dir, kv, kv_format=kv_format, force=force_scales
        )
    runtime = KVRuntime(
        model,
        kv_format,
        scales=scale_set,
        skip_layers=skip,
        impl=impl,
        nvfp4_global=nvfp4_global,
        kv_input_dtype=kv_input_dtype,
        first_batch=first_batch,
        attention=attention,
    )
    return runtime, scale_set, skip


def lm_eval_main() -> None:
    """lm-eval's own command line with the `kvcal` model registered (lm-eval has no model plugin discovery):
    `python -m kvcal.evaluate.adapter --model kvcal --model_args pretrained=...,kv_format=fp8_e4m3 --tasks ...`
    behaves exactly like `lm_eval ...`."""
    from lm_eval.__main__ import cli_evaluate

    cli_evaluate()


if __name__ == "__main__":
    lm_eval_main()
