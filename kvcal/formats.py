"""KV-cache formats: the one numeric spec (quantize to a storage layout, dequantize, bit costs).

Every K or V tensor is `x: [..., D]` (in the cache layout `[B, H_kv, T, D]`, D = head_dim). `quantize` returns a
`QTensor` (codes + scales, exactly what a cache stores); `dequantize` turns it back; `fake_quantize` does both.
All arithmetic is float32 (float64 input is first clamped to the float32 range), vectorised, deterministic, and
saturating: a finite input never becomes NaN/Inf, also for +-1e30 and all-zero blocks.

Non-finite input (fp16/bf16 overflow upstream): every scale (per block, per token, per sequence) is computed over
the FINITE values only, so a NaN or Inf never changes how its neighbours are stored. +-Inf saturates like any value
beyond the range (to the largest magnitude its scale represents; 0 in an otherwise all-zero block). NaN stays NaN
through quantize -> dequantize in every format: fp8 and bf16 store their own NaN; int8 stores the code -128, which
the symmetric +-127 grid never uses; the E2M1 formats store the code 8 (the bit pattern of -0), which quantize never
writes for a number (a value that rounds to zero is stored as +0). No engine defines these two markers: an engine's
int8/E2M1 cache has no NaN and would store some finite code — kvcal keeps the NaN so that evaluation sees it.

Storage layout (kernels read these; do not change without changing them)
-------------------------------------------------------------------------
| format | `codes` | `block_scales` | `scale` |
|---|---|---|---|
| auto | x itself | None | None |
| bf16 | bfloat16 [..., D] | None | None |
| fp8_e4m3 / fp8_e5m2 | float8_e4m3fn / float8_e5m2 [..., D] | None | fp32 0-d, [H_kv] (dim 1) or [B, 1, 1, 1] |
| int8_per_token_head | int8 [..., D] (-128 = NaN) | fp32 [..., 1] (max(amax/127, 1e-6)) | None |
| float16 | float16 [..., D] | None | None |
| int8_per_tensor | int8 [..., D] (NaN stored as 0) | None | fp32 0-d, [H_kv] or [B, 1, 1, 1] |
| fp8_per_token_head | float8_e4m3fn [..., D] | fp32 [..., 1] (max(amax/448, 1e-6)) | None |
| int4_per_token_head | uint8 [..., D//2] (rotated basis) | fp32 [..., 1] word: scale, zero point in bits 0-3 | None |
| tq_fp8 (k8v4 keys) | float8_e4m3fn [..., D] | None | None |
| tq_mse4_nc / tq_mse3_nc (keys) | uint8 [..., D*b/8] codes of the rotated unit vector | float16 [..., 1] norm | fp32 [D] the layer's signs |
| tq_uniform4 / tq_uniform3 (values) | uint8 [..., D*b/8] | float16 [..., 2]: scale, min | None |
| nvfp4, nvfp4_4over6 | uint8 [..., D//2] | float8_e4m3fn [..., D//16] | fp32 0-d, [H_kv] or [B, 1, 1, 1] global |
| fp4_e2m1 | uint8 [..., D//2] | uint8 E8M0 [..., D//16] | None |
| mxfp4 | uint8 [..., D//2] | uint8 E8M0 [..., D//32] | None |

Dequantization: fp8 `codes * scale`; int8 `codes * block_scales`; nvfp4 (and nvfp4_4over6, `KVFormat.layout`
"nvfp4") `e2m1(code) * (e4m3(block) * scale)`
(the product in fp32); fp4_e2m1 / mxfp4 `e2m1(code) * 2**(byte - 127)`. Block b covers elements
`[b*block, (b+1)*block)` of the last dim.

A `scale` of shape [B, 1, 1, 1] is one scale per sequence (row of dim 0) of a [B, H_kv, T, D] tensor: nvfp4's
dynamic global scale (`nvfp4_dynamic_global`) and what the cache stores when each sequence fixes its own.

E2M1 code (4 bits): bit 3 = sign, bits 0-2 index the magnitudes (0, 0.5, 1, 1.5, 2, 3, 4, 6) — the standard
E2M1 encoding (2 exponent bits, 1 mantissa bit, bias 1); code c decodes to `E2M1_VALUES[c]`, except that kvcal
reads code 8 (the -0 pattern) as NaN (see above).
Packing (`pack_fp4`): byte j of the last dim holds element 2j in its LOW nibble and element 2j+1 in its HIGH
nibble: `byte = codes[..., 0::2] | (codes[..., 1::2] << 4)` — the order SGLang's KVFP4QuantizeUtil and
compressed-tensors' `pack_fp4_to_uint8` use. E8M0 byte e means 2**(e - 127) (OCP MX v1.0; 255 = NaN is never
written).

Rounding and scales per format
------------------------------
- fp8_*: `(x / scale).clamp(+-max).to(float8)` — torch's cast, round-to-nearest-even. `scale` is the number a scale
  file stores as k_scale/v_scale (x ~ codes * scale); default 1.0 = what vLLM/SGLang use uncalibrated.
- int8_per_token_head: vLLM 0.32.0 and 0.33.0's `_reshape_cache_per_token_head` with QUANT_MAX 127, QUANT_MIN -128,
  IS_INT_QUANT (vllm/v1/attention/ops/triton_reshape_and_cache_flash.py of both releases' wheels; run under the
  Triton interpreter by tests/conformance): per (token, KV head) `scale = max(amax / 127, 1e-6)` (fp32), codes
  `trunc(clamp(where(y >= 0, y + 0.5, y - 0.5), -128, 127))` with y = x * (1 / scale) in float32: "Round half away
  from zero before the int8 store truncates" (Triton's float -> int store is fptosi; PTX cvt.rzi). Dequantized
  `codes * scale`. The finite codes stay within +-127 (|y| <= 127 * (1 + 2**-23)); -128 is kvcal's NaN marker.
  (kvcal before issue 40 truncated without the +-0.5, transcribed from a development commit f51ccb3e whose file
  triton_quant_kv/int8_fp8_per_token_head.py no release ships.)
- int8_per_tensor: TensorRT-LLM's INT8 KV cache (`kv_cache_quant_algo` INT8): a static fp32 scale s (0-d, [H_kv]
  or [B, 1, 1, 1]; a scale file's k_scale / v_scale = amax / 127, ModelOpt's convention; default 1.0), codes
  `cvt.rni.sat.s8.f32(x * (1 / s))` (TensorRT-LLM's `cuda_cast<int8_t, float>`): round half to even, saturate to
  [-128, 127], NaN -> 0 (the one format that stores NaN as a number, as the engine: its int8 has no NaN).
  TensorRT-LLM (tensorrt_llm/layers/attention.py, tensorrt_llm/quantization/quantize.py,
  cpp/tensorrt_llm/common/cudaTypeUtils.cuh) passes `kv_orig_quant_scale = kv_cache_rcp_scaling_factor`
  (= torch.reciprocal of kv_cache_scaling_factor, fp32) to its attention plugin; its checkpoint holds ONE
  kv_cache_scaling_factor of shape (1,) per layer for K and V (a scale file's k_scale and v_scale are the same
  value only if calibrated so).
- float16: the IEEE cast `x.to(float16)` (round to nearest even): beyond +-65504 a value becomes +-Inf, as a bf16
  model's K/V stored into vLLM's `--kv-cache-dtype float16` cache by its Triton `reshape_and_cache` (`tl.store`
  converts); Inf is then counted as non-finite K/V. No scale.
- fp8_per_token_head: vLLM's `_reshape_cache_per_token_head_kernel`
  (vllm/v1/attention/ops/triton_quant_kv/_per_token_head_kernel.py @ 8940d7db4a47a9d9700bad90f1142130f699950c):
  per (token, KV head) `scale = max(amax / 448, 1e-6)` (fp32; the floor keeps an all-zero row finite), codes
  `e4m3_rne(clamp(x * (1 / scale), +-448))`; dequantized `codes * scale`. Any head_dim. kvcal computes the
  reciprocal correctly rounded; Triton on a GPU may use an approximate division.
- int4_per_token_head: vLLM's `reshape_and_cache_int4` / `_reshape_cache_int4_kernel`
  (vllm/v1/attention/ops/int4_per_token_head.py @ 055e47c28003156421365af985d676fc921cb075). First a randomized
  Hadamard rotation `single_rht(x) = H (D1 x)` in float32, rounded back to K/V's own dtype (bf16 for a bf16
  model): D1 = +-1 signs from torch's CPU Bernoulli(0.5) under `manual_seed(0x9E3779B9)` (`rht_signs`), H the
  unnormalised Walsh-Hadamard transform (vLLM's PyTorch butterfly, `hadamard`), so head_dim must be a power of two.
  Then per (token, KV head) of the rotated y: `scale = max((max - min) / 15, 1e-6)`, `zp = clamp(rha(-min /
  scale), 0, 15)`, codes `clamp(rha(y * (1 / scale) + zp), 0, 15)` with rha = round half away from zero (vLLM's
  `(v +- 0.5).to(int32)`); element 2i in the low nibble of byte i; the scale word is the fp32 scale with its 4 low
  mantissa bits replaced by zp. Dequantized (`dequantize`) in kvcal's unrotated basis: `rht((code - zp) *
  scale_word_without_zp, inverse=True) / D`. vLLM's attention reads the rotated codes with a rotated query
  (logit scale / D) and rotates the output back — the same attention up to float32 rounding (the Triton kernel
  here does exactly that). On CUDA vLLM rotates with hadacore in bf16 instead of the butterfly (its bf16 result
  can differ in the last bit where the float32 sum lies at a bf16 rounding boundary). A (token, head) row with a
  NaN or Inf anywhere is stored as NaN (scale word NaN, codes 0): the rotation mixes every element into every code.
  So is a finite row whose rotation overflows (|x| near float32's max / D, or bf16's max / D for bf16 K/V): the
  one exception to "finite in, finite out", as on the engine, whose rotation overflows the same way.
- turboquant_k8v4 / turboquant_4bit_nc / turboquant_k3v4_nc / turboquant_3bit_nc: vLLM's TurboQuant presets
  (`--kv-cache-dtype turboquant_*`; files and commits at the TurboQuant section below). Each is a K/V pair of side
  formats (`TQ_PRESETS`; a side is never a format on its own): keys `tq_fp8` (k8v4) or `tq_mse4_nc` / `tq_mse3_nc`,
  values `tq_uniform4` / `tq_uniform3`. TurboQuant applies no k_scale / v_scale (a scale file is refused).
  Keys, MSE (3/4 bits, norm correction): norm = |k| (kvcal: the float64 norm rounded once to float32; vLLM a float32
  GPU reduction), x_hat = k / (norm + 1e-8) in float32, y = x_hat @ PiT with PiT = diag(s) H / sqrt(D): H the
  Sylvester Hadamard matrix, s the +-1 signs of the LAYER (`tq_signs`: torch.randint(0, 2) from a CPU generator
  seeded 42 + 1337 * layer_index, times 2 minus 1), 1 / sqrt(D) the float32 value vLLM's `H / math.sqrt(D)` stores
  (`tq_hadamard_entry`). kvcal forms each y as that entry times the float64 butterfly sum, rounded once to float32
  (`tq_rotate`; vLLM's cuBLAS GEMM rounds in its own order: the same y to an ulp or two). Code = the number of
  midpoints <= y (the store kernel's binary search), midpoints (c[i] + c[i+1]) / 2 in float32 of the float32
  Lloyd-Max centroids of N(0, 1/D) (`tq_centroids`: vLLM's solve_lloyd_max, float64 trapezoid integrals of 200
  steps, 200 iterations or until no centroid moves by 1e-10). The norm is stored as float16 (RNE; >= 65520 is Inf,
  as the engine's). Dequantized: c = centroid[code], norm correction c * (1 / sqrt(sum(c * c) + 1e-16)) (kvcal: the
  float64 sum rounded once, correctly rounded sqrt and division (via float64: torch's float32 CPU sqrt is not); the Triton kernel's tl.sum / tl.sqrt / 1.0 / x are the GPU's),
  k_rot = float32(norm16) * c, then rotated back, k = k_rot @ Pi (`tq_rotate(., inverse=True)`). vLLM's decode
  instead rotates the query (q @ PiT) and scores norm * (q_rot . c): the same logits up to float32 rounding; kvcal's
  torch path reads the un-rotated K, its Triton kernel rotates the query as vLLM does. Keys, FP8 (k8v4): `e4m3(clamp(k, +-448))`, no scale, no rotation (Hopper's
  cvt.rn.satfinite; vLLM on Ampere/Ada stores float8e4b15 instead, not emulated).
  Values (3/4 bits, L = 2**bits - 1): per (token, head) min, max in float32, scale = (max - min) / L floored at
  1e-8, codes `trunc((v - min) / scale + 0.5)` clamped to 0..L (vLLM's Triton `/` is the GPU's approximate division,
  kvcal's correctly rounded: a value at a rounding boundary may take the other code), stored with float16 scale and
  float16 min; dequantized `code * scale16 + min16` (exact product, one rounding: the kernel's FMA).
  Packing: 4 bits element 2i in the low nibble of byte i; 3 bits each 8 elements a 24-bit little-endian word,
  element j at bit 3j. Non-finite rows: a (token, head) row holding NaN or Inf is stored with a NaN norm / scale
  (codes 0) and reads back all NaN (vLLM's key row turns NaN / +-Inf too; its value row would store NaN as the
  row minimum). A finite row whose float16 norm / scale / min overflows reads back +-Inf or NaN, as on the engine.
  head_dim must be a power of two (vLLM builds a D-point Sylvester matrix for every TurboQuant layer, k8v4
  included), at least 8 with a 3-bit side. Boundary layers: vLLM's create_engine_config adds
  get_boundary_skip_layers (the first and last 2 layers of a dense model, n capped at half) to
  kv_cache_dtype_skip_layers, which keeps them 'auto' (BF16 for a bf16 model); no vLLM flag turns it off (kvcal:
  `--tq-boundary-layers 0`). Sliding-window layers are refused (vLLM's TurboQuantAttentionImpl takes no window):
  keep them in BF16 (`--skip-layers sliding_window`). Bytes per (token, KV head) of a TurboQuant layer:
  `tq_slot_bytes` = slot_size_aligned = key (D for FP8, ceil(D b / 8) + 2) + value (ceil(D b / 8) + 4), rounded up
  to even. vLLM's first prefill chunk attends the raw K/V (flash_attn); every later read, decode included, goes
  through the cache, which is what kvcal reads at every position.
- nvfp4: global scale g (fp32, multiplicative: x ~ e2m1 * block_scale * g), default dynamic
  `amax / (448 * 6)` (`nvfp4_dynamic_global`): per sequence (dim 0) for a 4-D [B, H_kv, T, D] tensor, over the
  whole tensor otherwise, so a sequence's codes never depend on the other sequences of its batch. Block scale =
  `e4m3(clamp(block_amax / (6 g), max=448))` (RNE cast); elements = RNE to E2M1 of `x / (block_scale * g)`,
  saturating at +-6. compressed-tensors / vLLM store the RECIPROCAL: `global_scale_ct = 448 * 6 / amax = 1 / g` and a block scale `e4m3(global_scale_ct *
  block_amax / 6)`, dequantizing with `block_scale / global_scale_ct`; the two agree bit for bit when g is a power
  of two and to within float32 rounding of the scale otherwise (tests/test_formats_peer.py). A block whose scale
  rounds to 0 stores codes 0 (compressed-tensors substitutes 0.125 for a zero scale; the values are 0 either way).
  vLLM's NVFP4 cache uses g = its k_scale / v_scale: the checkpoint's, else 1.0 (the cache's default policy,
  `kvcal.kernels.cache`).
- nvfp4_4over6: vLLM's `--kv-cache-dtype nvfp4_4over6` (vllm-project/vllm PR #45187), transcribed from
  csrc/libtorch_stable/nvfp4_kv_cache_kernels.cu @ 0cd789b397efc1a8992489076db9fe28d41aed69
  (`cvt_warp_fp16_to_fp4_4over6`, `nvfp4_candidate_scale`, `nvfp4_reconstruction_error`). Same storage as nvfp4.
  Per 16-element block, with s = 1 / g (the kernel's SFScaleVal, g = k_scale / v_scale): two candidates
  `sf_n = e4m3_satfinite(s * (block_amax * (1/n)))` for n = 6 and 4, each with element multiplier
  `m_n = 1 / (float(sf_n) * (1 / s))` (0 when sf_n is 0); the squared reconstruction error
  `sum((rne_e2m1(x * m_n) / m_n - x)**2)` (pairs (2i, 2i+1) added first, then the 8 pair sums in order) picks
  n = 4 when strictly smaller, else n = 6; elements = RNE E2M1 of `x * m_n` (saturating at +-6). kvcal computes
  in IEEE float32 with correctly rounded reciprocals and no fused multiply-adds; the CUDA kernel uses
  `rcp.approx.ftz` and nvcc may contract `q * deq - x` into an FMA, so a GPU can choose the other candidate where
  the two errors agree to float32 rounding (and its block scale / multiplier can differ by an ulp). The block
  scale differs from kvcal's nvfp4 (which divides by `6 g` directly, compressed-tensors' order) by an ulp at most.
  NaN/Inf elements count as 0 in the block maximum and in the errors (kvcal's non-finite policy).
- fp4_e2m1: reproduces SGLang's `KVFP4QuantizeUtil._batched_quantize_standard` (sgl-project/sglang,
  python/sglang/srt/layers/quantization/kvfp4_tensor.py): 16-element blocks, `scale_exp = ceil(log2(clamp(
  block_amax / 6, min=1e-10)))` stored as the UE8M0 byte `scale_exp + 127` (an all-zero block gets -33);
  `scaled = x / 2**scale_exp`; sign bit `scaled < 0`; magnitude code = `sum(|scaled| >= (0.25, 0.75, 1.25, 1.75,
  2.5, 3.5, 5))`, i.e. E2M1 ties round AWAY from zero (RNE would send 0.25, 1.25, 2.5 and 5 down); same packing.
  The one difference: SGLang writes code 8 (-0) for a small negative value, kvcal code 0 (+0), same value.
  kvcal computes in float32. SGLang's function is `@torch.compile`d, and Inductor computes that pointwise chain in
  float32 for bf16 input too, so the results agree bit for bit (checked against torch.compile of the transcribed
  function on CPU, bf16 input); SGLang's code run EAGERLY on bf16 would round block_amax/6 and its log2 to bf16 and
  can pick an exponent one lower when block_amax/6 lies just above a power of two >= 16 (amax 97: 4 vs 5).
- mxfp4 (OCP MX v1.0): 32-element blocks, shared exponent `floor(log2(block_amax)) - 2` (emax of E2M1 = 2),
  clamped to [-127, 127] (an all-zero block gets -127), stored as E8M0 (bias 127); elements = RNE to E2M1 of
  `x / 2**shared_exp`, saturating at +-6 (block maxima in [6, 8) * 2**shared_exp clip to 6, as the spec allows).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cache

import torch

from kvcal.errors import UsageError

__all__ = [
    "E2M1_VALUES",
    "FORMATS",
    "KVFormat",
    "QTensor",
    "PLAIN_E2M1",
    "E2M1Rounding",
    "as_f32",
    "bits_per_element",
    "check_scale",
    "static_scale",
    "dequantize",
    "e2m1_decode",
    "e2m1_encode",
    "e8m0_to_float",
    "exp2_int",
    "fake_quantize",
    "finite_abs",
    "format_names",
    "get_format",
    "kv_pair",
    "nvfp4_dynamic_global",
    "pack_fp4",
    "parse_kv_input_dtype",
    "parse_kv_format",
    "quantize",
    "quantize_f32",
    "unpack_fp4",
]

FP8_E4M3_MAX = 448.0
FP8_E5M2_MAX = 57344.0
E2M1_MAX = 6.0
INT8_MAX = 127.0
INT8_NAN = -128  # int8 code kvcal reads as NaN (the symmetric grid is +-127)
E2M1_NAN = 8  # E2M1 code kvcal reads as NaN (the -0 pattern; quantize writes +0 for zero)
BF16_MAX = float(torch.finfo(torch.bfloat16).max)
FP16_MAX = float(torch.finfo(torch.float16).max)
F32_MAX = float(torch.finfo(torch.float32).max)

# Index = 4-bit E2M1 code (bit 3 sign); code 8 (-0 in standard E2M1) is kvcal's NaN marker.
E2M1_VALUES = torch.tensor(
    [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, float("nan"), -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
    dtype=torch.float32,
)
# Midpoints between consecutive E2M1 magnitudes; bound i separates magnitude code i from i+1.
E2M1_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
_CONST_CACHE: dict[tuple[str, torch.device], torch.Tensor] = {}


def _scalar(value: float, device: torch.device) -> torch.Tensor:
    """A shared fp32 0-d tensor of `value` per device (the default scale): the same tensor at every write, so what
    the torch path remembers of a cache side's scale (`kvcal.kernels.fast.ScaleMemo`) is computed once. Never
    modify it."""
    key = (f"scalar:{value!r}", torch.device(device))
    t = _CONST_CACHE.get(key)
    if t is None:
        t = _CONST_CACHE[key] = torch.tensor(value, dtype=torch.float32, device=device)
    return t


def _const(name: str, device: torch.device) -> torch.Tensor:
    key = (name, device)
    t = _CONST_CACHE.get(key)
    if t is None:
        t = _CONST_CACHE[key] = _CONSTS[name]().to(device)
    return t


@dataclass(frozen=True, eq=False)
class KVFormat:
    """One KV-cache format of the docs/formats.md table."""

    name: str  # canonical
    aliases: tuple[str, ...]
    element: str  # 'auto' | 'bf16' | 'fp16' | 'e4m3' | 'e5m2' | 'int8' | 'e4m3_token' | 'int4_rht' | 'e2m1'
    block_size: int  # elements per block scale along head_dim; 0 = none
    calibratable: bool  # takes a static `scale` (fp8_*: the scale; nvfp4: the global scale)
    max_value: float | None  # largest code magnitude (element units)
    engine_names: dict[str, str | None] = field(default_factory=dict)  # vllm / sglang / trtllm
    description: str = ""
    # the format whose QTensor storage layout this one shares (what dequantize and the kernels read); "" = its own
    # name. nvfp4_4over6 stores exactly nvfp4's codes + E4M3 block scales + global scale: only the choice of the
    # block scale differs, so every reader of nvfp4 reads it.
    layout: str = ""
    codes_dtype: torch.dtype | None = None  # QTensor.codes (None: x itself, 'auto')
    scales_dtype: torch.dtype | None = None  # QTensor.block_scales (None: none)
    triton_kernel: int | None = None  # kvcal.kernels.triton_attention's FMT family of this layout
    c_kernel: int | None = None  # kvcal/kernels/cpu_write.c's format id; None = not written by it
    bits: int = 0  # a TurboQuant side's code width (3 or 4; 8 for its FP8 keys); 0 = not a TurboQuant side

    def __post_init__(self) -> None:
        if not self.layout:
            object.__setattr__(self, "layout", self.name)

    def bits_per_element(self, head_dim: int, model_bits: int = 16) -> float:
        """Storage bits per K or V element including scale bytes (per-tensor/per-head scales are negligible).

        `model_bits` is what `auto` stores (16 for a bf16/fp16 model, 32 for float32)."""
        if self.element == "auto":
            return float(model_bits)
        if self.element == "bf16":
            return 16.0
        if self.element in ("e4m3", "e5m2", "int8s"):
            return 8.0
        if self.element == "fp16":
            return 16.0
        if self.element in ("int8", "e4m3_token"):
            return 8.0 + 32.0 / head_dim  # one fp32 scale per (token, head)
        if self.element == "int4_rht":
            return 4.0 + 32.0 / head_dim  # two codes per byte + one fp32 scale (zero point inside) per (token, head)
        if self.element == "tq_fp8":
            return 8.0
        if self.element in ("tq_mse", "tq_uniform"):  # packed codes + fp16 norm (K) or fp16 scale and zero (V)
            return 8.0 * (math.ceil(head_dim * self.bits / 8) + tq_side_extra_bytes(self)) / head_dim
        # FP4: 4-bit codes + one 8-bit block scale (E4M3 or E8M0) per block
        return 4.0 + 8.0 / self.block_size

    @property
    def is_fp4(self) -> bool:
        return self.element == "e2m1"

    def storage_widths(self, head_dim: int) -> tuple[int, int | None]:
        """(codes, block scales) elements per token and KV head of the stored QTensor for head_dim (None: no block
        scales)."""
        if self.is_fp4:
            return head_dim // 2, head_dim // self.block_size
        if self.element == "int4_rht":
            return head_dim // 2, 1
        if self.element in ("tq_mse", "tq_uniform"):
            return math.ceil(head_dim * self.bits / 8), tq_side_extra_bytes(self) // 2
        if self.element == "tq_fp8":
            return head_dim, None
        if self.element in ("int8", "e4m3_token"):
            return head_dim, 1
        return head_dim, None


# fmt: off
# name, aliases, element, block, calibratable, max, storage (codes dtype, block-scales dtype: `QTensor` as quantize
# returns it; None = x itself / none), kernel ids (Triton's FMT family, cpu_write.c's format enum; None = not
# written by that kernel), (vLLM, SGLang, TRT-LLM names), description. The kernels take their ids from here:
# triton_attention.FMT_CODES, cpu_write (and cpu_write.c, whose enum the library's ABI check compares with it).
_U8, _E4M3, _E5M2 = torch.uint8, torch.float8_e4m3fn, torch.float8_e5m2
_TABLE: tuple[tuple, ...] = (
    ("auto", (), "auto", 0, False, None, (None, None), (0, None), ("auto", "auto", None),
     "the model's own dtype, untouched"),
    ("bf16", ("bfloat16",), "bf16", 0, False, None, (torch.bfloat16, None), (0, 0), ("bfloat16", "bf16", None),
     "bfloat16 (a BF16 server)"),
    ("fp8_e4m3", ("fp8", "fp8_e4m3fn", "e4m3"), "e4m3", 0, True, FP8_E4M3_MAX, (_E4M3, None), (1, 1),
     ("fp8", "fp8_e4m3", "FP8"), "FP8 E4M3FN +-448, fp32 scale per tensor or KV head (calibrated, or 1.0)"),
    ("fp8_e5m2", ("e5m2",), "e5m2", 0, True, FP8_E5M2_MAX, (_E5M2, None), (1, 2), ("fp8_e5m2", "fp8_e5m2", None),
     "FP8 E5M2 +-57344, fp32 scale per tensor or KV head (calibrated, or 1.0)"),
    ("int8_per_token_head", ("int8_per_token",), "int8", 0, False, INT8_MAX, (torch.int8, torch.float32), (2, 3),
     ("int8_per_token_head", None, None), "int8 symmetric, dynamic fp32 scale per (token, KV head)"),
    ("int8_per_tensor", ("int8", "int8_static", "int8_kv_cache"), "int8s", 0, True, INT8_MAX, (torch.int8, None), (1, 10),
     (None, None, "INT8"),
     "int8, static fp32 scale per tensor or KV head (calibrated amax/127, or 1.0): TensorRT-LLM's INT8 KV cache"),
    ("float16", ("fp16", "half"), "fp16", 0, False, FP16_MAX, (torch.float16, None), (0, 8),
     ("float16", None, None), "float16 (IEEE half; beyond +-65504 a value becomes +-Inf, as the engine's cast)"),
    ("fp8_per_token_head", ("fp8_per_token",), "e4m3_token", 0, False, FP8_E4M3_MAX, (_E4M3, torch.float32),
     (5, 9), ("fp8_per_token_head", None, None),
     "FP8 E4M3FN, dynamic fp32 scale max(amax/448, 1e-6) per (token, KV head) (vLLM's per-token-head kernel)"),
    ("int4_per_token_head", ("int4_per_token",), "int4_rht", 0, False, 15.0, (_U8, torch.float32), (6, 11),
     ("int4_per_token_head", None, None),
     "randomized Hadamard rotation, then asymmetric 4-bit [min, max] -> 0..15 per (token, KV head); fp32 scale "
     "with the 4-bit zero point in its low mantissa bits (vLLM's int4_per_token_head)"),
    ("nvfp4", ("nv_fp4",), "e2m1", 16, True, E2M1_MAX, (_U8, _E4M3), (3, 4), ("nvfp4", None, "NVFP4"),
     "E2M1, 16-element blocks, E4M3 block scale x fp32 global scale"),
    ("nvfp4_4over6", ("nvfp4_4o6",), "e2m1", 16, True, E2M1_MAX, (_U8, _E4M3), (3, 5),
     ("nvfp4_4over6", None, None),
     "nvfp4 storage; per block the E4M3 scale of max/6 or max/4, whichever reconstructs with less squared error "
     "(vLLM's 4-over-6 scale search)"),
    ("fp4_e2m1", ("kvfp4", "fp4_mx_block16"), "e2m1", 16, False, E2M1_MAX, (_U8, _U8), (4, 7),
     (None, "fp4_e2m1", None),
     "E2M1, 16-element blocks, UE8M0 power-of-two scale (SGLang's quantizer: ties away from zero; SGLang now also "
     "calls it fp4_mx_block16)"),
    ("mxfp4", ("mx_fp4",), "e2m1", 32, False, E2M1_MAX, (_U8, _U8), (4, 6), (None, None, None),
     "E2M1, 32-element blocks, E8M0 shared exponent (OCP MX v1.0)"),
)
# fmt: on
_LAYOUTS = {"nvfp4_4over6": "nvfp4"}  # formats that share another one's storage layout
FORMATS: dict[str, KVFormat] = {
    row[0]: KVFormat(
        *row[:6],
        dict(zip(("vllm", "sglang", "trtllm"), row[8], strict=True)),
        row[9],
        _LAYOUTS.get(row[0], ""),
        *row[6],
        *row[7],
    )
    for row in _TABLE
}
# Engine cache dtypes kvcal knows and does not emulate, with the reason (an error names it instead of "unknown").
NOT_EMULATED: dict[str, str] = {
    "nvfp4_ds_mla": "vLLM's NVFP4 cache of DeepSeek MLA latents (one compressed latent per token, not per-head "
    "K/V); kvcal evaluates per-head K/V caches",
    "fp8_ds_mla": "vLLM's FP8 cache of DeepSeek MLA latents (one compressed latent per token, not per-head K/V); "
    "kvcal evaluates per-head K/V caches",
    # vLLM maps the name to float8_e4m3fn storage and nothing else (vllm/utils/torch_utils.py
    # STR_DTYPE_TO_TORCH_DTYPE); what is stored is computed on Intel Gaudi by Intel Neural Compressor in the
    # out-of-tree HPU plugin, from INC's measured scales, so vLLM's source does not show the arithmetic
    # vLLM 0.32.0 / 0.33.0 (kvcal.releases): caches only a ROCm backend stores; `kvcal capacity` counts their bytes
    "ultraquant_4bit": "vLLM's UltraQuant 4-bit cache (FP4 E2M1 codes, UE8M0 scale per 32, Hadamard-rotated K), "
    "which only its ROCm platform selects (vllm/platforms/rocm.py: ULTRAQUANT backend, vLLM 0.32.0 and 0.33.0): no "
    "CUDA or CPU build stores it and kvcal does not emulate it (kvcal capacity counts its bytes)",
    **{
        name: "vLLM 0.33.0's Octave cache (block-Hadamard-rotated Lloyd-Max codes, fp16 scales), stored only by its "
        "ROCm backend ROCM_OCTAVE (vllm/v1/attention/ops/rocm_octave.py, selected in vllm/platforms/rocm.py): no "
        "CUDA or CPU build stores it and kvcal does not emulate it (kvcal capacity counts its bytes)"
        for name in ("octave_k3v4", "octave_k3v3", "octave_k3v3_compact")
    },
    "fp8_inc": "Intel Gaudi's FP8 KV cache through Intel Neural Compressor: vLLM only maps the name to E4M3 "
    "storage, the quantization runs in the out-of-tree HPU plugin with INC's measured scales, which vLLM's source "
    "does not show; for the same E4M3 storage with a calibrated scale use fp8_e4m3 --scales",
}
_LOOKUP: dict[str, KVFormat] = {}
for _f in FORMATS.values():
    for _n in (_f.name, *_f.aliases):
        _LOOKUP[_n.lower()] = _f

# TurboQuant (vLLM `--kv-cache-dtype turboquant_*`, see the module docstring): K and V are stored in two different
# ways, so each preset is a named K/V pair of the side formats below. A side is no engine's cache dtype on its own:
# it is reachable only through its preset (`kv_pair`), never by name in -f or in `k=...,v=...`.
# name, element, bits, description (vLLM vllm/model_executor/layers/quantization/turboquant/config.py TQ_PRESETS)
# fmt: off
_TQ_SIDE_ROWS: tuple[tuple[str, str, int, str], ...] = (
    ("tq_fp8", "tq_fp8", 8, "TurboQuant FP8 keys: E4M3FN of K itself, no scale, no rotation"),
    ("tq_mse4_nc", "tq_mse", 4, "TurboQuant keys: Hadamard rotation of K / |K|, 4-bit Lloyd-Max codes, fp16 norm, "
     "unit-norm corrected centroids"),
    ("tq_mse3_nc", "tq_mse", 3, "TurboQuant keys: Hadamard rotation of K / |K|, 3-bit Lloyd-Max codes, fp16 norm, "
     "unit-norm corrected centroids"),
    ("tq_uniform4", "tq_uniform", 4, "TurboQuant values: asymmetric 4-bit [min, max] per (token, head), fp16 "
     "scale and zero"),
    ("tq_uniform3", "tq_uniform", 3, "TurboQuant values: asymmetric 3-bit [min, max] per (token, head), fp16 "
     "scale and zero"),
)
# fmt: on
# element -> (codes dtype, block-scales dtype, Triton FMT family of kvcal.kernels.triton_attention): FP8 keys are
# fp8_e4m3's storage at scale 1 (the FP8 family, 1); MSE keys (7) and uniform values (8) are TurboQuant's own
# families. cpu_write.c's format id per side: _TQ_C_KERNEL.
_TQ_STORAGE = {
    "tq_fp8": (_E4M3, None, 1),
    "tq_mse": (_U8, torch.float16, 7),
    "tq_uniform": (_U8, torch.float16, 8),
}
_TQ_C_KERNEL = {"tq_fp8": 12, "tq_mse4_nc": 13, "tq_mse3_nc": 14, "tq_uniform4": 15, "tq_uniform3": 16}
TQ_SIDES: dict[str, KVFormat] = {
    name: KVFormat(
        name, (), element, 0, False, None, {}, desc, "", *_TQ_STORAGE[element], _TQ_C_KERNEL[name], bits
    )
    for name, element, bits, desc in _TQ_SIDE_ROWS
}
# preset -> (K side, V side): key_quant_bits 8 = FP8 keys, else MSE keys with norm_correction (the _nc presets)
TQ_PRESETS: dict[str, tuple[KVFormat, KVFormat]] = {
    "turboquant_k8v4": (TQ_SIDES["tq_fp8"], TQ_SIDES["tq_uniform4"]),
    "turboquant_4bit_nc": (TQ_SIDES["tq_mse4_nc"], TQ_SIDES["tq_uniform4"]),
    "turboquant_k3v4_nc": (TQ_SIDES["tq_mse3_nc"], TQ_SIDES["tq_uniform4"]),
    "turboquant_3bit_nc": (TQ_SIDES["tq_mse3_nc"], TQ_SIDES["tq_uniform3"]),
}
TQ_PRESET_DESCRIPTIONS: dict[str, str] = {
    "turboquant_k8v4": "FP8 E4M3 keys (no scale) + 4-bit uniform values (fp16 scale/zero)",
    "turboquant_4bit_nc": "Hadamard-rotated 4-bit Lloyd-Max keys (fp16 norm, norm-corrected) + 4-bit uniform values",
    "turboquant_k3v4_nc": "Hadamard-rotated 3-bit Lloyd-Max keys (fp16 norm, norm-corrected) + 4-bit uniform values",
    "turboquant_3bit_nc": "Hadamard-rotated 3-bit Lloyd-Max keys (fp16 norm, norm-corrected) + 3-bit uniform values",
}


def is_tq_preset(name: object) -> bool:
    return isinstance(name, str) and name.strip().lower() in TQ_PRESETS


def pair_name(k: KVFormat, v: KVFormat) -> str:
    """The canonical name of a (K, V) format pair: one format's name, a TurboQuant preset's, or `k=<K>,v=<V>`."""
    if k is v:
        return k.name
    for preset, sides in TQ_PRESETS.items():
        if sides == (k, v):
            return preset
    return f"k={k.name},v={v.name}"


def format_names() -> str:
    """'auto, bf16 (alias bfloat16), fp8_e4m3 (aliases fp8, ...), ...' for error messages and help."""
    parts = []
    for f in FORMATS.values():
        if f.aliases:
            parts.append(f"{f.name} ({'alias' if len(f.aliases) == 1 else 'aliases'} {', '.join(f.aliases)})")
        else:
            parts.append(f.name)
    return ", ".join(parts + list(TQ_PRESETS))


def get_format(name: str | KVFormat) -> KVFormat:
    """The format for a canonical name or an alias (case-insensitive); UsageError listing all names otherwise."""
    if isinstance(name, KVFormat):
        return name
    key = str(name).strip().lower()
    fmt = _LOOKUP.get(key)
    if fmt is None and key in TQ_SIDES:
        return TQ_SIDES[key]
    if fmt is None and key in TQ_PRESETS:
        raise UsageError(
            f"KV format '{name}' is vLLM's TurboQuant preset, a K/V pair ({TQ_PRESETS[key][0].name} keys, "
            f"{TQ_PRESETS[key][1].name} values): this use takes one format for K and V alike"
        )
    if fmt is None and key in NOT_EMULATED:
        raise UsageError(f"KV format '{name}' is {NOT_EMULATED[key]}; valid formats: {format_names()}")
    if fmt is None:
        raise UsageError(f"unknown KV format '{name}'; valid formats: {format_names()}")
    return fmt


def parse_kv_format(name: str | None) -> str:
    """Canonical format name ('auto' for empty / auto); UsageError listing the valid names otherwise.

    A K/V pair `k=FMT,v=FMT` (either order, aliases allowed) becomes `k=<canonical>,v=<canonical>`, or the single
    canonical name when both sides are the same format (`k=fp8,v=fp8_e4m3` is `fp8_e4m3`)."""
    if name is None or str(name).strip().lower() in ("", "auto"):
        return "auto"
    if is_tq_preset(name):
        return str(name).strip().lower()
    if "=" not in str(name):
        return get_format(str(name)).name
    k, v = kv_pair(str(name))
    return pair_name(k, v)


def kv_pair(name: str | KVFormat) -> tuple[KVFormat, KVFormat]:
    """(K's format, V's format) of a format name or a `k=FMT,v=FMT` pair; UsageError for anything else. Neither
    side may be 'auto' (the model's own dtype is not a storage format one side can take alone)."""
    if is_tq_preset(name):  # type: ignore[arg-type]
        return TQ_PRESETS[str(name).strip().lower()]
    if isinstance(name, KVFormat) or "=" not in str(name):
        f = get_format(name)
        return f, f
    sides: dict[str, KVFormat] = {}
    for part in str(name).split(","):
        key, sep, value = part.partition("=")
        key = key.strip().lower()
        if not sep or key not in ("k", "v") or key in sides:
            raise UsageError(
                f"K/V format pair '{name}' is malformed; write it as k=FORMAT,v=FORMAT, e.g. k=fp8_e4m3,v=nvfp4"
            )
        sides[key] = get_format(value)
        if sides[key].name in TQ_SIDES:
            raise UsageError(
                f"K/V format pair '{name}': {sides[key].name} is one side of a TurboQuant preset, no engine's cache "
                f"dtype on its own; use the preset ({', '.join(TQ_PRESETS)})"
            )
    if set(sides) != {"k", "v"}:
        raise UsageError(f"K/V format pair '{name}' needs both sides, e.g. k=fp8_e4m3,v=nvfp4")
    if any(f.element == "auto" for f in sides.values()):
        raise UsageError(
            f"K/V format pair '{name}': a side cannot be 'auto'; use bf16 for an unquantized side"
        )
    return sides["k"], sides["v"]


# `--kv-input-dtype`: the dtype K/V have when they reach the quantizer (an engine serving a bf16 model quantizes
# bf16 K/V). Canonical name -> torch dtype; aliases below.
KV_INPUT_DTYPES: dict[str, torch.dtype] = {
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float32": torch.float32,
}
_KV_INPUT_ALIASES = {
    "bf16": "bfloat16",
    "fp16": "float16",
    "half": "float16",
    "fp32": "float32",
    "float": "float32",
}
DEFAULT_KV_INPUT_DTYPE = "bfloat16"
# What a run or scale file recorded before kvcal had `--kv-input-dtype`: K/V quantized as computed (kvcal computes
# on CPU in float32), i.e. float32 for every run made with --dtype float32.
LEGACY_KV_INPUT_DTYPE = "float32"


def parse_kv_input_dtype(name: str | None) -> str:
    """Canonical `--kv-input-dtype` name (bfloat16, float16, float32; aliases bf16, fp16, fp32); UsageError else."""
    key = DEFAULT_KV_INPUT_DTYPE if name is None else str(name).strip().lower()
    key = _KV_INPUT_ALIASES.get(key, key)
    if key not in KV_INPUT_DTYPES:
        raise UsageError(
            f"unknown --kv-input-dtype '{name}'; use bfloat16 (the engine's serving dtype, default), float16, or "
            "float32 (quantize K/V as the model computes them)"
        )
    return key


def bits_per_element(fmt: str | KVFormat, head_dim: int, model_bits: int = 16) -> float:
    return get_format(fmt).bits_per_element(head_dim, model_bits)


@dataclass
class QTensor:
    """The stored form of one K or V tensor x: [..., D] (see the module docstring for the layout per format)."""

    codes: torch.Tensor
    block_scales: torch.Tensor | None = None
    scale: torch.Tensor | None = None

    @property
    def nbytes(self) -> int:
        """Bytes of codes + block scales (the per-tensor / per-head `scale` is not counted)."""
        n = self.codes.numel() * self.codes.element_size()
        if self.block_scales is not None:
            n += self.block_scales.numel() * self.block_scales.element_size()
        return n


# ---------------------------------------------------------------------------------------------------------------
# E2M1 / E8M0 / packing helpers (kernels and tests use these)


def e2m1_encode(y: torch.Tensor, ties: str = "even") -> torch.Tensor:
    """4-bit E2M1 codes (uint8, one per element) of already-scaled values y; saturates at +-6.

    ties='even': round to nearest, ties to even mantissa (0.25->0, 0.75->1, 1.25->1, 1.75->2, 2.5->2, 3.5->4, 5->4).
    ties='away': ties away from zero, SGLang's `sum(|y| >= bounds)` rule. A value that rounds to zero gets code 0
    (+0, whatever its sign); NaN gets E2M1_NAN (8); +-Inf saturates to +-6."""
    if ties not in ("even", "away"):
        raise ValueError(f"ties must be 'even' or 'away', not {ties!r}")
    a = y.abs().float()
    # magnitude code = number of midpoints below a. At a tie (a == midpoint i, between codes i and i+1) 'away' goes
    # up; 'even' goes up only to an even code, i.e. at the odd-indexed midpoints 0.75, 1.75, 3.5.
    # (Seven elementwise compares: torch.bucketize is ~2x slower on a large CPU tensor; kvcal.kernels.fast takes it
    # for a small one, one op instead of ~20, with the same codes.)
    mag = torch.zeros(a.shape, dtype=torch.uint8, device=a.device)
    for i, b in enumerate(E2M1_MIDPOINTS):
        mag += (a >= b) if (ties == "away" or i % 2 == 1) else (a > b)
    sign = ((y < 0) & (mag > 0)).to(torch.uint8) << 3
    return torch.where(torch.isnan(y), E2M1_NAN, sign | mag).to(torch.uint8)


# constants of the spec, built per device on first use (`_const`)
_CONSTS = {
    "values": lambda: E2M1_VALUES,
    # nvfp4_4over6's two candidate denominators, as float32 reciprocals (1/4, 1/6)
    "recip_4_6": lambda: torch.tensor([1.0 / 4.0, 1.0 / 6.0], dtype=torch.float32),
}


@dataclass(frozen=True)
class E2M1Rounding:
    """How quantize rounds scaled values to E2M1: `encode(y, ties)` -> 4-bit codes (`e2m1_encode`) and `round(y)` ->
    the E2M1 value y rounds to, ties to even (`e2m1_decode(e2m1_encode(y, 'even'))`). The spec's are
    `PLAIN_E2M1`; kvcal.kernels.fast passes another pair with the same bits for small tensors."""

    encode: Callable[[torch.Tensor, str], torch.Tensor]
    round: Callable[[torch.Tensor], torch.Tensor]


def e2m1_decode(codes: torch.Tensor) -> torch.Tensor:
    """float32 values of 4-bit E2M1 codes (uint8, low 4 bits used); code 8 is NaN."""
    return _const("values", codes.device)[(codes & 0x0F).long()]


PLAIN_E2M1 = E2M1Rounding(e2m1_encode, lambda y: e2m1_decode(e2m1_encode(y, ties="even")))


def pack_fp4(codes: torch.Tensor) -> torch.Tensor:
    """[..., D] 4-bit codes -> [..., D//2] uint8; element 2j in the low nibble, 2j+1 in the high nibble."""
    if codes.shape[-1] % 2:
        raise UsageError(f"FP4 packing needs an even last dimension, got {codes.shape[-1]}")
    c = codes.to(torch.uint8)
    return _pack(c & 0x0F)


def _pack(c: torch.Tensor) -> torch.Tensor:
    """pack_fp4 of uint8 codes already in 0..15 (what e2m1_encode returns): no masking; `* 16` is `<< 4` here
    (no carry) and ~4x cheaper on a small CPU tensor (torch's << wraps its scalar in a tensor first)."""
    return c[..., 0::2] | (c[..., 1::2] * 16)


def unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    """[..., N] uint8 -> [..., 2N] 4-bit codes (uint8); inverse of pack_fp4."""
    return torch.stack((packed & 0x0F, packed >> 4), dim=-1).flatten(-2)


def exp2_int(e: torch.Tensor) -> torch.Tensor:
    """Exact float32 2**e for integer e in [-127, 127] (built from bits; 2**-127 is the subnormal 0x00400000)."""
    e = e.to(torch.int32)
    normal = ((e + 127).clamp(min=1) << 23).view(torch.float32)
    return torch.where(e == -127, 2.0**-127, normal)


def e8m0_to_float(byte: torch.Tensor) -> torch.Tensor:
    """float32 value 2**(byte - 127) of E8M0 bytes (uint8)."""
    return exp2_int(byte.to(torch.int32) - 127)


# ---------------------------------------------------------------------------------------------------------------
# quantize / dequantize


def as_f32(x: torch.Tensor) -> torch.Tensor:
    if not x.is_floating_point():
        raise UsageError(f"KV tensors must be floating point, got {x.dtype}")
    if x.dtype == torch.float64:
        x = x.clamp(-F32_MAX, F32_MAX)  # so float64 input cannot overflow to inf (NaN stays NaN)
    return x.float()


def finite_abs(x: torch.Tensor) -> torch.Tensor:
    """|x| with NaN and +-Inf replaced by 0: what every scale is computed from (see the module docstring)."""
    return x.abs().nan_to_num_(nan=0.0, posinf=0.0)  # |x| has no -inf


def static_scale(
    scale: float | torch.Tensor | None, x: torch.Tensor, default: float | None, checked: bool = False
) -> torch.Tensor | None:
    """A user scale as fp32 0-d, [H_kv] or [B, 1, 1, 1]; validated finite and positive (on CPU, to avoid a
    device sync) unless `checked`: the caller passes a tensor it validated before (`check_scale`; a cache passes
    the same tensor at every write and validates it once)."""
    if scale is None:
        return None if default is None else _scalar(default, x.device)
    s = torch.as_tensor(scale, dtype=torch.float32, device=x.device)
    if s.numel() == 1:
        s = s if s.dim() == 0 else s.reshape(())  # a 0-d tensor stays the same tensor
    elif s.dim() == 4 and x.dim() == 4 and s.shape[0] == x.shape[0] and s.shape[1:] == (1, 1, 1):
        pass  # one scale per sequence
    elif s.dim() != 1 or x.dim() < 3 or x.shape[1] != s.numel():
        raise UsageError(
            f"a scale of shape {tuple(s.shape)} does not fit K/V of shape {tuple(x.shape)}: it must be one "
            "number, [H_kv] (per KV head) or [B, 1, 1, 1] (per sequence) for x [B, H_kv, T, D]"
        )
    if not checked and s.device.type == "cpu" and not bool(torch.isfinite(s).all() and (s > 0).all()):
        raise UsageError("KV scales must be finite and positive; recalibrate or check the scale file")
    return s


def check_scale(scale: float | torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """`scale` for K/V x [B, H_kv, T, D] as the fp32 tensor quantize uses (0-d, [H_kv] or [B, 1, 1, 1]), validated
    finite and positive (UsageError otherwise): pass it with `scale_checked=True` to skip the validation."""
    return static_scale(scale, x, None)  # type: ignore[return-value]


def _bcast(s: torch.Tensor, ndim: int) -> torch.Tensor:
    """fp32 0-d, [H] or [B, 1, 1, 1] scale -> broadcastable against an ndim-D tensor [B, H, ...]."""
    if s.dim() in (0, ndim):
        return s
    return s.reshape((1, -1) + (1,) * (ndim - 2))


def _blocks(xf: torch.Tensor, block: int) -> torch.Tensor:
    d = xf.shape[-1]
    if d % block:
        raise UsageError(f"head_dim {d} is not a multiple of the format's block size {block}")
    return xf.unflatten(-1, (d // block, block))  # [..., D/block, block]


def nvfp4_dynamic_global(x: torch.Tensor, valid: torch.Tensor | None = None) -> torch.Tensor:
    """nvfp4's dynamic global scale `amax / (448 * 6)` over the finite values of x, fp32.

    x: [B, H_kv, T, D] -> one scale per sequence, [B, 1, 1, 1]; any other rank -> one 0-d scale. `valid`: [B, T]
    bool (True = a real token) leaves padding out of the amax. A sequence with no finite nonzero value gets 1.0
    (any scale stores its zeros exactly)."""
    a = finite_abs(as_f32(x))
    if x.dim() != 4:
        amax = a.amax() if a.numel() else a.new_zeros(())
    else:
        if valid is not None:
            a = a * valid.to(device=a.device, dtype=a.dtype)[:, None, :, None]
        amax = a.amax(dim=(1, 2, 3), keepdim=True) if a[0].numel() else a.new_zeros(x.shape[0], 1, 1, 1)
    g = amax / (FP8_E4M3_MAX * E2M1_MAX)
    return torch.where(g > 0, g, torch.ones_like(g))


def _quantize_fp8(xf: torch.Tensor, f: KVFormat, s: torch.Tensor) -> QTensor:
    """s: the validated scale (`static_scale`)."""
    dtype = torch.float8_e4m3fn if f.element == "e4m3" else torch.float8_e5m2
    m = f.max_value
    # clamp first: torch's float8 casts do not all saturate (e5m2 overflows to inf); clamp keeps NaN, and the
    # cast stores it as the format's NaN
    codes = (xf / _bcast(s, xf.dim())).clamp(-m, m).to(dtype)
    return QTensor(codes=codes, scale=s)


def _quantize_int8(xf: torch.Tensor) -> QTensor:
    """vLLM 0.32.0 / 0.33.0's int8_per_token_head write (`_reshape_cache_per_token_head`, see the per-token-head
    section): scale = max(amax / 127, 1e-6) over the finite values [..., 1]; codes = the float32 `x * (1 / scale)`
    rounded half away from zero (`where(y >= 0, y + 0.5, y - 0.5)`, then the truncating int8 store). +-Inf -> +-127 and NaN -> INT8_NAN are kvcal's non-finite policy (the engine's are undefined)."""
    s = (finite_abs(xf).amax(dim=-1, keepdim=True) / INT8_MAX).clamp_(min=PTH_SCALE_MIN)  # [..., 1]
    # vLLM adds +-0.5 (round half away from zero), clamps to [-128, 127], and the store truncates; a finite x never
    # goes below -127.5 (|x * (1 / scale)| <= 127 (1 + 2**-23)), so +-127 is the same clamp for it and keeps -Inf
    # off the NaN marker
    codes = _round_half_away((xf * (1.0 / s)).clamp_(-INT8_MAX, INT8_MAX))
    codes = torch.where(torch.isnan(xf), float(INT8_NAN), codes).to(torch.int8)
    return QTensor(codes=codes, block_scales=s)


def _divide_blocks(xb: torch.Tensor, eff: torch.Tensor) -> torch.Tensor:
    """xb [..., nb, bs] / eff [..., nb, 1] in element units; a block of scale 0 (all finite values zero) gives 0,
    except NaN, which stays NaN."""
    ok = eff > 0
    y = xb / torch.where(ok, eff, 1.0)
    return torch.where(ok, y, torch.where(torch.isnan(xb), xb, 0.0))


def _quantize_nvfp4(xf: torch.Tensor, g: torch.Tensor | None, e2m1: E2M1Rounding) -> QTensor:
    """g: the validated global scale (`static_scale`), None = dynamic."""
    xb = _blocks(xf, 16)  # [..., D/16, 16]
    bmax = finite_abs(xb).amax(dim=-1)  # [..., D/16]
    if g is None:
        g = nvfp4_dynamic_global(xf)
    gb = _bcast(g, xf.dim())
    bs = (bmax / (E2M1_MAX * gb)).clamp(max=FP8_E4M3_MAX).to(torch.float8_e4m3fn)  # [..., D/16]
    y = _divide_blocks(xb, (bs.float() * gb).unsqueeze(-1))
    codes = e2m1.encode(y, "even")
    return QTensor(codes=_pack(codes.flatten(-2)), block_scales=bs, scale=g)


def _nvfp4_candidate(
    bmax: torch.Tensor, sf_scale: torch.Tensor, reciprocal: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's `nvfp4_candidate_scale`: (E4M3 block scale, element multiplier) of a block with maximum `bmax`
    [..., nb] mapped to the denominators n (6 or 4) whose float32 reciprocals 1/n are `reciprocal`, broadcast
    against bmax (a [2, 1, ...] tensor computes both candidates at once: [2, ..., nb]). sf_scale = 1 / global
    scale, broadcastable to bmax. (bmax * (1/n) in float32 is what `bmax * (1.0 / n)` with a Python float
    computes: torch applies a scalar in the tensor's dtype.)"""
    sf = (sf_scale * (bmax * reciprocal)).clamp(max=FP8_E4M3_MAX).to(torch.float8_e4m3fn)  # satfinite
    sfv = sf.float()
    inv = torch.where(sfv != 0, 1.0 / (sfv * (1.0 / sf_scale)), 0.0)
    return sf, inv


def _nvfp4_sq_error(xb: torch.Tensor, mult: torch.Tensor, e2m1: E2M1Rounding) -> torch.Tensor:
    """vLLM's `nvfp4_reconstruction_error` per block [..., nb]: sum of (e2m1_rne(x * mult) / mult - x)**2 (a block
    of multiplier 0 stores zeros), summed in the kernel's order: pairs (2i, 2i+1), then i = 0..7 in sequence.
    xb: [..., nb, 16] finite; mult: [..., nb] (or [2, ..., nb]: both candidates, xb broadcast)."""
    m = mult.unsqueeze(-1)
    deq = torch.where(m != 0, 1.0 / m, 0.0)
    d = e2m1.round(xb * m) * deq - xb
    sq = d * d
    pair = sq[..., 0::2] + sq[..., 1::2]  # [..., nb, 8]
    first, *rest = pair.unbind(-1)
    err = first
    for p in rest:  # in sequence, as the kernel adds them (a torch.sum would reorder)
        err = err + p
    return err


def _quantize_nvfp4_4over6(xf: torch.Tensor, g: torch.Tensor | None, e2m1: E2M1Rounding) -> QTensor:
    """g: the validated global scale (`static_scale`), None = dynamic."""
    # vLLM csrc/libtorch_stable/nvfp4_kv_cache_kernels.cu `cvt_warp_fp16_to_fp4_4over6` (see the docstring)
    xb = _blocks(xf, 16)  # [..., D/16, 16]
    fin = xb.nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)  # the choice never depends on NaN/Inf
    bmax = fin.abs().amax(dim=-1)  # [..., D/16]
    if g is None:
        g = nvfp4_dynamic_global(xf)
    sf_scale = 1.0 / _bcast(g, xf.dim())  # the kernel's SFScaleVal = 1 / k_scale
    # both candidates in one pass, dim 0 = (max/4, max/6): [2, ..., D/16]
    recip = _const("recip_4_6", xf.device).view((2,) + (1,) * bmax.dim())
    sf, mult = _nvfp4_candidate(bmax, sf_scale, recip)
    err = _nvfp4_sq_error(fin, mult, e2m1)
    use4 = err[0] < err[1]  # ties keep max/6
    bs = torch.where(use4, sf[0].view(torch.uint8), sf[1].view(torch.uint8)).view(torch.float8_e4m3fn)
    mult = torch.where(use4, mult[0], mult[1]).unsqueeze(-1)
    y = torch.where(mult != 0, xb * mult, torch.where(torch.isnan(xb), xb, 0.0))
    codes = e2m1.encode(y, "even")
    return QTensor(codes=_pack(codes.flatten(-2)), block_scales=bs, scale=g)


FP4_E2M1_MIN_RATIO = 1e-10  # SGLang's floor of a block's max / 6 (an all-zero block gets exponent -33)


def fp4_e2m1_exponent(bmax: torch.Tensor) -> torch.Tensor:
    """fp4_e2m1's block exponent (float32, integral) of block maxima bmax [..., D/16] (SGLang's rule:
    ceil(log2(clamp(bmax / 6, min=1e-10))); in place on the quotient, the same bits as out of place). torch's CPU
    log2 may round its last bit differently in a vectorised loop than in its scalar tail, so an element's exponent
    can depend on its place in the tensor: kvcal.kernels.cpu_write takes torch's log2 of a tensor of this shape."""
    return (bmax / E2M1_MAX).clamp_(min=FP4_E2M1_MIN_RATIO).log2_().ceil_()


def _quantize_fp4_e2m1(xf: torch.Tensor, e2m1: E2M1Rounding) -> QTensor:
    # SGLang KVFP4QuantizeUtil.batched_quantize, float32
    xb = _blocks(xf, 16)
    bmax = finite_abs(xb).amax(dim=-1)  # [..., D/16]
    scale_exp = fp4_e2m1_exponent(bmax)  # [..., D/16]
    y = xb / exp2_int(scale_exp).unsqueeze(-1)
    codes = e2m1.encode(y, "away")
    return QTensor(codes=_pack(codes.flatten(-2)), block_scales=(scale_exp + 127).to(torch.uint8))


def _quantize_mxfp4(xf: torch.Tensor, e2m1: E2M1Rounding) -> QTensor:
    # OCP MX v1.0 shared exponent floor(log2(amax)) - emax_elem, exact via frexp (amax = m * 2**e, m in [0.5, 1)
    # -> floor(log2(amax)) = e - 1)
    xb = _blocks(xf, 32)
    bmax = finite_abs(xb).amax(dim=-1)  # [..., D/32]
    _, e = torch.frexp(bmax)
    shared = torch.where(bmax > 0, e - 1 - 2, torch.full_like(e, -127)).clamp(-127, 127)
    y = xb / exp2_int(shared).unsqueeze(-1)
    codes = e2m1.encode(y, "even")
    return QTensor(codes=_pack(codes.flatten(-2)), block_scales=(shared + 127).to(torch.uint8))


# ---------------------------------------------------------------------------------------------------------------
# per-token-head FP8 / INT4 (vLLM's Triton backend), float16


# vLLM vllm/v1/attention/ops/int4_per_token_head.py @ 055e47c28003156421365af985d676fc921cb075 (`_get_rht_signs`,
# `single_rht`, `fast_hadamard_transform`'s PyTorch butterfly tier, `_reshape_cache_int4_kernel`); the per-token-head
# FP8 write kernel: vllm/v1/attention/ops/triton_quant_kv/_per_token_head_kernel.py @
# 8940d7db4a47a9d9700bad90f1142130f699950c (`_reshape_cache_per_token_head_kernel`).
RHT_SEED = 0x9E3779B9  # vLLM's seed of round 0 of the sign vector (0x9E3779B9 + round_idx * 0x517CC1B7)
PTH_SCALE_MIN = 1e-6  # vLLM's floor of a per-token-head scale (tl.maximum(..., 1e-6))
INT4_LEVELS = 15.0


def rht_signs(d: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """vLLM's deterministic +-1 signs D1 of the randomized Hadamard transform, float32 [d]: torch's CPU Bernoulli
    draws from a CPU generator seeded 0x9E3779B9 (cached per (d, device))."""
    key = (f"rht_signs:{d}", torch.device(device))
    t = _CONST_CACHE.get(key)
    if t is None:
        gen = torch.Generator(device="cpu")
        gen.manual_seed(RHT_SEED)
        signs = 2.0 * torch.bernoulli(torch.full((d,), 0.5), generator=gen) - 1.0
        t = _CONST_CACHE[key] = signs.to(device)
    return t


def hadamard(x: torch.Tensor) -> torch.Tensor:
    """Unnormalised Walsh-Hadamard transform H_d x along the last dim (H_d H_d = d I), vLLM's PyTorch butterfly
    (the order of its float additions); d must be a power of two."""
    d = x.shape[-1]
    h = 1
    while h < d:
        xv = x.reshape(*x.shape[:-1], d // (2 * h), 2, h)
        a, b = xv[..., 0, :], xv[..., 1, :]
        x = torch.stack([a + b, a - b], dim=-2).reshape(x.shape)
        h <<= 1
    return x


def rht(x: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """vLLM's `single_rht`: H (D1 x) forward, (H x) D1 inverse (x float32 [..., d]). The inverse of the forward is
    rht(y, inverse=True) / d."""
    d1 = rht_signs(x.shape[-1], x.device)
    return hadamard(x) * d1 if inverse else hadamard(x * d1)


def check_int4_head_dim(d: int) -> None:
    if d < 2 or d & (d - 1):
        raise UsageError(
            f"int4_per_token_head needs a power-of-two head_dim (vLLM rotates K/V by a {d}-point Hadamard transform, "
            f"which exists only for powers of two), got {d}"
        )


def _round_half_away(y: torch.Tensor) -> torch.Tensor:
    """vLLM's `where(y >= 0, (y + 0.5).to(int32), (y - 0.5).to(int32))` as float32 (truncation toward zero of
    y +- 0.5 in float32; |y| stays far below 2**31 here)."""
    return torch.where(y >= 0, torch.trunc(y + 0.5), torch.trunc(y - 0.5))


def _quantize_int8_static(xf: torch.Tensor, s: torch.Tensor) -> QTensor:
    """TensorRT-LLM's INT8 KV cache: `cuda_cast<int8_t>(x * kv_orig_quant_scale)` = PTX `cvt.rni.sat.s8.f32`
    (round to nearest even, saturate to [-128, 127], NaN -> 0) of x times the fp32 reciprocal of
    kv_cache_scaling_factor (s; x ~ codes * s). The engine's int8 has no NaN: NaN is stored as 0, as there
    (the cache still counts it as non-finite K/V)."""
    y = xf * (1.0 / _bcast(s, xf.dim()))
    codes = torch.round(y).clamp_(-128.0, INT8_MAX).nan_to_num_(nan=0.0)  # torch.round: half to even
    return QTensor(codes=codes.to(torch.int8), scale=s)


def _quantize_fp8_token(xf: torch.Tensor) -> QTensor:
    # scale = max(amax / 448, 1e-6) over the finite values; codes = e4m3(clamp(x * (1 / scale), +-448))
    s = (finite_abs(xf).amax(dim=-1, keepdim=True) / FP8_E4M3_MAX).clamp_(min=PTH_SCALE_MIN)  # [..., 1]
    codes = (xf * (1.0 / s)).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn)  # NaN stays NaN
    return QTensor(codes=codes, block_scales=s)


def _quantize_int4_rht(x: torch.Tensor) -> QTensor:
    """x: K or V in the dtype the engine holds them ([..., D], D a power of two)."""
    check_int4_head_dim(x.shape[-1])
    # vLLM: key = single_rht(key.float()).to(key.dtype) -- the rotated values are rounded to K/V's own dtype
    xr = rht(as_f32(x))
    if x.dtype in (torch.bfloat16, torch.float16):
        xr = xr.to(x.dtype)
    y = xr.float()
    bad = ~torch.isfinite(y).all(dim=-1, keepdim=True)  # [..., 1]: a non-finite input spreads over its whole row
    yz = torch.where(bad, 0.0, y)
    lo, hi = yz.amin(dim=-1, keepdim=True), yz.amax(dim=-1, keepdim=True)
    s = ((hi - lo) / INT4_LEVELS).clamp_(min=PTH_SCALE_MIN)  # [..., 1]
    zp = _round_half_away(-lo / s).clamp_(0.0, INT4_LEVELS)
    q = _round_half_away(yz * (1.0 / s) + zp).clamp_(0.0, INT4_LEVELS).to(torch.uint8)
    # the zero point replaces the 4 low mantissa bits of the fp32 scale
    word = (s.view(torch.int32) & -16) | zp.to(torch.int32)
    word = torch.where(bad, torch.tensor(float("nan")).view(torch.int32), word)  # kvcal's NaN marker: the row
    return QTensor(codes=_pack(q), block_scales=word.view(torch.float32))


def int4_scale_zero(word: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(scale, zero point) float32 of int4_per_token_head's packed fp32 words [..., 1]: the word with its 4 low
    mantissa bits cleared, and those bits (vLLM's read kernel)."""
    bits = word.view(torch.int32)
    return (bits & -16).view(torch.float32), (bits & 0xF).float()


def _dequantize_int4_rht(q: QTensor) -> torch.Tensor:
    """Unrotated float32 values: ((code - zp) * scale) in the rotated basis, rotated back by rht(., inverse) / D.
    vLLM's attention instead rotates Q (rounded to its dtype) and rotates the output back; with exact arithmetic
    the two give the same attention output."""
    c = q.codes
    codes = torch.stack((c & 0x0F, c >> 4), dim=-1).flatten(-2).float()  # [..., D]
    s, zp = int4_scale_zero(q.block_scales)
    y = (codes - zp) * s
    return rht(y, inverse=True) / float(codes.shape[-1])


# ---------------------------------------------------------------------------------------------------------------
# TurboQuant (vLLM `--kv-cache-dtype turboquant_*`), transcribed from vllm-project/vllm:
#   vllm/model_executor/layers/quantization/turboquant/config.py @ 1471680b24719d9d3b2fe1235878196142af89cc
#     (TQ_PRESETS, key_packed_size / value_packed_size / slot_size_aligned, get_boundary_skip_layers)
#   .../turboquant/centroids.py @ 06d0369d75e060e83dffac3e0190ceff8fc37e12 (solve_lloyd_max, get_centroids)
#   .../turboquant/quantizer.py @ 52768069832's version with generate_wht_signs (torch.randint signs) and
#   vllm/model_executor/layers/attention/attention.py (_init_turboquant_buffers: seed 42 + layer * 1337)
#   vllm/v1/attention/backends/turboquant_attn.py @ bcbe0bc87502ab0f12208c359954c8940fe0aec8 (_build_hadamard,
#     _ensure_on_device: PiT = signs[:, None] * H / sqrt(D), midpoints of the sorted centroids)
#   vllm/v1/attention/ops/triton_turboquant_store.py @ 0135d081c30fa476130ae77a152539ce317ab8b1 (launcher: norm,
#     x / (norm + 1e-8), @ PiT; _tq_fused_store_mse / _fp8 / _store_quantized_value)
#   vllm/v1/attention/ops/triton_turboquant_decode.py @ 055e47c28003156421365af985d676fc921cb075 (_tq_decode_stage1,
#     _tq_full_dequant_kv: NORM_CORRECTION, value = idx * scale + zero)
TQ_SEED = 42  # TurboQuantConfig.seed
TQ_LAYER_SEED_STRIDE = 1337  # _init_turboquant_buffers: seed = 42 + layer_idx * 1337
TQ_BOUNDARY_LAYERS = 2  # get_boundary_skip_layers(model_config, n=2): first and last 2 layers stay 'auto'
TQ_NORM_EPS = 1e-8  # x / (norm + 1e-8)
TQ_SCALE_MIN = 1e-8  # values: tl.where(v_scale > 1e-8, v_scale, 1e-8)
TQ_NC_EPS = 1e-16  # norm correction: 1 / sqrt(sum(c * c) + 1e-16)
_LLOYD_MAX_ITER, _LLOYD_MAX_TOL, _TRAPZ_N = 200, 1e-10, 200


def tq_side_extra_bytes(f: KVFormat) -> int:
    """Bytes a TurboQuant side stores per (token, head) beside its codes: the fp16 norm of a key (2), the fp16 scale
    and zero of a value (4), nothing for FP8 keys."""
    return {"tq_mse": 2, "tq_uniform": 4}.get(f.element, 0)


def tq_slot_bytes(preset: str, head_dim: int) -> int:
    """vLLM's TurboQuantConfig.slot_size_aligned: bytes per (token, KV head) of a TurboQuant layer, K and V together
    ([key_packed | value_packed], rounded up to an even count)."""
    k, v = TQ_PRESETS[preset]
    kps = head_dim if k.element == "tq_fp8" else math.ceil(head_dim * k.bits / 8) + 2
    vps = math.ceil(head_dim * v.bits / 8) + 4
    s = kps + vps
    return s + s % 2


def tq_boundary_layers(num_layers: int, n: int = TQ_BOUNDARY_LAYERS) -> frozenset[int]:
    """vLLM's get_boundary_skip_layers for a dense model: the first n and last n layers, n capped at half."""
    if n <= 0 or num_layers <= 0:
        return frozenset()
    n = min(n, num_layers // 2)
    return frozenset(range(n)) | frozenset(range(num_layers - n, num_layers))


def check_tq_sliding(name: str, sliding: list[int]) -> None:
    """UsageError when a TurboQuant preset would hold sliding-window layers (their indices, the skipped ones left
    out): vLLM's TurboQuantAttentionImpl takes no sliding window (its decode kernel and prefill attend every cached
    token) and a sliding layer's KV spec is no TurboQuant page, so what vLLM computes there is not established."""
    if sliding:
        raise UsageError(
            f"{name} on sliding-window layers ({', '.join(map(str, sliding[:6]))}{'...' if len(sliding) > 6 else ''}) "
            "is not emulated: vLLM's TurboQuant attention takes no sliding window; keep them in BF16 with "
            "--skip-layers sliding_window (vLLM: --kv-cache-dtype-skip-layers sliding_window)"
        )


def check_tq_head_dim(name: str, d: int) -> None:
    """UsageError unless vLLM builds this preset's cache for head_dim d."""
    if d < 2 or d & (d - 1):
        raise UsageError(
            f"{name} needs a power-of-two head_dim (vLLM builds a head_dim-point Sylvester Hadamard matrix for every "
            f"TurboQuant layer, turboquant_k8v4 included), got {d}"
        )
    k, v = TQ_PRESETS[name] if name in TQ_PRESETS else (TQ_SIDES[name], TQ_SIDES[name])
    if d < 8 and 3 in (k.bits, v.bits):
        raise UsageError(f"{name} packs 3-bit codes in groups of 8 elements: head_dim must be at least 8, got {d}")


def tq_signs(d: int, layer: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """The +-1 signs float32 [d] of layer `layer`'s rotation (vLLM's generate_wht_signs): torch.randint(0, 2) from a
    CPU generator seeded 42 + layer * 1337, times 2 minus 1."""
    key = (f"tq_signs:{d}:{layer}", torch.device(device))
    t = _CONST_CACHE.get(key)
    if t is None:
        gen = torch.Generator(device="cpu")
        gen.manual_seed(TQ_SEED + layer * TQ_LAYER_SEED_STRIDE)
        bits = torch.randint(0, 2, (d,), generator=gen, device="cpu")
        t = _CONST_CACHE[key] = (bits.float() * 2 - 1).to(device)
    return t


@cache
def tq_hadamard_entry(d: int) -> float:
    """|entry| of vLLM's orthonormal Hadamard matrix, the float32 `1 / sqrt(d)` its `H / math.sqrt(d)` stores (every
    entry of the d x d float32 division on CPU, where vLLM builds it)."""
    h = torch.ones(d, d) / math.sqrt(d)
    if not bool((h == h[0, 0]).all()):  # one value, whatever path torch's division takes
        raise RuntimeError(f"Hadamard entries of size {d} differ")
    return float(h[0, 0])


def tq_rotate(x: torch.Tensor, signs: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """x float32 [..., D] times vLLM's rotation: forward `x @ PiT` with PiT = diag(signs) H / sqrt(D), inverse
    `x @ Pi` (Pi = PiT^T). Each output is h * (a sum of +-x_i), h = `tq_hadamard_entry`: kvcal sums in float64 (the
    butterfly `hadamard`, exact but in the rarest cases) and rounds h * sum to float32 once, so the result never
    depends on a BLAS or on the tensor's shape; vLLM's cuBLAS GEMM rounds each product and sums in its own order
    (the same value to an ulp or two)."""
    xd = x.double()
    s = signs.to(device=x.device, dtype=torch.float64)
    if not inverse:
        xd = xd * s
    y = hadamard(xd) * tq_hadamard_entry(x.shape[-1])
    if inverse:
        y = y * s
    return y.float()


def _lloyd_max(d: int, bits: int) -> list[float]:
    """vLLM's solve_lloyd_max(d, bits) centroids in float64, the same float operations in the same order: N(0, 1/d)
    density, trapezoid integrals of 200 steps, start uniform on +-3.5 sigma, outer edges at 3x that, stop (keeping
    the previous centroids) once no centroid moves by 1e-10."""
    n_levels = 2**bits
    sigma2 = 1.0 / d
    sigma = math.sqrt(sigma2)
    coef = 1.0 / math.sqrt(2 * math.pi * sigma2)

    def pdf(x: float) -> float:
        return coef * math.exp(-x * x / (2 * sigma2))

    def trapz(f: Callable[[float], float], a: float, b: float) -> float:
        h = (b - a) / _TRAPZ_N
        acc = 0.5 * (f(a) + f(b))
        for i in range(1, _TRAPZ_N):
            acc += f(a + i * h)
        return acc * h

    lo, hi = -3.5 * sigma, 3.5 * sigma
    cents = [lo + (hi - lo) * (i + 0.5) / n_levels for i in range(n_levels)]
    for _ in range(_LLOYD_MAX_ITER):
        mids = [(cents[i] + cents[i + 1]) / 2.0 for i in range(n_levels - 1)]
        edges = [lo * 3, *mids, hi * 3]
        new = []
        for i in range(n_levels):
            a, b = edges[i], edges[i + 1]
            num = trapz(lambda x: x * pdf(x), a, b)
            den = trapz(pdf, a, b)
            new.append(num / den if den > 1e-15 else cents[i])
        if max(abs(new[i] - cents[i]) for i in range(n_levels)) < _LLOYD_MAX_TOL:
            break
        cents = new
    return cents


def tq_centroids(d: int, bits: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """vLLM's get_centroids(d, bits): the Lloyd-Max levels of N(0, 1/d), float32 [2**bits], ascending."""
    key = (f"tq_centroids:{d}:{bits}", torch.device(device))
    t = _CONST_CACHE.get(key)
    if t is None:
        t = _CONST_CACHE[key] = torch.tensor(_lloyd_max(d, bits), dtype=torch.float32).to(device)
    return t


def tq_midpoints(d: int, bits: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """The store kernel's decision boundaries float32 [2**bits - 1]: (c[i] + c[i+1]) / 2 of the sorted float32
    centroids, in float32 (_ensure_on_device)."""
    c = tq_centroids(d, bits, device).sort().values
    return (c[:-1] + c[1:]) / 2


def tq_pack(idx: torch.Tensor, bits: int) -> torch.Tensor:
    """Codes [..., D] (uint8, < 2**bits) -> uint8 [..., ceil(D * bits / 8)], vLLM's packing: 4 bits: element 2i in
    the low nibble of byte i; 3 bits: each 8 elements form a 24-bit little-endian word, element j at bit 3j."""
    if bits == 4:
        return _pack(idx)
    g = idx.unflatten(-1, (-1, 8)).to(torch.int32)  # [..., D/8, 8]
    word = (g << torch.arange(0, 24, 3, dtype=torch.int32, device=idx.device)).sum(-1)  # disjoint bits: | = +
    out = torch.stack([(word >> sh) & 0xFF for sh in (0, 8, 16)], dim=-1)  # [..., D/8, 3]
    return out.flatten(-2).to(torch.uint8)


def tq_unpack(packed: torch.Tensor, bits: int, d: int) -> torch.Tensor:
    """Inverse of tq_pack: int64 codes [..., d] (what the read kernels' byte / bit arithmetic extracts)."""
    if bits == 4:
        return torch.stack((packed & 0x0F, packed >> 4), dim=-1).flatten(-2)[..., :d].long()
    b = packed.unflatten(-1, (-1, 3)).long()  # [..., D/8, 3]
    word = b[..., 0] | (b[..., 1] << 8) | (b[..., 2] << 16)
    shifts = torch.arange(0, 24, 3, device=packed.device)
    return ((word.unsqueeze(-1) >> shifts) & 7).flatten(-2)


def _nan_rows(bad: torch.Tensor, fill: torch.Tensor) -> torch.Tensor:
    """fill (float16 [..., n]) with NaN in the rows where bad ([..., 1])."""
    return torch.where(bad, torch.tensor(float("nan"), dtype=fill.dtype, device=fill.device), fill)


def _quantize_tq_fp8(xf: torch.Tensor) -> QTensor:
    # _tq_fused_store_fp8: k.to(float8e4nv) in the kernel (Hopper's cvt.rn.satfinite): RNE, +-448 saturated, no scale
    return QTensor(codes=xf.clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn))


def _quantize_tq_mse(xf: torch.Tensor, f: KVFormat, signs: torch.Tensor) -> QTensor:
    """Keys xf float32 [..., D]: codes of the rotated unit vector, fp16 norm. signs: the layer's [D]."""
    d = xf.shape[-1]
    bad = ~torch.isfinite(xf).all(dim=-1, keepdim=True)  # [..., 1]
    xz = torch.where(bad, 0.0, xf)
    # k_flat.norm(dim=1) in float32: kvcal takes the float64 norm rounded once (no reduction order to depend on)
    norm = xz.double().square().sum(dim=-1, keepdim=True).sqrt().float()  # [..., 1]
    y = tq_rotate(xz / (norm + TQ_NORM_EPS), signs)  # x_hat @ PiT, [..., D]
    # the kernel's binary search: code = number of midpoints <= y
    idx = torch.bucketize(y, tq_midpoints(d, f.bits, xf.device), right=True).to(torch.uint8)
    idx = torch.where(bad, 0, idx)
    # NaN marker: a non-finite row is stored with a NaN norm (vLLM's NaN / Inf norm makes the row NaN / +-Inf too)
    norm16 = _nan_rows(bad, norm.to(torch.float16))  # beyond 65504 the fp16 norm is Inf, as the engine's
    return QTensor(codes=tq_pack(idx, f.bits), block_scales=norm16, scale=signs)


def _quantize_tq_uniform(xf: torch.Tensor, f: KVFormat) -> QTensor:
    """Values xf float32 [..., D]: _store_quantized_value (scale in float32 for the codes, stored as fp16)."""
    levels = float(2**f.bits - 1)
    bad = ~torch.isfinite(xf).all(dim=-1, keepdim=True)  # [..., 1]
    xz = torch.where(bad, 0.0, xf)
    vmin, vmax = xz.amin(dim=-1, keepdim=True), xz.amax(dim=-1, keepdim=True)
    s = (vmax - vmin) / levels
    s = torch.where(s > TQ_SCALE_MIN, s, TQ_SCALE_MIN)
    # ((v - min) / scale + 0.5).to(int32): truncation, of a value >= 0.5 (v >= min)
    q = torch.trunc((xz - vmin) / s + 0.5).clamp_(0.0, levels).to(torch.uint8)
    q = torch.where(bad, 0, q)
    words = _nan_rows(bad, torch.cat([s.to(torch.float16), vmin.to(torch.float16)], dim=-1))  # [..., 2]
    return QTensor(codes=tq_pack(q, f.bits), block_scales=words)


def tq_mse_rotated(q: QTensor, f: KVFormat, d: int) -> torch.Tensor:
    """Keys of a tq_mse side in the ROTATED basis, float32 [..., D]: float32(norm16) * centroid[code], the centroid
    vector norm-corrected (what the decode kernels compute before any rotation; LMCache's _tq_full_dequant_kv stores
    it as float16)."""
    c = tq_centroids(d, f.bits, q.codes.device)[tq_unpack(q.codes, f.bits, d)]  # [..., D]
    # NORM_CORRECTION: c * (1 / sqrt(sum(c * c) + 1e-16)); the kernel's tl.sum / tl.sqrt / 1.0 / x are the
    # GPU's (approximate) ones, kvcal's the float64 sum rounded once, correctly rounded sqrt and division
    # (torch's float32 CPU sqrt is not always correctly rounded: sqrt and 1 / x are taken in float64 and rounded
    # to float32, which is the correctly rounded float32 result for float32 operands)
    nsq = c.double().square().sum(dim=-1, keepdim=True).float() + TQ_NC_EPS  # [..., 1] float32
    root = nsq.double().sqrt().float()
    c = c * (1.0 / root.double()).float()
    return q.block_scales.float() * c  # vec_norm (fp16 -> fp32) * centroid


def _dequantize_tq_mse(q: QTensor, f: KVFormat, d: int) -> torch.Tensor:
    """Unrotated float32 keys: norm * centroid (unit-norm corrected) rotated back by Pi. vLLM's decode instead
    rotates the query (q @ PiT) and scores norm * (q_rot . c): the same logits to float32 rounding."""
    signs = q.scale if q.scale is not None else tq_signs(d, 0, q.codes.device)
    return tq_rotate(tq_mse_rotated(q, f, d), signs, inverse=True)


def _dequantize_tq_uniform(q: QTensor, f: KVFormat, d: int) -> torch.Tensor:
    idx = tq_unpack(q.codes, f.bits, d).float()
    w = q.block_scales.float()  # [..., 2]: fp16 scale, fp16 zero
    # idx * scale + zero: the product is exact (4 + 11 bits), so this rounds once, as the kernel's FMA
    return idx * w[..., :1] + w[..., 1:]


def _tq_head_dim(q: QTensor, f: KVFormat) -> int:
    """head_dim of a TurboQuant side's storage (codes are packed bytes)."""
    n = q.codes.shape[-1]
    return n if f.element == "tq_fp8" else n * 8 // f.bits


def _quantize_tq(x: torch.Tensor, f: KVFormat, scale: torch.Tensor | float | None) -> QTensor:
    """A TurboQuant side; `scale` of a key side (tq_mse) is the layer's rotation signs [D] (`tq_signs`; default
    layer 0's), ignored by the others (TurboQuant applies no k_scale / v_scale)."""
    check_tq_head_dim(f.name, x.shape[-1])
    xf = as_f32(x)
    if f.element == "tq_fp8":
        return _quantize_tq_fp8(xf)
    if f.element == "tq_uniform":
        return _quantize_tq_uniform(xf, f)
    if isinstance(scale, torch.Tensor) and scale.dim() == 1 and scale.numel() == x.shape[-1]:
        signs = scale
    else:
        signs = tq_signs(x.shape[-1], 0, x.device)
    return _quantize_tq_mse(xf, f, signs)


def quantize(
    x: torch.Tensor,
    fmt: str | KVFormat,
    scale: float | torch.Tensor | None = None,
    *,
    scale_checked: bool = False,
) -> QTensor:
    """Quantize x: [..., D] (cache layout [B, H_kv, T, D]) to `fmt`'s storage layout.

    `scale`: fp8_* — the static scale (x ~ codes * scale): float / 0-d / [H_kv] along dim 1 / [B, 1, 1, 1] per
    sequence, default 1.0; nvfp4 / nvfp4_4over6 — the global scale (same shapes), default
    `nvfp4_dynamic_global(x)`; other formats ignore it. `scale_checked`: scale is a tensor `check_scale` returned
    (or one computed positive and finite), not validated again."""
    f = get_format(fmt)
    if f.element == "auto":
        return QTensor(codes=x)
    if f.element == "int4_rht":
        return _quantize_int4_rht(x)  # rounds its rotation to x's own dtype, as vLLM does
    if f.element.startswith("tq_"):
        return _quantize_tq(x, f, scale)
    if f.element == "bf16" and x.dtype == torch.bfloat16:
        # the float32 detour changes nothing for bf16 input (the bounds are bf16 values): one op instead of three
        return QTensor(codes=x.clamp(-BF16_MAX, BF16_MAX))
    xf = as_f32(x)
    default = 1.0 if f.layout != "nvfp4" else None
    s = static_scale(scale, xf, default, scale_checked) if f.calibratable else None
    return quantize_f32(xf, f, s)


def quantize_f32(
    xf: torch.Tensor, f: KVFormat, s: torch.Tensor | None, e2m1: E2M1Rounding = PLAIN_E2M1
) -> QTensor:
    """quantize's body: xf float32 [..., D] (`as_f32`), s the scale of a calibratable format as `static_scale`
    returns it (ignored by the others), E2M1 rounding by `e2m1`."""
    if f.element == "bf16":
        return QTensor(codes=xf.clamp(-BF16_MAX, BF16_MAX).to(torch.bfloat16))
    if f.element == "fp16":
        return QTensor(codes=xf.to(torch.float16))  # IEEE cast: beyond +-65504 rounds to +-Inf, as the engine
    if f.element == "e4m3_token":
        return _quantize_fp8_token(xf)
    if f.element == "int4_rht":
        return _quantize_int4_rht(xf)
    if f.element.startswith("tq_"):
        return _quantize_tq(xf, f, s)
    if f.element in ("e4m3", "e5m2"):
        return _quantize_fp8(xf, f, s)  # type: ignore[arg-type]
    if f.element == "int8s":
        return _quantize_int8_static(xf, s)  # type: ignore[arg-type]
    if f.element == "int8":
        return _quantize_int8(xf)
    if f.name == "nvfp4":
        return _quantize_nvfp4(xf, s, e2m1)
    if f.name == "nvfp4_4over6":
        return _quantize_nvfp4_4over6(xf, s, e2m1)
    if f.name == "fp4_e2m1":
        return _quantize_fp4_e2m1(xf, e2m1)
    return _quantize_mxfp4(xf, e2m1)


def dequantize(q: QTensor, fmt: str | KVFormat, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The values a QTensor stands for, as `dtype` ([..., D])."""
    f = get_format(fmt)
    c = q.codes
    if f.element in ("auto", "bf16"):
        # bf16 -> float16 saturates (65504 stored as bf16 is 65536)
        return c if c.dtype == dtype else _to(c.float(), dtype)
    if f.element == "fp16":
        return c if c.dtype == dtype else c.to(dtype)  # a float16 cache's +-Inf stays +-Inf (the engine reads it)
    if f.element == "e4m3_token":
        return _to(c.float() * q.block_scales, dtype)
    if f.element == "int8s":
        s = q.scale if q.scale is not None else torch.tensor(1.0, device=c.device)
        return _to(c.float() * _bcast(s.float(), c.dim()), dtype)
    if f.element == "int4_rht":
        return _to(_dequantize_int4_rht(q), dtype)
    if f.element == "tq_fp8":
        return _to(c.float(), dtype)
    if f.element == "tq_mse":  # an fp16 norm / scale beyond 65504 is Inf: the engine reads +-Inf, so does kvcal
        return _to_keep_inf(_dequantize_tq_mse(q, f, _tq_head_dim(q, f)), dtype)
    if f.element == "tq_uniform":
        return _to_keep_inf(_dequantize_tq_uniform(q, f, _tq_head_dim(q, f)), dtype)
    if f.element in ("e4m3", "e5m2"):
        s = q.scale if q.scale is not None else torch.tensor(1.0, device=c.device)
        return _to(c.float() * _bcast(s.float(), c.dim()), dtype)
    if f.element == "int8":
        y = c.float() * q.block_scales
        return _to(torch.where(c == INT8_NAN, float("nan"), y), dtype)
    vals = e2m1_decode(unpack_fp4(c)).unflatten(-1, (-1, f.block_size))  # [..., D/bs, bs]
    if f.layout == "nvfp4":
        eff = q.block_scales.float() * _bcast(q.scale.float(), c.dim())  # [..., D/16]
    else:
        eff = e8m0_to_float(q.block_scales)
    return _to(vals * eff.unsqueeze(-1), dtype).flatten(-2)


def _to(y: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Cast saturating: a dequantized value may round just past the largest finite value of `dtype`
    (codes * scale near float32's max, or the x's own float16 max times a block scale rounded up). NaN stays."""
    if dtype.is_floating_point:
        fi = torch.finfo(dtype) if dtype.itemsize <= 4 else torch.finfo(torch.float32)
        y = y.clamp(fi.min, fi.max)
    return y.to(dtype)


def _to_keep_inf(y: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`_to` for values whose +-Inf the engine itself produced (TurboQuant's float16 norms and scales): finite
    values saturate, +-Inf and NaN stay."""
    return torch.where(torch.isinf(y), y, _to(y, torch.float32)).to(dtype) if dtype.is_floating_point else _to(y, dtype)


def fake_quantize(
    x: torch.Tensor, fmt: str | KVFormat, scale: float | torch.Tensor | None = None
) -> torch.Tensor:
    """quantize then dequantize; returns x's dtype and shape ('auto' returns x itself)."""
    f = get_format(fmt)
    if f.element == "auto":
        return x
    return dequantize(quantize(x, f, scale), f, dtype=x.dtype)
