"""`KVRuntime`: put a model on a quantized KV cache (what evaluation runs through).

    rt = KVRuntime(model, "fp8_e4m3", scales=load_scale_file(path), skip_layers="sliding_window", impl="auto")
    out = model.generate(**inputs, past_key_values=rt.new_cache())   # or model(input_ids, past_key_values=...)
    rt.describe()  # format, per-layer formats, scale source, uncalibrated flag, impl

kv_format 'auto' leaves the model as loaded (transformers' own attention + DynamicCache): the parity reference.
Any other format switches the model's attention implementation to "kvcal" (`kvcal.kernels.attention`) and gives
each attention module its layer plan (format, window, static scales) and the implementation ('torch' | 'triton'),
and makes `generate()` without `past_key_values` use `new_cache()` (so lm-eval's generate_until decodes with it).
A forward pre-hook on the model hands each forward's 2-D attention mask to a kvcal cache passed as
`past_key_values` (`QuantizedKVCache.set_attention_mask`), so padding is never stored and no per-sequence scale
sees it. A model carries one runtime at a time: building a new one (including 'auto') replaces the previous one.

`nvfp4_global` (nvfp4 without a scale file, `kvcal.kernels.cache.NVFP4_GLOBALS`): "one" (default, vLLM's 1.0) or
"per_sequence". `kv_input_dtype` ("bfloat16" | "float16" | "float32"; None = as computed): K/V are rounded to it
before quantization, as the engine's serving dtype holds them. `first_batch` (True, or a `FirstBatchScales` to
share): vLLM's calculate_kv_scales, each layer's scales fixed by the first forward (`runtime.first_batch`). `take_nonfinite_kv()` returns (and resets) the NaN/Inf K/V counted since the last call.
"""

from __future__ import annotations

import dataclasses
import inspect
import types
from collections.abc import Iterable
from typing import Any

import torch
from transformers.cache_utils import Cache, DynamicCache

from kvcal import formats, parallel, serde
from kvcal.errors import UsageError
from kvcal.formats.geometry import check_sliding
from kvcal.kernels.attention import ATTN_NAME, ModuleConfig, register
from kvcal.kernels.cache import (
    NVFP4_GLOBALS,
    FirstBatchScales,
    LayerPlan,
    NonFiniteCount,
    QuantizedKVCache,
)
from kvcal.kernels.plan import IMPLS, CachePlan, parse_cache_plan
from kvcal.kernels.triton_env import interpreting, triton_available
from kvcal.models.geometry import KVSpec, kv_spec, parse_skip_layers
from kvcal.models.loading import input_device
from kvcal.scales import SAME_SCALES, query_scales

_ORIGINAL_ATTR = "_kvcal_original_attn_implementation"
_GEN_HOOK = "_prepare_cache_for_generation"  # instance attribute set by install_generate_cache
_MASK_HOOK = "_kvcal_mask_hook"  # handle of the forward pre-hook set by install_mask_hook


def resolve_impl(impl: str, device: torch.device) -> str:
    """'auto' -> 'triton' on CUDA (when Triton is installed), else 'torch'. 'triton' needs CUDA or TRITON_INTERPRET=1."""
    if impl not in IMPLS:
        raise UsageError(f"unknown attention implementation '{impl}'; use one of {', '.join(IMPLS)}")
    if impl == "auto":
        return "triton" if device.type == "cuda" and triton_available() else "torch"
    if impl == "triton":
        if not (torch.cuda.is_available() or interpreting()):
            raise UsageError(
                "--impl triton needs a CUDA GPU (or TRITON_INTERPRET=1 to run the kernels in Triton's CPU "
                "interpreter, slowly); use --impl torch or --impl auto on this machine"
            )
        if not triton_available():
            raise UsageError("--impl triton needs the triton package (Linux only); use --impl torch")
    return impl


