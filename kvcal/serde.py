"""LMCache's storage serdes: a second KV tier (a prefix stored on disk or a remote store and reloaded), separate from
the serving engine's live KV cache format.

LMCache (v1 distributed storage, `lmcache/v1/distributed/serde/`) can pass every KV object it writes to its L2
tier (local disk, a remote store) through a serde, and the reverse on load: the K/V a reloaded prefix puts back
into the engine's paged cache are `deserialize(serialize(K/V))`, which the engine then stores in its own live
format (`--kv-cache-dtype`). `kvcal eval --prefix-serde NAME --prefix-tokens N` emulates that: the K/V of each
sequence's first N tokens go through NAME's round trip (`round_trip`) before the live cache quantizes them.

What each serde computes, transcribed from LMCache/LMCache (read for their semantics, no code copied):

- `fp8` — `lmcache/v1/distributed/serde/fp8.py` @ 049f1036fb0748796ece99b3a5e0917e6a7b9414
  (Fp8QuantizationSerializer / Fp8QuantizationDeserializer; also registered by `factory.py` @
  0e1fe912ac2d7eb9be1c64e90de1e229afa142b8): serialize is a plain `tensor.to(torch.float8_e4m3fn)` (its default
  `fp8_dtype`), NO scale, 1 byte per element (`estimate_serialized_size` = numel); deserialize reinterprets the bytes
  as float8_e4m3fn and casts to the destination's dtype (the engine's KV dtype, bf16 for a bf16 model). So the round
  trip is torch's cast, whose rules are c10's `fp8e4m3fn_from_fp32_value` (torch/headeronly/util/Float8_e4m3fn.h in
  torch 2.13, the same C10_HOST_DEVICE code on CPU and CUDA): round to nearest even, subnormals down to 2**-9,
  |x| >= 480 and +-Inf SATURATE to +-448 (0x7e / 0xfe; 448 < |x| < 480 rounds to 448 anyway), NaN stays NaN,
  -0 stays -0. Earlier torch releases turned an overflow into NaN instead: kvcal uses the installed torch's own
  cast, as LMCache does, and tests/test_serde.py pins the rules above bit for bit (it fails on a torch whose cast
  differs). A bf16 value goes to float32 exactly first, so bf16 and float32 inputs of the same value agree.
- `aesgcm` — `lmcache/v1/distributed/serde/aesgcm.py` @ 292843fcb76af8552c4cc75058eb7670d5cbec69: AES-GCM
  encryption of the object's bytes (per-tenant key from HKDF of `cache_salt`); decryption restores them exactly.
  An identity round trip for accuracy; storage = the plaintext bytes + 29 bytes per stored object (1 version byte,
  12-byte IV, 16-byte tag).
- `asym_k16_v8` — `lmcache/v1/distributed/serde/asym_k16_v8.py` @ 06acc5e143fef37f391a1afc7b6dc8b004ec739b with
  `lmcache/v1/kv_codec/asym_k16_v8.py` (compute_v_scales / quantize_v_fp8 / dequantize_v_fp8): K kept in the
  model's dtype, V as e4m3 with a float32 scale amax / 448 (1.0 for an all-zero V) over the WHOLE V object by default
  (ScaleScope.PER_TENSOR), clamped to +-448 before the cast. Not emulated (`NOT_EMULATED`): the scale is the amax of
  an entire stored object, which holds every layer of a chunk of tokens, so layer 0's reloaded V depends on the V of
  later layers, which a forward writing one layer at a time has not computed (a per-layer scale would be another
  codec). Its storage bytes are reported by `kvcal capacity`.
- `turboquant_k8v4` / `turboquant_4bit_nc` / `turboquant_k3v4_nc` / `turboquant_3bit_nc` — the `turboquant`
  serde with that `preset` (`lmcache/v1/distributed/serde/turboquant/turboquant.py` @
  2375bc65df5d7a3c98faaea07a3c6efa901600ea, its kernels `turboquant/store_kernel.py` @
  1a7aa029f424d328012ce5f3df048ab8580096c8 and `turboquant/decode_kernel.py` @
  06597f1c5ecf6b6236e48bf6a0e5bb66e5befc8c). The store is vLLM's TurboQuant store ported (the same TQ_PRESETS,
  Lloyd-Max centroids and midpoints, binary-search bucketize, float16 norm; values min / max, scale floored at
  1e-8, codes trunc(+0.5), float16 scale and zero; FP8 keys cast saturating to e4m3 on Hopper): kvcal's
  `turboquant_*` transcription is reused, with ONE difference LMCache keeps and the vLLM releases dropped: MSE
  keys rotate by diag(s) H / sqrt(D), s = +-1 signs of the layer (`_make_tq_tensors_for_layer`:
  `_generate_wht_signs`, torch.randint(0, 2) from a CPU generator seeded 42 + 1337 x layer index;
  `lmcache_tq_signs`), where vLLM 0.32.0 / 0.33.0 rotate every layer by H / sqrt(D). The load is LMCache's
  own: `_tq_full_dequant_kv` writes K and V as float16 — keys float16(norm16 x corrected centroid) in the
  ROTATED basis (`formats.tq_mse_rotated`), FP8 keys exactly, values float16(code x scale16 + zero16) — then
  the host rotates keys back, `(k_fp16.float() @ PiT.T).to(float16)`, and casts K and V to the destination
  dtype: float16 roundings vLLM's own decode never makes, and for a bf16 engine a second rounding to bf16.
  kvcal rotates with `formats.tq_rotate` (float64 sums rounded once to float32; LMCache's cuBLAS GEMM rounds
  in its own order, to an ulp of float32 before the float16 rounding). Layers: the first and last 2
  (`skip_first_layers` / `skip_last_layers` = 2, `_layer_ranges`: quantized = [min(2, L), max(that, L - 2)),
  not capped at half as vLLM's boundary) are stored raw: an identity there (`serde_for_layer`). head_dim must
  be a power of two for every preset (`_build_hadamard_cpu`), at least 8 with 3-bit codes; LMCache's
  `head_dim` setting is taken to be the model's. Non-finite rows follow kvcal's TurboQuant policy (a row with
  NaN / Inf reads back NaN). On Ampere / Ada LMCache stores FP8 keys as float8e4b15 instead (not emulated:
  Hopper's e4m3 is).

Which tokens: each sequence's own first N tokens (token index < N counted over that sequence's real tokens: left
padding of a batched generation does not count), in every layer, whatever the live format or `--skip-layers` keep
(LMCache stores every layer of a chunk). For lm-eval requests that is each request's first N tokens (context and
continuation as one sequence), for kl each window's first N positions.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from kvcal import formats
from kvcal.errors import UsageError
from kvcal.formats import TQ_PRESETS, check_tq_head_dim, tq_slot_bytes

# LMCache turboquant.py `_make_tq_tensors_for_layer`: seed = 42 + layer_idx * _TQ_LAYER_SEED_STRIDE (1337)
LMCACHE_TQ_SEED, LMCACHE_TQ_LAYER_SEED_STRIDE = 42, 1337

LMCACHE_REPO = "LMCache/LMCache"


@dataclass(frozen=True)
class Serde:
    """One LMCache serde as kvcal knows it. `source`: the LMCache file and commit transcribed; `what`: what its round
    trip computes (one line, for docs and errors)."""

    name: str
    source: str
    what: str
    lossless: bool = False


SERDES: dict[str, Serde] = {
    "fp8": Serde(
        "fp8",
        "lmcache/v1/distributed/serde/fp8.py @ 049f1036fb0748796ece99b3a5e0917e6a7b9414",
        "plain cast to float8_e4m3fn and back, no scale (torch's cast: RNE, |x| >= 480 and Inf saturate to 448)",
    ),
    "aesgcm": Serde(
        "aesgcm",
        "lmcache/v1/distributed/serde/aesgcm.py @ 292843fcb76af8552c4cc75058eb7670d5cbec69",
        "AES-GCM encryption of the bytes: an exact round trip",
        lossless=True,
    ),
    "asym_k16_v8": Serde(
        "asym_k16_v8",
        "lmcache/v1/distributed/serde/asym_k16_v8.py @ 06acc5e143fef37f391a1afc7b6dc8b004ec739b",
        "K in the model's dtype, V e4m3 with one float32 scale amax/448 per stored object",
    ),
    **{
        p: Serde(
            p,
            "lmcache/v1/distributed/serde/turboquant/turboquant.py @ 2375bc65df5d7a3c98faaea07a3c6efa901600ea",
            f"LMCache's TurboQuant serde, preset {p}: vLLM's store, LMCache's float16 decode (first and last 2 layers "
            "raw)",
        )
        for p in TQ_PRESETS
    },
}

# serde -> why kvcal does not emulate its round trip (capacity still counts its bytes)
NOT_EMULATED: dict[str, str] = {
    "asym_k16_v8": (
        "its V scale is the amax of a whole stored object (ScaleScope.PER_TENSOR), and LMCache's objects hold every "
        "layer of a chunk of tokens (turboquant.py documents them as [2, num_layers, num_tokens, hidden]): the scale "
        "of layer 0's V depends on V of layers a forward has not computed yet when it writes layer 0"
    ),
}

# LMCache's TurboQuant serde keeps its first and last 2 layers raw (TurboQuantSerdeConfig.skip_first_layers /
# skip_last_layers defaults; `_layer_ranges`: quantized = [min(2, L), max(that, L - 2)), not capped at half)
TQ_SERDE_SKIP_FIRST = 2
TQ_SERDE_SKIP_LAST = 2
# aesgcm's frame per stored object: version byte + 96-bit IV + 128-bit GCM tag
AESGCM_FRAME_BYTES = 1 + 12 + 16


def serde_names() -> str:
    return ", ".join(SERDES)


def serde_key(name: str) -> str:
    """The canonical name of serde `name` (any case, spaces stripped); UsageError naming the known ones."""
    key = str(name).strip().lower()
    if key not in SERDES:
        raise UsageError(f"unknown --prefix-serde '{name}'; use one of {serde_names()}")
    return key


def check_prefix_serde(name: str | None, tokens: int | None) -> tuple[str | None, int]:
    """`--prefix-serde NAME --prefix-tokens N` checked together: (None, 0) when neither is given, else (canonical
    name, N). UsageError naming the problem and the fix otherwise (both or neither, N >= 1, a known serde kvcal
    emulates)."""
    if name is None and tokens is None:
        return None, 0
    if name is None:
        raise UsageError(
            f"--prefix-tokens {tokens} needs --prefix-serde NAME (the LMCache serde the prefix round-trips through: "
            f"{serde_names()})"
        )
    key = serde_key(name)
    if key in NOT_EMULATED:
        raise UsageError(
            f"--prefix-serde {key} is not emulated: {NOT_EMULATED[key]}; `kvcal capacity MODEL --prefix-serde {key}` "
            f"reports its storage bytes, and eval emulates {', '.join(n for n in SERDES if n not in NOT_EMULATED)}"
        )
    if tokens is None:
        raise UsageError(
            f"--prefix-serde {key} needs --prefix-tokens N (N >= 1): how many of each sequence's first tokens are "
            "reloaded from the storage tier"
        )
    if int(tokens) < 1:
        raise UsageError(f"--prefix-tokens must be at least 1 token, got {tokens}")
    return key, int(tokens)


def _fp8_round_trip(x: torch.Tensor) -> torch.Tensor:
    # Fp8QuantizationSerializer: src.to(float8_e4m3fn) (no scale); the deserializer casts the fp8 back to the
    # destination's dtype — x.dtype here, the K/V dtype the live cache receives. Every e4m3 value is exact in
    # bf16 / fp16 / fp32, so the cast back never rounds.
    return x.to(torch.float8_e4m3fn).to(x.dtype)


def tq_serde_layers(num_layers: int) -> range:
    """The layers LMCache's TurboQuant serde quantizes (`_layer_ranges`); the others it stores raw."""
    start = min(TQ_SERDE_SKIP_FIRST, num_layers)
    return range(start, max(start, num_layers - TQ_SERDE_SKIP_LAST))


