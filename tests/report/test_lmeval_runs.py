"""lm-eval output folders as runs (issue 23, item 1): model_args of the engines' documented forms, the layout
checks and the one-line errors. End to end with lm-eval's own CLI: tests/report/test_lmeval_compare.py."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from kvcal.errors import UsageError
from kvcal.report.compare import compare_runs, parse_labels
from kvcal.report.lmeval_runs import engine_config, engine_kv_format, parse_model_args, split_date_id

Invoke = Callable[[list[str]], tuple[int, str, str]]


# ---- model_args ---------------------------------------------------------------------------------------------
# The forms lm-eval's README documents for its vllm and sglang backends, with the KV settings added as
# EngineArgs / ServerArgs keyword arguments.
VLLM = (
    "pretrained=meta-llama/Llama-3.1-8B-Instruct,tensor_parallel_size=2,dtype=auto,gpu_memory_utilization=0.8,"
    "data_parallel_size=1,kv_cache_dtype=fp8,calculate_kv_scales=True"
)
SGLANG = (
    "pretrained=meta-llama/Llama-3.1-8B-Instruct,dp_size=1,tp_size=2,dtype=auto,kv_cache_dtype=fp8_e4m3,"
    "quantization_param_path=/ckpt/kv_cache_scales.json"
)


def test_vllm_model_args_string() -> None:
    args = parse_model_args(VLLM)
    assert args["tensor_parallel_size"] == 2 and args["calculate_kv_scales"] is True  # lm-eval's own parser
    ec = engine_config({"model": "vllm", "model_args": VLLM})
    assert (ec.backend, ec.model, ec.kv_format) == ("vllm", "meta-llama/Llama-3.1-8B-Instruct", "fp8_e4m3")
    assert ec.scale_source == "first-batch" and ec.scales is None and ec.skip_layers == ""
    assert ec.dtype == "auto"


def test_sglang_model_args_string() -> None:
    ec = engine_config({"model": "sglang", "model_args": SGLANG})
    assert ec.kv_format == "fp8_e4m3" and ec.scales == "/ckpt/kv_cache_scales.json" and ec.scale_source is None


def test_dict_model_args_and_skip_layers_list() -> None:
    """lm-eval >= 0.4.8 records model_args as a mapping; vLLM's kv_cache_dtype_skip_layers is a list."""
    ec = engine_config({"model": "vllm", "model_args": {
        "pretrained": "/m", "kv_cache_dtype": "nvfp4", "kv_cache_dtype_skip_layers": ["0", "sliding_window"]}})  # fmt: skip
    assert ec.kv_format == "nvfp4" and ec.skip_layers == "0,sliding_window"


def test_kvcal_and_hf_model_args() -> None:
    ec = engine_config({"model": "kvcal", "model_args": "pretrained=smollm2,kv_format=fp8,kv_scales=s.safetensors"})
    assert (ec.kv_format, ec.scales, ec.scale_source) == ("fp8_e4m3", "s.safetensors", None)
    first = engine_config({"model": "kvcal", "model_args": "pretrained=smollm2,kv_format=fp8,kv_scales=first-batch"})
    assert first.scale_source == "first-batch" and first.scales is None
    hf = engine_config({"model": "hf", "model_args": "pretrained=/m,dtype=bfloat16"})
    assert hf.kv_format == "auto" and hf.dtype == "bfloat16"
    lc = engine_config({"model": "local-completions", "model_args": "model=org/m,base_url=http://h/v1/completions"})
    assert lc.model == "org/m" and lc.kv_format == "auto"