def _model_device(model: torch.nn.Module) -> torch.device:
    if hasattr(model, "get_input_embeddings"):  # under a device map: where inputs go (kvcal.models.loading.input_device)
        return input_device(model)
    for p in model.parameters():
        return p.device
    return torch.device("cpu")


def attention_modules(model: torch.nn.Module) -> dict[int, torch.nn.Module]:
    """The self-attention module of each decoder layer, by layer index."""
    found: dict[int, torch.nn.Module] = {}
    for name, mod in model.named_modules():
        idx = getattr(mod, "layer_idx", None)
        if isinstance(idx, int) and type(mod).__name__.endswith("Attention") and "cross" not in name.lower():
            found.setdefault(idx, mod)
    return found


def check_architecture(model: torch.nn.Module, kv: KVSpec) -> dict[int, torch.nn.Module]:
    """UsageError naming the model type unless its attention goes through transformers' AttentionInterface with
    a per-layer K/V cache that kvcal can hold."""
    model_type = kv.model_type
    config = model.config
    if getattr(config, "is_encoder_decoder", False) or not model.can_generate():
        raise UsageError(
            f"model type '{model_type}' is not a decoder-only generative model with a KV cache; kvcal supports "
            "Llama, Qwen2, Mistral, Gemma 2/3, gpt-oss and similar causal LMs"
        )
    if not getattr(type(model), "_supports_attention_backend", False):
        raise UsageError(
            f"model type '{model_type}' does not route attention through transformers' AttentionInterface, so "
            "kvcal cannot read its cache; kvcal supports Llama, Qwen2, Mistral, Gemma 2/3, gpt-oss and similar"
        )
    mods = attention_modules(model)
    if sorted(mods) != list(range(kv.num_layers)):
        raise UsageError(
            f"model type '{model_type}': found attention modules for layers {sorted(mods)[:8]}... but the config "
            f"has {kv.num_layers} layers; kvcal cannot map its KV cache"
        )
    return mods


def _checked_skip_set(skip_layers: Iterable[int] | None, kv: KVSpec) -> frozenset[int]:
    """Layer indices as a set; UsageError for one the model does not have."""
    chosen = frozenset(int(i) for i in skip_layers or ())
    bad = sorted(i for i in chosen if not 0 <= i < kv.num_layers)
    if bad:
        raise UsageError(
            f"skip-layer index {bad[0]} is out of range: the model has layers 0..{kv.num_layers - 1}"
        )
    return chosen


def _first_batch_store(
    first_batch: bool | FirstBatchScales, fmt: formats.KVFormat, scales: Any
) -> FirstBatchScales | None:
    """The runtime's first-batch store (None: static scales or formats' defaults); UsageError where the format
    takes no static scale or a scale file is given too."""
    if first_batch is False or first_batch is None:
        return None
    if not fmt.calibratable:
        raise UsageError(
            f"--scales first-batch (vLLM's calculate_kv_scales) sets a static scale, but {fmt.name} computes its "
            "scales at write time; use it with fp8_e4m3, fp8_e5m2, nvfp4 or nvfp4_4over6"
        )
    if not fmt.codec.first_batch:
        raise UsageError(
            "--scales first-batch is vLLM's calculate_kv_scales (FP8 / NVFP4); TensorRT-LLM's INT8 cache "
            "(int8_per_tensor) takes a calibrated scale: kvcal calibrate MODEL -f int8_per_tensor -o S, then --scales S"
        )
    if scales is not None:
        raise UsageError("first-batch scales replace a scale file; pass one or the other")
    return first_batch if isinstance(first_batch, FirstBatchScales) else FirstBatchScales()


def _as_scale(s: Any) -> torch.Tensor:
    return torch.as_tensor(s, dtype=torch.float32)


def check_block_fits(fmt: formats.KVFormat, kv: KVSpec) -> None:
    """UsageError unless `fmt`'s geometry rule holds for every layer's head_dim (`formats.check_head_dims`)."""
    formats.check_head_dims(fmt, [layer.head_dim for layer in kv.layers])


