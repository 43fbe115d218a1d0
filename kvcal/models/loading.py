"""Loading a causal LM and its tokenizer for inference: the --dtype and --device rules, accelerate placement, and
where inputs go under a device map."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvcal.errors import UsageError
from kvcal.models.config import folder_config
from kvcal.models.resolve import resolve_model
from kvcal.placement import Placement, check_memory_fits


@dataclass
class LoadedModel:
    """A model ready for inference (eval mode) with its tokenizer; `ref` is what the user passed."""

    model: Any
    tokenizer: Any
    model_dir: Path
    ref: str

    @property
    def config(self) -> Any:
        return self.model.config


# --dtype values: 'auto' is the checkpoint's own dtype (lm-eval's HFLM default), the others force one.
DTYPES = ("auto", "float32", "bfloat16", "float16")
_TORCH_DTYPES = {"float32", "bfloat16", "float16"}
_DTYPE_ALIASES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
_SAFETENSORS_FLOATS = {"F32": "float32", "BF16": "bfloat16", "F16": "float16", "F64": "float64"}


def resolve_dtype(dtype: str, model_dir: str | os.PathLike[str], hf_config: Any = None) -> str:
    """The dtype a load of `model_dir` uses for `dtype`: float32 / bfloat16 / float16 as given; 'auto' -> the
    checkpoint's own, by transformers' rule for dtype='auto' (what lm-eval's HFLM passes by default): config.json's
    dtype (`hf_config`, the folder's loaded config: kvcal.models.config.load_config), else the first floating
    tensor of its .safetensors files, else float32. Reads no weights."""
    name = _DTYPE_ALIASES.get(str(dtype), str(dtype))
    if name != "auto":
        if name not in _TORCH_DTYPES:
            raise UsageError(f"unknown dtype '{dtype}'; use {', '.join(DTYPES)}")
        return name
    if hf_config is None:
        raise ValueError("resolve_dtype('auto') needs the checkpoint's config (hf_config)")
    raw = getattr(hf_config, "dtype", None)
    found = str(raw).replace("torch.", "") if raw is not None else _safetensors_float_dtype(Path(model_dir))
    found = found or "float32"
    if found not in _TORCH_DTYPES:
        raise UsageError(
            f"the checkpoint '{model_dir}' is stored in {found}; pass --dtype float32, bfloat16 or float16"
        )
    return found


def _safetensors_float_dtype(folder: Path) -> str | None:
    """dtype of the first floating tensor listed in the folder's .safetensors headers (no tensor data read)."""
    import json

    for path in sorted(folder.glob("*.safetensors")):
        try:
            with open(path, "rb") as fh:
                size = int.from_bytes(fh.read(8), "little")
                header = json.loads(fh.read(size))
        except (OSError, ValueError):
            continue
        for key, entry in header.items():
            if (
                key != "__metadata__"
                and isinstance(entry, dict)
                and entry.get("dtype") in _SAFETENSORS_FLOATS
            ):
                return _SAFETENSORS_FLOATS[entry["dtype"]]
    return None


def _torch_dtype(dtype: str) -> Any:
    import torch

    name = _DTYPE_ALIASES.get(dtype, dtype)
    if name not in _TORCH_DTYPES:
        raise UsageError(f"unknown dtype '{dtype}'; use float32, bfloat16 or float16")
    return getattr(torch, name)


def check_device(device: str) -> str:
    """The torch device for a --device value, after checking that this machine has it: cpu, cuda, cuda:N (N below
    the GPU count) or mps. UsageError naming what the machine has otherwise, before anything loads."""
    import re

    import torch

    name = str(device).strip().lower()
    if name == "cpu":
        return name
    cuda = re.fullmatch(r"cuda(?::(\d+))?", name)
    if cuda:
        if not torch.cuda.is_available():
            built = "" if torch.version.cuda else " (this torch is built without CUDA)"
            raise UsageError(
                f"--device {device}: this machine has no usable CUDA GPU{built}; use --device cpu"
            )
        count = torch.cuda.device_count()
        if cuda.group(1) is not None and int(cuda.group(1)) >= count:
            raise UsageError(
                f"--device {device}: this machine has {count} CUDA GPU(s), cuda:0 to cuda:{count - 1}"
            )
        return name
    if name in ("mps", "mps:0"):
        if not torch.backends.mps.is_available():
            raise UsageError(
                f"--device {device}: Apple's Metal backend is not available here; use --device cpu"
            )
        return "mps"
    raise UsageError(f"unknown --device '{device}'; use cpu, cuda, cuda:N or mps")


def load_model(
    model: str | os.PathLike[str],
    dtype: str = "float32",
    device: str = "cpu",
    attn_implementation: str | None = None,
    trust_remote_code: bool = False,
    placement: Placement | None = None,
) -> LoadedModel:
    """Load a causal LM and its tokenizer from a local folder, hub id or .gguf, in eval mode on `device`
    (`dtype` 'auto': the checkpoint's own, see resolve_dtype). `placement` with a device map: accelerate's
    dispatch (kvcal.placement) places the modules instead, and `device` is not used."""
    device = check_device(device)
    model_dir = resolve_model(model, trust_remote_code=trust_remote_code)
    hf_config = folder_config(model_dir, trust_remote_code, str(model))
    return load_resolved(
        model_dir,
        hf_config,
        dtype=dtype,
        device=device,
        attn_implementation=attn_implementation,
        trust_remote_code=trust_remote_code,
        placement=placement,
        ref=str(model),
    )


def loaded(
    model: str | os.PathLike[str] | LoadedModel,
    dtype: str = "float32",
    device: str = "cpu",
    placement: Placement | None = None,
) -> LoadedModel:
    """`model` as it is when a caller loaded it already (a sweep or a test reusing one model), else `load_model`."""
    if isinstance(model, LoadedModel):
        return model
    return load_model(model, dtype=dtype, device=device, placement=placement)


def load_resolved(
    model_dir: Path,
    hf_config: Any,
    *,
    dtype: str,
    device: str,
    attn_implementation: str | None = None,
    trust_remote_code: bool = False,
    placement: Placement | None = None,
    ref: str | None = None,
) -> LoadedModel:
    """`load_model` of a folder `resolve_model` returned, whose config is loaded already (`hf_config`); `device`
    checked (check_device)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch_dtype = _torch_dtype(resolve_dtype(dtype, model_dir, hf_config))
    ref = ref or str(model_dir)
    placement = placement or Placement()
    placement.check()
    kwargs: dict[str, Any] = {"dtype": torch_dtype, "trust_remote_code": trust_remote_code}
    if placement.active:
        check_memory_fits(placement, hf_config, torch_dtype, ref)
        kwargs.update(placement.from_pretrained_kwargs())
    if attn_implementation:
        kwargs["attn_implementation"] = attn_implementation
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(model_dir), trust_remote_code=trust_remote_code)
        lm = AutoModelForCausalLM.from_pretrained(str(model_dir), **kwargs)
    except (OSError, ValueError, KeyError) as exc:
        raise UsageError(
            f"cannot load '{ref}' as a causal language model: {str(exc).splitlines()[0] if str(exc) else exc!r}"
        ) from exc
    if not placement.active:
        lm.to(device)
    lm.eval()
    return LoadedModel(model=lm, tokenizer=tokenizer, model_dir=model_dir, ref=ref)


def input_device(model: Any) -> Any:
    """The torch device input ids go to: the input embedding's (under a device map the layers may sit elsewhere;
    accelerate's hooks move activations between them). An offloaded embedding ('meta') -> the map's first
    execution device."""
    import torch

    emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    param = next(emb.parameters()) if emb is not None else next(model.parameters())
    if param.device.type != "meta":
        return param.device
    for dev in (getattr(model, "hf_device_map", None) or {}).values():
        if dev not in ("cpu", "disk"):
            return torch.device(f"cuda:{dev}" if isinstance(dev, int) else dev)
    return torch.device("cpu")