def test_vllm_auto_on_a_checkpoint_with_a_kv_scheme_is_fp8(tmp_path: Path) -> None:
    """vLLM 0.32.0 serves `kv_cache_dtype=auto` as FP8 where the checkpoint declares a kv_cache_scheme (what
    `kvcal export --to vllm` writes); an explicit bfloat16 wins, and a checkpoint without the scheme is BF16."""
    ckpt, plain = tmp_path / "ckpt-fp8", tmp_path / "plain"
    for d, quant in ((ckpt, {"quant_method": "compressed-tensors", "kv_cache_scheme": {"num_bits": 8, "type": "float"}}),
                     (plain, None)):  # fmt: skip
        d.mkdir()
        (d / "config.json").write_text(json.dumps({"model_type": "llama", **({"quantization_config": quant} if quant else {})}))

    def fmt(model: Path, kv: str | None) -> str:
        args = {"pretrained": str(model), **({"kv_cache_dtype": kv} if kv else {})}
        return engine_config({"model": "vllm", "model_args": args}).kv_format

    assert fmt(ckpt, "auto") == fmt(ckpt, None) == "fp8_e4m3"
    assert fmt(ckpt, "bfloat16") == "bf16" and fmt(plain, "auto") == "auto" and fmt(tmp_path / "absent", "auto") == "auto"
    # SGLang reads its scales from quantization_param_path, not the checkpoint's scheme
    assert engine_config({"model": "sglang", "model_args": {"pretrained": str(ckpt)}}).kv_format == "auto"


@pytest.mark.parametrize(
    ("backend", "name", "fmt"),
    [("vllm", "auto", "auto"), ("vllm", "bfloat16", "bf16"), ("vllm", "fp8_e5m2", "fp8_e5m2"),
     ("vllm", "int8_per_token_head", "int8_per_token_head"), ("sglang", "fp4_e2m1", "fp4_e2m1"),
     ("sglang", "bf16", "bf16"), ("vllm", None, "auto")],
)  # fmt: skip
def test_engine_cache_dtypes(backend: str, name: str | None, fmt: str) -> None:
    assert engine_kv_format(backend, name) == fmt


def test_engine_cache_dtype_kvcal_does_not_emulate_is_named() -> None:
    with pytest.raises(UsageError, match="vllm kv_cache_dtype=fp8_ds_mla"):
        engine_kv_format("vllm", "fp8_ds_mla")
    assert engine_kv_format("vllm", "turboquant_k8v4") == "turboquant_k8v4"  # a K/V pair of kvcal's
    with pytest.raises(UsageError, match="kv_cache_dtype=fp8_inc: .*Intel Neural Compressor"):
        engine_kv_format("vllm", "fp8_inc")


def test_date_id_suffix() -> None:
    src = split_date_id("out/vllm@2026-12-02T13-45-50.847617")
    assert src.path == Path("out/vllm") and src.date_id == "2026-12-02T13-45-50.847617"
    assert split_date_id("out/vllm").date_id is None


def test_labels() -> None:
    assert parse_labels(["a=x", "b=y@1"]) == {"x": "a", "y@1": "b"}
    with pytest.raises(UsageError, match="write NAME=PATH"):
        parse_labels(["x"])
    with pytest.raises(UsageError, match="two runs have the label a"):
        parse_labels(["a=x", "a=y"])


# ---- an lm-eval folder written in lm-eval 0.4.13's layout ----------------------------------------------------