def _check_scales(
    scales: Any, fmt: formats.KVFormat, kv: KVSpec, v_fmt: formats.KVFormat | None = None
) -> None:
    v_fmt = fmt if v_fmt is None else v_fmt
    for f in {fmt.name: fmt, v_fmt.name: v_fmt}.values():
        if not f.calibratable:
            raise UsageError(
                f"format {f.name} takes no static scales (its scales are computed at write time); "
                "drop --scales or use fp8_e4m3, fp8_e5m2, int8_per_tensor or nvfp4"
            )
    name = fmt.name if v_fmt is fmt else f"k={fmt.name},v={v_fmt.name}"
    # a ScaleSet's format is canonical (kvcal.scales.load_scale_file); fp8_e4m3_cpu reads fp8_e4m3's scales
    if scales.kv_format != name and SAME_SCALES.get(name) != scales.kv_format:
        raise UsageError(
            f"the scale file was calibrated for {scales.kv_format}, not {name}; "
            f"calibrate for {name} or pass --kv-format {scales.kv_format}"
        )
    for name, lst in (("k", scales.k_scales), ("v", scales.v_scales)):
        if len(lst) != kv.num_layers:
            raise UsageError(
                f"the scale file has {len(lst)} layers of {name}_scale but the model has {kv.num_layers}; "
                "it belongs to another model — recalibrate for this one"
            )
        for layer, s in zip(kv.layers, lst, strict=True):
            n = int(torch.as_tensor(s).numel())
            if n not in (1, layer.kv_heads):
                raise UsageError(
                    f"layer {layer.index} {name}_scale has {n} values but the model has {layer.kv_heads} KV heads "
                    "(per-tensor scales have 1); it belongs to another model — recalibrate for this one"
                )


def install_plans(
    model: torch.nn.Module,
    plans: list[LayerPlan],
    impl: str,
    mods: dict[int, torch.nn.Module] | None = None,
    nonfinite: NonFiniteCount | None = None,
) -> None:
    """Switch the model to kvcal attention with these per-layer plans (KVRuntime's last step; tests use it
    directly, e.g. with format 'auto' plans to check the machinery against transformers exactly)."""
    register()
    mods = attention_modules(model) if mods is None else mods
    if not hasattr(model, _ORIGINAL_ATTR):
        setattr(model, _ORIGINAL_ATTR, model.config._attn_implementation)
    if model.config._attn_implementation != ATTN_NAME:
        model.set_attn_implementation(ATTN_NAME)
    if model.config._attn_implementation != ATTN_NAME:
        raise UsageError(
            f"model type '{model.config.model_type}' refused the kvcal attention implementation; kvcal cannot "
            "read its cache"
        )
    for idx, mod in mods.items():
        mod.kvcal_config = ModuleConfig(plan=plans[idx], impl=impl, nonfinite=nonfinite)
    install_mask_hook(model)


def install_mask_hook(model: torch.nn.Module) -> None:
    """Before every forward of `model`, give a kvcal cache passed as `past_key_values` the forward's attention
    mask (so its writes know which positions are padding). Replaces a previous runtime's hook."""
    remove_mask_hook(model)
    names = list(inspect.signature(model.forward).parameters)

    def _hand_over_mask(_module: Any, args: tuple, kwargs: dict) -> None:
        given = {**dict(zip(names, args, strict=False)), **kwargs}
        cache = given.get("past_key_values")
        if isinstance(cache, QuantizedKVCache):
            cache.set_attention_mask(given.get("attention_mask"))

    setattr(model, _MASK_HOOK, model.register_forward_pre_hook(_hand_over_mask, with_kwargs=True))


def remove_mask_hook(model: torch.nn.Module) -> None:
    handle = vars(model).pop(_MASK_HOOK, None)
    if handle is not None:
        handle.remove()