def serde_for_layer(name: str | None, layer: int, num_layers: int) -> str | None:
    """The serde layer `layer` of `num_layers` round-trips through: `name`, or None where it stores the layer raw
    (a TurboQuant preset's first and last 2 layers) — an identity the cache need not run."""
    if name in TQ_PRESETS and layer not in tq_serde_layers(num_layers):
        return None
    return name


def check_serde_geometry(name: str | None, head_dims: dict[int, int]) -> None:
    """UsageError unless LMCache's serde `name` stores layers of these head_dims ({layer index: head_dim}): a
    TurboQuant preset needs a power-of-two head_dim (at least 8 with 3-bit codes) on the layers it quantizes."""
    if name not in TQ_PRESETS:
        return
    quantized = tq_serde_layers(len(head_dims))
    for layer, d in head_dims.items():
        if layer in quantized:
            _check_pow2(name, d)
            if d < 8 and 3 in (TQ_PRESETS[name][0].bits, TQ_PRESETS[name][1].bits):
                raise UsageError(f"LMCache's {name} serde packs 3-bit codes in groups of 8: head_dim must be >= 8, got {d}")


def lmcache_tq_signs(d: int, layer: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """LMCache's +-1 signs float32 [d] of layer `layer`'s MSE-key rotation (`_generate_wht_signs`): torch.randint(0,
    2) from a CPU generator seeded 42 + layer * 1337, times 2 minus 1."""
    gen = torch.Generator(device="cpu")
    gen.manual_seed(LMCACHE_TQ_SEED + layer * LMCACHE_TQ_LAYER_SEED_STRIDE)
    bits = torch.randint(0, 2, (d,), generator=gen, device="cpu")
    return (bits.float() * 2 - 1).to(device)


def _tq_round_trip(preset: str, x: torch.Tensor, side: str, layer: int) -> torch.Tensor:
    """LMCache's TurboQuant serde of one quantized layer's K (side 'k') or V ('v'), x [..., D] in the destination
    dtype: vLLM's store (kvcal's transcription), then _tq_full_dequant_kv's float16 outputs, the host's inverse
    rotation of keys rounded to float16 again, and the cast to x.dtype."""
    k_side, v_side = TQ_PRESETS[preset]
    f = k_side if side == "k" else v_side
    d = x.shape[-1]
    if formats.is_tq_mse(f):  # LMCache rotates MSE keys with its layer's signs
        check_tq_head_dim(f.name, d)
        signs = lmcache_tq_signs(d, layer, x.device)  # seed 42 + 1337 * layer (the absolute index)
        q = formats.tq_quantize_mse(formats.as_f32(x), f, signs)
        k_rot = formats.tq_mse_rotated(q, f, d).to(torch.float16)  # the kernel's K_out store
        # turboquant.py: torch.matmul(k_layer.to(float32), pi_t.T).to(k_out.dtype)
        y = formats.tq_rotate(k_rot.float(), signs, inverse=True).to(torch.float16)
    else:
        q = formats.quantize(x, f)
        # FP8 keys: e4m3 -> float32 -> float16, exact; values: code * scale16 + zero16 (one rounding) -> float16
        y = formats.dequantize(q, f).to(torch.float16)
    return y.to(x.dtype)  # dst_work[...].copy_(k_tensor.to(dst_work.dtype))


_ROUND_TRIPS: dict[str, Callable[[torch.Tensor, str, int], torch.Tensor]] = {
    "fp8": lambda x, side, layer: _fp8_round_trip(x),
    "aesgcm": lambda x, side, layer: x,  # decrypt(encrypt(bytes)) == bytes
    **{p: (lambda x, side, layer, p=p: _tq_round_trip(p, x, side, layer)) for p in TQ_PRESETS},
}


def round_trip(name: str, x: torch.Tensor, side: str = "k", layer: int = 0) -> torch.Tensor:
    """deserialize(serialize(x)) of serde `name` for the K (side 'k') or V ('v') x [..., D] of layer `layer`, in the
    dtype the engine holds them (the destination dtype of LMCache's deserializer): same shape and dtype. A
    TurboQuant preset's layer must be one it quantizes (`serde_for_layer`). KeyError for a serde kvcal does not
    emulate (check_prefix_serde refuses those first)."""
    return _ROUND_TRIPS[name](x, side, layer)


def _check_pow2(name: str, head_dim: int) -> None:
    if head_dim < 2 or head_dim & (head_dim - 1):
        raise UsageError(
            f"LMCache's {name} serde needs a power-of-two head_dim (its _build_hadamard_cpu builds a head_dim-point "
            f"Sylvester matrix for every preset), got {head_dim}"
        )


def layer_storage_bytes(
    name: str, layer: int, num_layers: int, kv_heads: int, head_dim: int, elem_bytes: int = 2
) -> float:
    """Bytes per token that serde `name` writes to storage for layer `layer` (K and V together), the per-object
    overheads left out (aesgcm 29 bytes, asym_k16_v8 a 4-byte scale and <= 1 KiB header per stored object;
    TurboQuant pads a chunk's tokens to a multiple of its block_size 16). `elem_bytes`: the model's serving dtype
    (2 for bf16 / fp16)."""
    name = serde_key(name)
    n = kv_heads * head_dim  # elements of K (or V) per token and layer
    if name == "fp8":
        return 2.0 * n  # estimate_serialized_size: 1 byte per element
    if name == "aesgcm":
        return 2.0 * n * elem_bytes  # ciphertext = plaintext length
    if name == "asym_k16_v8":
        return float(n * elem_bytes + n)  # K native + V one byte
    _check_pow2(name, head_dim)
    if layer in tq_serde_layers(num_layers):  # [L, num_blocks, block_size, H, slot_size_aligned]
        return float(kv_heads * tq_slot_bytes(name, head_dim))
    return 2.0 * n * elem_bytes  # a raw layer
