"""kvcal's divergence tasks: decode through the cache vs chunked prefill, and the task end to end (tiny models)."""

from __future__ import annotations

import copy
import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from kvcal.evaluate.divergence import prefilled, teacher_forced
from kvcal.evaluate.kl import forward_session
from kvcal.kernels.runtime import KVRuntime

PROMPT = [1, 17, 42, 99, 5, 63]
TOKENS = [int(x) for x in torch.randint(3, 300, (40,), generator=torch.Generator().manual_seed(1))]


def _decode_and_prefill(model: Any, make_rt: Callable[[], KVRuntime]) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits [n, V] predicting TOKENS after PROMPT: one token per forward (decode), and chunked prefill of
    PROMPT + TOKENS[:-1] in chunks of 16, each through a fresh runtime's cache."""
    prompt = torch.tensor([PROMPT])
    full = torch.tensor([PROMPT + TOKENS[:-1]])
    with torch.no_grad():
        dec = teacher_forced(forward_session(model, make_rt().new_cache()), prompt, TOKENS)
        pre = prefilled(forward_session(model, make_rt().new_cache()), full, len(PROMPT) - 1, 16)
    return dec, pre


@pytest.mark.parametrize("arch", ["llama", "gemma3"])  # gemma3: sliding layers (window 8) and a full one
@pytest.mark.parametrize("fmt", ["bf16", "fp8_e4m3", "int8_per_token_head", "nvfp4", "fp4_e2m1"])
def test_decode_through_the_cache_equals_chunked_prefill_for_static_scales(
    tiny_model: Callable[[str], Any], arch: str, fmt: str
) -> None:
    # float64 weights: K/V computed by a 1-token and a 16-token forward differ in the last bits only; rounded to
    # bf16 first (the engines' serving dtype, kvcal eval's default) they are the same values, so every format
    # stores the same codes. (Quantized as computed they would not all be: vLLM's int8_per_token_head truncates
    # x * (1 / scale), and a row's maximum lands within an ulp of 127, so last-bit noise flips it to 126.)
    model = copy.deepcopy(tiny_model(arch)).double()
    dec, pre = _decode_and_prefill(model, lambda: KVRuntime(model, fmt, impl="torch", kv_input_dtype="bfloat16"))
    assert dec.shape == pre.shape == (len(TOKENS), model.config.vocab_size)
    # the same codes and scales either way; only the summation order differs
    torch.testing.assert_close(dec, pre, rtol=1e-5, atol=1e-5)  # kvcal attends in float32


def test_decode_differs_from_prefill_where_the_scale_is_fixed_at_the_first_write(
    tiny_model: Callable[[str], Any],
) -> None:
    model = tiny_model("llama")
    static_dec, static_pre = _decode_and_prefill(model, lambda: KVRuntime(model, "fp8_e4m3", impl="torch"))
    # vLLM's calculate_kv_scales: decode's first write is the prompt (its amax fixes the scale); prefill's first
    # write is the whole sequence
    dec, pre = _decode_and_prefill(model, lambda: KVRuntime(model, "fp8_e4m3", impl="torch", first_batch=True))
    static_gap = float((static_dec - static_pre).abs().max())
    gap = float((dec - pre).abs().max())
    assert gap > 1e-3 and gap > 100 * static_gap


# ---- the task, end to end ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_llama(tiny_lm_dir: Callable[..., Path]) -> Path:
    corpus = ["Natalia sold clips to 48 of her friends in April.", "Question: how many? Answer: 72"] * 6
    return tiny_lm_dir("llama", corpus, k_gain=8.0)


def _run(model: Path, fmt: str, out: Path, data: Path, **kw: Any) -> dict[str, Any]:
    from kvcal.evaluate.run import EvalConfig, run_eval
    from kvcal.evaluate.spec import eval_spec

    options: dict[str, Any] = {"limit": 3, "num_fewshot": 0, "max_gen_toks": 12, "dtype": "float32", **kw}
    cfg = EvalConfig(model=str(model), kv_format=fmt, tasks=["divergence"], data_dir=str(data), output=str(out),
                     **options)  # fmt: skip
    run_eval(eval_spec(cfg))
    return json.loads((out / "results.json").read_text())