def install_generate_cache(model: torch.nn.Module, new_cache: Any) -> None:
    """Make `model.generate()` called WITHOUT `past_key_values` (lm-eval's generate_until does that) decode with a
    fresh kvcal cache instead of transformers' DynamicCache, so every step appends codes exactly as with
    `past_key_values=runtime.new_cache()`. Done by wrapping transformers' `_prepare_cache_for_generation` on this
    model instance only; a cache passed by the caller is left alone."""
    original = type(model)._prepare_cache_for_generation

    def _prepare(self: Any, generation_config: Any, model_kwargs: dict, *args: Any, **kwargs: Any) -> Any:
        user_cache = model_kwargs.get("past_key_values") is not None
        result = original(self, generation_config, model_kwargs, *args, **kwargs)
        if not user_cache and type(model_kwargs.get("past_key_values")) is DynamicCache:
            model_kwargs["past_key_values"] = new_cache()
        return result

    setattr(model, _GEN_HOOK, types.MethodType(_prepare, model))


def _plan_field(name: str) -> Any:
    """A KVRuntime property reading its plan's `name` (the runtime keeps no copy of an option)."""
    return property(lambda self: getattr(self.plan, name), doc=f"the plan's {name}")


class KVRuntime:
    """The quantized-KV configuration of one model (see the module docstring)."""

    def __init__(
        self,
        model: torch.nn.Module,
        kv_format: str | formats.KVFormat,
        scales: Any = None,  # kvcal.scales.ScaleSet | None
        skip_layers: str | Iterable[int] | None = frozenset(),
        impl: str = "auto",
        nvfp4_global: str = "one",
        kv_input_dtype: str | None = None,  # --kv-input-dtype; None = K/V quantized as computed
        first_batch: bool | FirstBatchScales = False,  # vLLM's calculate_kv_scales; a store to share
        attention: str = "kv",  # kvcal.kernels.attention.ATTENTION_MODES: "fp8" = vLLM's FA3 FP8 attention
        prefix_serde: str | None = None,  # LMCache's storage tier (kvcal.serde), with prefix_tokens
        prefix_tokens: int | None = None,
    ):
        """The keyword form (Python's edge: scripts, tests, bench): the option strings parsed once by
        kvcal.kernels.plan.parse_cache_plan, `skip_layers` text by models.parse_skip_layers; then as
        `from_plan`. kvcal's own runs build a CachePlan above and call `from_plan`."""
        kv = kv_spec(model.config)
        plan = dataclasses.replace(
            parse_cache_plan(
                kv_format,
                kv_input_dtype=kv_input_dtype,
                attention=attention,
                nvfp4_global=nvfp4_global,
                impl=impl,
                prefix_serde=prefix_serde,
                prefix_tokens=prefix_tokens,
            ),
            scales=scales,
            first_batch=first_batch,
            skip_layers=parse_skip_layers(skip_layers, kv) if isinstance(skip_layers, str) else skip_layers,
        )
        self._setup(model, plan, kv)

    @classmethod
    def from_plan(cls, model: torch.nn.Module, plan: CachePlan) -> KVRuntime:
        """Install `plan` (every value parsed already) on `model`."""
        runtime = cls.__new__(cls)
        runtime._setup(model, plan, kv_spec(model.config))
        return runtime

    # the plan's options, read from it (not copied: one source of truth). fmt: K's format (and V's unless the plan
    # is a pair `k=...,v=...`); requested_impl: the plan's impl before it is resolved against the device
    fmt = _plan_field("k_fmt")
    v_fmt = _plan_field("v_fmt")
    kv_format = _plan_field("kv_format")
    attention = _plan_field("attention")
    kv_input_dtype = _plan_field("kv_input_dtype")
    scales = _plan_field("scales")
    nvfp4_global = _plan_field("nvfp4_global")
    requested_impl = _plan_field("impl")

    def _setup(self, model: torch.nn.Module, plan: CachePlan, kv: KVSpec) -> None:
        self.model = model
        self.plan = plan  # every option is read from it (the properties below); installing it fixes two more:
        scales = plan.scales
        self.first_batch = _first_batch_store(plan.first_batch, self.fmt, scales)  # the store, or None
        self.kv = kv
        self.nonfinite = NonFiniteCount(self.kv.num_layers)
        self.skip_layers = _checked_skip_set(plan.skip_layers, self.kv)  # checked against the model's layers
        impl = plan.impl
        if self.fmt.name == "auto":
            if scales is not None:
                raise UsageError(
                    "kv format 'auto' stores the model's own K/V and takes no scales; drop --scales"
                )
            self.impl = "transformers"
            self.plans: list[LayerPlan] = []
            self._uninstall()
            return
        mods = check_architecture(model, self.kv)
        sliding = [x.index for x in self.kv.layers if x.window and x.index not in self.skip_layers]
        check_sliding((self.fmt, self.v_fmt), sliding)  # the plan's rows: nothing parsed here
        serde.check_serde_geometry(plan.prefix_serde, {x.index: x.head_dim for x in self.kv.layers})
        check_block_fits(self.fmt, self.kv)
        check_block_fits(self.v_fmt, self.kv)
        if scales is not None:
            _check_scales(scales, self.fmt, self.kv, v_fmt=self.v_fmt)
        self.q_scales = query_scales(self.attention, scales, self.kv.num_layers)
        self.impl = resolve_impl(impl, _model_device(model))
        self.plans = self._layer_plans()
        self._install(mods)

    def _layer_plans(self) -> list[LayerPlan]:
        bf16 = formats.get_format("bf16")
        plans = []
        for layer in self.kv.layers:
            skipped = layer.index in self.skip_layers
            use_scales = self.scales is not None and not skipped
            plans.append(
                LayerPlan(
                    index=layer.index,
                    fmt=bf16 if skipped else self.fmt,
                    window=layer.window,
                    k_scale=_as_scale(self.scales.k_scales[layer.index]) if use_scales else None,
                    v_scale=_as_scale(self.scales.v_scales[layer.index]) if use_scales else None,
                    skipped=skipped,
                    nvfp4_global=self.nvfp4_global,
                    kv_input_dtype=None
                    if self.kv_input_dtype is None
                    else formats.KV_INPUT_DTYPES[self.kv_input_dtype],
                    first_batch=None if skipped else self.first_batch,
                    v_fmt=None if skipped or self.v_fmt is self.fmt else self.v_fmt,
                    q_scale=None if skipped or self.q_scales is None else self.q_scales[layer.index],
                    # LMCache's storage tier stores every layer, whatever the live cache keeps in BF16 (a TurboQuant
                    # serde's first and last 2 raw: no round trip there)
                    prefix_serde=serde.serde_for_layer(self.plan.prefix_serde, layer.index, self.kv.num_layers),
                    prefix_tokens=self.plan.prefix_tokens,
                )
            )
        return plans

    # -- installation -------------------------------------------------------------------------------------

    def _install(self, mods: dict[int, torch.nn.Module]) -> None:
        install_plans(self.model, self.plans, self.impl, mods, nonfinite=self.nonfinite)
        install_generate_cache(self.model, self.new_cache)

    def _uninstall(self) -> None:
        """Put a model a previous runtime changed back to its own attention implementation."""
        model = self.model
        original = getattr(model, _ORIGINAL_ATTR, None)
        if original is None:
            return
        model.set_attn_implementation(original)
        if _GEN_HOOK in vars(model):
            delattr(model, _GEN_HOOK)
        remove_mask_hook(model)
        for mod in attention_modules(model).values():
            if hasattr(mod, "kvcal_config"):
                del mod.kvcal_config
        delattr(model, _ORIGINAL_ATTR)

    # -- API ----------------------------------------------------------------------------------------------

    def new_cache(self, workspace: bool = True) -> Cache:
        """A fresh cache to pass as `past_key_values` to one forward or one generate() call. `workspace=False`: its
        reads keep no float32 values for later reads (kvcal.kernels.cache.QuantizedLayer)."""
        if self.fmt.name == "auto":
            return DynamicCache(config=self.model.config)
        return QuantizedKVCache(self.plans, self.nonfinite, workspace)

    def take_nonfinite_kv(self) -> dict[str, Any]:
        """NaN/Inf elements among the real K/V tokens written since the last call: {'per_layer': [{'layer', 'k',
        'v'}] (layers with any), 'total'}; then the count restarts. Format 'auto' counts nothing (total 0)."""
        return self.nonfinite.take()

    @property
    def uncalibrated(self) -> bool:
        """FP8 / NVFP4 without a scale file (FP8 at scale 1.0, NVFP4 with a dynamic global)."""
        calibratable = self.fmt.calibratable or self.v_fmt.calibratable  # either side of a K/V pair
        return calibratable and self.scales is None and self.first_batch is None

    def scale_source(self) -> str:
        if self.fmt.name in ("auto", "bf16"):
            return "none"
        if self.scales is not None:
            return f"scale file ({getattr(self.scales, 'granularity', 'tensor')})"
        if self.first_batch is not None:
            return "first-batch (vLLM calculate_kv_scales: amax / 200 for K, / 100 for V, fixed after the first write)"
        if self.fmt.codec.static_scale:
            return "uncalibrated (scale 1.0)"
        if self.fmt.codec.global_scale:
            return f"uncalibrated (global scale {NVFP4_GLOBALS[self.nvfp4_global]})"
        return "dynamic (computed at write time)"

    def describe(self) -> dict[str, Any]:
        layers = []
        for layer in self.kv.layers:
            plan = self.plans[layer.index] if self.plans else None
            layers.append(
                {
                    "layer": layer.index,
                    "type": layer.type,
                    "window": layer.window,
                    "format": (
                        formats.pair_name(plan.fmt, plan.side_format("v"))
                    )
                    if plan
                    else "auto",
                    "skipped": bool(plan and plan.skipped),
                }
            )
        return {
            "kv_format": self.kv_format,
            "attention": self.attention,
            "q_scales": getattr(self, "q_scales", None),
            "model_type": self.kv.model_type,
            "impl": self.impl,
            "requested_impl": self.requested_impl,
            "attn_implementation": self.model.config._attn_implementation,
            "scale_source": self.scale_source(),
            "uncalibrated": self.uncalibrated,
            "granularity": getattr(self.scales, "granularity", None),
            "nvfp4_global": self.nvfp4_global
            if self.fmt.codec.global_scale and self.scales is None and self.first_batch is None
            else None,
            "kv_input_dtype": self.kv_input_dtype,
            "first_batch_scales": None if self.first_batch is None else self.first_batch.as_lists(),
            "skip_layers": sorted(self.skip_layers),
            "layer_formats": [entry["format"] for entry in layers],
            "layers": layers,
        }


def shard_by_head(runtime: KVRuntime | None, tp: parallel.Dist) -> None:
    """Tensor parallel (`tp_plan`, under torchrun): transformers splits k_proj / v_proj column-wise, so rank r's
    attention writes only KV heads `parallel.heads_of_rank(H_kv, r, N)` to its cache, [B, H_kv / N, T, D]; its
    cache then holds those heads' codes and scales (per-head scales sliced, per-tensor ones shared). Checked on CPU
    with gloo: 2 ranks give 1 rank's logits to float rounding (docs/scaling-out.md)."""
    if runtime is None or not tp.active:
        return
    kv = runtime.kv

    def cut(scale: Any, heads: int) -> Any:
        return None if scale is None else parallel.slice_heads(scale, heads, tp.rank, tp.world_size)

    runtime.plans = [
        dataclasses.replace(p, k_scale=cut(p.k_scale, layer.kv_heads), v_scale=cut(p.v_scale, layer.kv_heads))
        for p, layer in zip(runtime.plans, kv.layers, strict=True)
    ]
    install_plans(runtime.model, runtime.plans, runtime.impl, nonfinite=runtime.nonfinite)