def _lm_eval_folder(root: Path, correct: np.ndarray, date_id: str = "2026-12-02T10-00-00.000000", *,
                    samples: bool = True, model_args: str = "pretrained=/m,dtype=float32", shots: int = 0,
                    backend: str = "hf", **drop: bool) -> Path:  # fmt: skip
    """P/<model>/results_<date_id>.json (+ samples_tiny_gen_<date_id>.jsonl) as lm-eval's EvaluationTracker
    writes them; `drop` removes results keys (an unknown layout)."""
    folder = root / "__m"
    folder.mkdir(parents=True, exist_ok=True)
    results = {
        "results": {"tiny_gen": {"alias": "tiny_gen", "exact_match,none": float(correct.mean())}},
        "configs": {"tiny_gen": {"task": "tiny_gen", "num_fewshot": shots, "repeats": 1,
                                 "generation_kwargs": {"until": ["\n"], "max_gen_toks": 4}}},
        "versions": {"tiny_gen": 1.0}, "n-shot": {"tiny_gen": shots},
        "higher_is_better": {"tiny_gen": {"exact_match": True}},
        "config": {"model": backend, "model_args": model_args, "limit": None},
        "lm_eval_version": "0.4.13", "model_name": "/m", "model_name_sanitized": "__m",
    }  # fmt: skip
    for k in [k for k, v in drop.items() if v]:
        results.pop(k)
    (folder / f"results_{date_id}.json").write_text(json.dumps(results))
    if samples:
        recs = [{"doc_id": i, "filter": "none", "metrics": ["exact_match"], "exact_match": float(c),
                 "doc_hash": f"h{i}"} for i, c in enumerate(correct)]  # fmt: skip
        (folder / f"samples_tiny_gen_{date_id}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    return root


def _one_error_line(code: int, err: str) -> str:
    assert code != 0 and err.startswith("Error: ") and err.strip().count("\n") == 0, err
    return err


def test_folder_without_samples_says_log_samples(tmp_path: Path, invoke: Invoke) -> None:
    right = np.arange(20) % 2 == 0
    base = _lm_eval_folder(tmp_path / "base", right)
    bare = _lm_eval_folder(tmp_path / "bare", right, model_args="pretrained=/m,kv_cache_dtype=fp8",
                           backend="vllm", samples=False)  # fmt: skip
    code, _, err = invoke(["compare", str(base), str(bare)])
    assert "rerun lm_eval with --log_samples" in _one_error_line(code, err) and code == 2


def test_unknown_results_layout_names_the_version(tmp_path: Path, invoke: Invoke) -> None:
    right = np.arange(20) % 2 == 0
    base = _lm_eval_folder(tmp_path / "base", right)
    old = _lm_eval_folder(tmp_path / "old", right, configs=True, config=True)
    raw = json.loads(next((old / "__m").glob("results_*.json")).read_text())
    raw["lm_eval_version"] = "0.3.0"
    next((old / "__m").glob("results_*.json")).write_text(json.dumps(raw))
    code, _, err = invoke(["compare", str(base), str(old)])
    assert "from lm-eval 0.3.0, whose results layout kvcal does not know" in _one_error_line(code, err)


def test_two_runs_of_one_label_is_one_error(tmp_path: Path, invoke: Invoke) -> None:
    right = np.arange(20) % 2 == 0
    a = _lm_eval_folder(tmp_path / "a", right)
    b = _lm_eval_folder(tmp_path / "b", right, model_args="pretrained=/m,kv_cache_dtype=fp8", backend="vllm")
    code, _, err = invoke(["compare", str(a), str(b), "--label", f"x={a}", "--label", f"x={b}"])
    assert "two runs have the label x" in _one_error_line(code, err)


def test_mismatched_n_shot_is_refused_naming_it(tmp_path: Path) -> None:
    right = np.arange(20) % 2 == 0
    a = _lm_eval_folder(tmp_path / "a", right)
    b = _lm_eval_folder(tmp_path / "b", right, model_args="pretrained=/m,kv_cache_dtype=fp8", backend="vllm",
                        shots=5)  # fmt: skip
    with pytest.raises(UsageError, match=r"different task settings \(num_fewshot 5 vs 0"):
        compare_runs([a, b], n_boot=100)


def test_latest_date_id_or_the_one_named(tmp_path: Path) -> None:
    """Two results files in one folder: the latest by default, PATH@DATE_ID for the other; the engine's
    kv_cache_dtype=auto baseline is what --baseline bf16 (the default) finds."""
    right = np.arange(30) % 3 > 0
    worse = right.copy()
    worse[:12] = False
    base = _lm_eval_folder(tmp_path / "base", right, model_args="pretrained=/m,kv_cache_dtype=auto", backend="vllm")
    eng = tmp_path / "eng"
    fp8 = "pretrained=/m,kv_cache_dtype=fp8"
    _lm_eval_folder(eng, right, "2026-12-02T09-00-00.000000", model_args=fp8, backend="vllm")
    _lm_eval_folder(eng, worse, "2026-12-02T11-00-00.000000", model_args=fp8, backend="vllm")
    latest = compare_runs([base, eng], n_boot=100)
    assert latest.baseline == "base" and latest.results[0].diff == pytest.approx(-8 / 30)
    first = compare_runs([base, f"{eng}@2026-12-02T09-00-00.000000"], n_boot=100)
    assert first.results[0].diff == 0.0 and first.results[0].identical
    with pytest.raises(UsageError, match="has no lm-eval results of 2026-01-01"):
        compare_runs([base, f"{eng}@2026-01-01"], n_boot=100)