def _samples(out: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (out / "samples_divergence.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_divergence_task_bf16_agrees_with_itself_and_int8_is_measured(
    tiny_llama: Path, shared_data: Path, tmp_path: Path
) -> None:
    res = _run(tiny_llama, "bf16", tmp_path / "bf16", shared_data)
    r = res["results"]["divergence"]
    assert r["identical,none"] == 1.0 and r["answer_agree,none"] == 1.0 and r["logprobs_close,none"] == 1.0
    assert r["divergences_per_1k,none"] == 0.0 and r["prefill_kl,none"] == 0.0  # the same prefill forwards
    samples = _samples(tmp_path / "bf16")
    assert [s["doc_id"] for s in samples] == [0, 1, 2]
    assert all(not s["diverged"] and s["base_tokens"] == s["quant_tokens"] for s in samples)
    assert all(s["first_divergence"] == s["base_len"] for s in samples)  # censored at the output's end
    buckets = res["divergence_by_position"]["divergence"]["buckets"]
    assert buckets[0]["lo"] == 1
    # the baseline trajectory was decoded once: the int8 run reads it from the cache
    res4 = _run(tiny_llama, "int8_per_token_head", tmp_path / "int8", shared_data)
    assert res4["configs"]["divergence"]["baseline_cache_hits"] == 3
    r4 = res4["results"]["divergence"]
    assert r4["decode_kl,none"] > 0.0 and r4["prefill_kl,none"] > 0.0
    # bf16's decode against the BF16 prefill (its baseline log-probs) is float rounding only: a bound from the
    # run itself, scale-free, not one number of this machine's kernels
    assert r["decode_kl,none"] <= 1e-3 * r4["decode_kl,none"]
    for s in _samples(tmp_path / "int8"):
        t = s["first_divergence"]
        if s["diverged"]:  # the recorded position is the first token that differs
            assert s["base_tokens"][: t - 1] == s["quant_tokens"][: t - 1]
            assert s["base_tokens"][t - 1] != s["quant_tokens"][t - 1]
        else:
            assert s["base_tokens"] == s["quant_tokens"][: len(s["base_tokens"])] or s["quant_tokens"] == s[
                "base_tokens"
            ][: len(s["quant_tokens"])]
    # the report: one agreement row per configuration, survival from the samples, a plot in the HTML
    from kvcal.errors import UsageError
    from kvcal.report.compare import compare_runs
    from kvcal.report.html import render_html
    from kvcal.report.markdown import render_markdown

    cmp = compare_runs([tmp_path / "bf16", tmp_path / "int8"], min_samples=2)
    rows = {r["config"]: r for r in cmp.agreement_rows}
    assert len(rows) == 2 and all(r["task"] == "divergence" for r in rows.values())
    base = next(r for r in rows.values() if r["identical"]["value"] == 1.0)
    assert base["diverged"] == 0 and base["km"]["median"]["value"] is None
    int8 = next(r for r in rows.values() if r is not base)
    assert int8["diverged"] == sum(bool(s["diverged"]) for s in _samples(tmp_path / "int8"))
    assert "## Output agreement with the BF16 trajectory" in render_markdown(cmp)
    assert "survival" in render_html(cmp)
    assert json.loads(json.dumps(cmp.to_dict()))["output_agreement"] == json.loads(json.dumps(cmp.agreement_rows))
    # runs generated with other settings are not compared
    other = tmp_path / "int8_other"
    shutil.copytree(tmp_path / "int8", other)
    res = json.loads((other / "results.json").read_text())
    res["configs"]["divergence"]["gen_len"] = 6
    (other / "results.json").write_text(json.dumps(res))
    with pytest.raises(UsageError, match="gen_len=6"):
        compare_runs([tmp_path / "bf16", other], min_samples=2)


@pytest.mark.slow
def test_divergence_task_in_batches_is_the_same_task(tiny_llama: Path, shared_data: Path, tmp_path: Path) -> None:
    """`--batch-size 2` on lm-eval's gsm8k prompts: samples in document order, bf16 still agrees with its baseline
    bit for bit (the batch's own trajectories: cached under the batch, not reused from batch 1), and the batch's
    trajectories serve the next format at the same batch size."""
    _run(tiny_llama, "bf16", tmp_path / "one", shared_data)
    res = _run(tiny_llama, "bf16", tmp_path / "bf16", shared_data, batch_size=2)
    r, cfg = res["results"]["divergence"], res["configs"]["divergence"]
    # 3 prompts in batches of 2: the pair's trajectories are its own; the last prompt, alone, is batch 1's (a hit)
    assert cfg["batch_size"] == 2 and cfg["baseline_cache_hits"] == 1
    assert r["identical,none"] == 1.0 and r["prefill_kl,none"] == 0.0
    assert [s["doc_id"] for s in _samples(tmp_path / "bf16")] == [0, 1, 2]
    res4 = _run(tiny_llama, "int8_per_token_head", tmp_path / "int8", shared_data, batch_size=2)
    assert res4["configs"]["divergence"]["baseline_cache_hits"] == 3
    one = {s["doc_id"]: s for s in _samples(tmp_path / "one")}
    for s in _samples(tmp_path / "bf16"):  # the same prompts, and (float rounding apart) the same trajectories
        assert s["prompt_sha256"] == one[s["doc_id"]]["prompt_sha256"]
        assert s["base_len"] > 0


def test_divergence_bad_input_is_one_error_line_and_nothing_written(
    tiny_llama: Path, tmp_path: Path, invoke: Callable[[list[str]], tuple[int, str, str]]
) -> None:
    out = tmp_path / "run"
    args = ["eval", str(tiny_llama), "-f", "fp8_e4m3", "--tasks", "divergence", "-o", str(out)]
    # a generation as long as the model's positions (256) leaves no room for the prompt: the limit is named
    code, _, err = invoke([*args, "--max-gen-toks", "256"])
    assert code == 2 and err.startswith("Error: ") and err.count("\n") == 1
    assert "--max-gen-toks 256" in err and "256 positions" in err and not out.exists()
    code, _, err = invoke([*args, "--max-gen-toks", "0"])
    assert code == 2 and err.startswith("Error: ") and "--max-gen-toks" in err and not out.exists()


def test_private_divergence_records_keep_no_decodable_output() -> None:
    from kvcal.evaluate.divergence import private_record

    rec = {"doc_id": 0, "identical": 0.0, "first_divergence": 3, "diverged": True, "base_tokens": [5, 6, 7],
           "quant_tokens": [5, 6, 8], "base_answer": "(A)", "quant_answer": "(B)"}  # fmt: skip
    out = private_record(rec)
    assert "base_tokens" not in out and "quant_tokens" not in out
    assert out["base_answer"].startswith("sha256:") and out["base_answer"] != out["quant_answer"]
    assert {k: out[k] for k in ("doc_id", "first_divergence", "diverged")} == {
        "doc_id": 0, "first_divergence": 3, "diverged": True
    }  # fmt: skip


def test_no_engine_command_is_written_for_a_divergence_task() -> None:
    from kvcal.engines import KVCAL_ONLY_TASKS
    from kvcal.evaluate.tasks import DIVERGENCE_TASKS

    assert set(DIVERGENCE_TASKS) <= KVCAL_ONLY_TASKS


# ---- your own prompts ---------------------------------------------------------------------------------------

PROMPTS = ["Natalia sold clips to 48 of her friends", "Question: how many? Answer:", "sold clips in April"]


def _prompt_file(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


@pytest.mark.slow
def test_divergence_over_your_own_prompts(tiny_llama: Path, tmp_path: Path) -> None:
    """`--prompts FILE.jsonl`: the prompts of the file in order (no lm-eval task, no --data-dir); the answer
    compared is the whole output; another file's runs are refused for pairing."""
    from kvcal.errors import UsageError
    from kvcal.report.compare import compare_runs

    mine = _prompt_file(tmp_path / "mine.jsonl", [{"prompt": p, "id": i} for i, p in enumerate(PROMPTS)])
    kw: dict[str, Any] = {"prompts": str(mine), "limit": None}
    for fmt in ("bf16", "int8_per_token_head"):
        _run(tiny_llama, fmt, tmp_path / fmt, tmp_path, **kw)  # data_dir: any folder (no lm-eval data read)
    base, int8 = _samples(tmp_path / "bf16"), _samples(tmp_path / "int8_per_token_head")
    assert [s["doc_id"] for s in base] == [0, 1, 2] and all(s["identical"] == 1.0 for s in base)
    assert all(s["answer_agree"] == s["identical"] for s in int8)  # the whole output is the answer
    assert all(s["prompt_tokens"] > 0 for s in int8)
    config = json.loads((tmp_path / "bf16" / "results.json").read_text())["configs"]["divergence"]
    assert config["prompts"].startswith("file sha256:") and config["num_fewshot"] is None
    recorded = (tmp_path / "bf16" / "config.yaml").read_text()
    assert str(mine.resolve()) in recorded and "sha256" in recorded
    cmp = compare_runs([tmp_path / "bf16", tmp_path / "int8_per_token_head"], min_samples=2, at_lengths=[8192, 65536])
    assert all(set(r["projection"]) == {"8192", "65536"} for r in cmp.agreement_rows)  # kvcal compare --at-length
    other = _prompt_file(tmp_path / "other.jsonl", [{"prompt": p} for p in reversed(PROMPTS)])
    _run(tiny_llama, "int8_per_token_head", tmp_path / "other", tmp_path, prompts=str(other), limit=None)
    with pytest.raises(UsageError, match="prompts"):
        compare_runs([tmp_path / "bf16", tmp_path / "other"], min_samples=2)


def test_bad_prompt_files_are_one_error_line(
    tiny_llama: Path, tmp_path: Path, invoke: Callable[[list[str]], tuple[int, str, str]]
) -> None:
    no_field = _prompt_file(tmp_path / "text.jsonl", [{"text": "a traffic line, not a prompt"}])
    out = tmp_path / "run"
    base = ["eval", str(tiny_llama), "-f", "fp8_e4m3", "-o", str(out)]
    cases = [
        (["--tasks", "divergence", "--prompts", str(no_field)], "is not a JSON object with a 'prompt' field"),
        (["--tasks", "divergence", "--prompts", str(tmp_path / "missing.jsonl")], "is not a file"),
        (["--tasks", "kl", "--prompts", str(no_field)], "--prompts gives one divergence task its prompts"),
    ]
    for args, message in cases:
        code, _, err = invoke([*base, *args])
        assert code == 2 and err.count("\n") == 1 and err.startswith("Error: ") and message in err, err
        assert not out.exists()


def test_at_length_is_checked(tmp_path: Path, invoke: Callable[[list[str]], tuple[int, str, str]]) -> None:
    code, _, err = invoke(["compare", str(tmp_path), "--at-length", "32x"])
    assert code == 2 and err.count("\n") == 1 and "--at-length: '32x' is not a whole number of tokens" in err
